"""A review of stacking on Hugging Face models whose like layers differ or share: ALBERT
(one layer's modules run by every layer), Gemma (its RMSNorm scales by 1 + weight: no
rule), Qwen3 (RMSNorms over the heads' query and key rows, of other shapes with grouped
keys), GPT-2 (Conv1D stacks); watch on two steps (the first checks the model), in train
mode, against the float64 per-example loop at the step's own dropout masks."""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.unit.test_outside_hf_configs import (
    LAYERS,
    B,
    causal,
    loop,
    masked_tokens,
    per_token,
    tokens,
)

from batchbound.diversity import OnlineDiversity, watch

transformers = pytest.importorskip("transformers")

CASES = {
    # float64 models throughout; Qwen3's norms compute in float32 inside (float32's rounding)
    "albert-shared": (lambda: transformers.AlbertForMaskedLM(transformers.AlbertConfig(
        vocab_size=40, embedding_size=16, hidden_size=32, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=48, max_position_embeddings=32)),
        masked_tokens, per_token, 1e-10),
    "gemma": (lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(
        **LAYERS, num_key_value_heads=2, head_dim=8)), tokens, causal, 1e-6),
    "qwen3-gqa": (lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **LAYERS, num_key_value_heads=2, head_dim=8)), tokens, causal, 1e-6),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, vocab_size=40, n_positions=32, use_cache=False)),
        tokens, causal, 1e-10),
}


@pytest.mark.parametrize("name", list(CASES))
def test_watch_on_like_hf_layers_equals_the_loop(name: str) -> None:
    make, data, loss, rel = CASES[name]
    torch.manual_seed(0)
    model, batch = make().double().train(), data()
    for step in range(2):
        model.zero_grad()
        monitor = OnlineDiversity(1000, decay=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's cost, transformers' deprecations
            with watch(model, monitor):
                torch.manual_seed(3 + step)
                loss(model(**batch), batch).mean().backward()
        model.zero_grad()
        want = OnlineDiversity(1000, decay=0.0)
        want.update_from_norms(*loop(model, batch, loss, seed=3 + step), B)
        assert monitor.m2 == pytest.approx(want.m2, rel=rel)
        assert monitor.cross == pytest.approx(want.cross, rel=100 * rel, abs=rel * want.m2)
