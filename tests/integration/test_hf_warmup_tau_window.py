"""BatchWarmupCallback reads a token estimate per sequence as B_noise_tokens / τ. The token
estimate is an average over the monitor's window (``decay``: about the last 1/(1 − decay)
steps), and τ, the labelled tokens per sequence, must be the same window's: it was counted
over the whole run, so where sequence lengths drift (a length curriculum, packing that
changes) the per-sequence B_noise mixed a recent numerator with a stale τ."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)
import transformers

from batchbound.integrations import transformers as integration

VOCAB, LENGTH = 23, 12


class Drifting(Dataset):
    """Sequences whose labelled length is 1 to 11 tokens, ordered short to long."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.rows = []
        for i in range(n):
            ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
            keep = 2 + (i * 10) // n  # 2 … 11 real tokens: τ grows through the epoch
            mask = (torch.arange(LENGTH) < keep).long()
            self.rows.append({"input_ids": ids * mask, "attention_mask": mask,
                              "labels": ids.masked_fill(mask == 0, -100)})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def neox() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout=0.0,
        attention_dropout=0.0))


def test_tau_is_read_over_the_estimates_own_window(tmp_path: Path) -> None:
    decay = 0.5
    model = neox()
    seen: list[tuple[int, int]] = []  # per training micro-batch: labelled tokens, sequences
    model.register_forward_pre_hook(
        lambda m, a, kw: seen.append((int(kw["labels"][..., 1:].ne(-100).sum()),
                                      int(kw["labels"].shape[0])))
        if m.training and torch.is_grad_enabled() else None, with_kwargs=True)
    callback = integration.BatchWarmupCallback(every=100, decay=decay)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=0.0, num_train_epochs=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    data = Drifting(32)
    transformers.Trainer(model=model, args=args, train_dataset=data,
                         callbacks=[callback]).train()
    assert callback.unit == "tokens" and callback.monitor is not None
    steps = [(seen[i][0] + seen[i + 1][0], seen[i][1] + seen[i + 1][1])
             for i in range(0, len(seen), 2)]
    assert len(steps) == 8 and callback.monitor.steps == 8
    weights = [decay ** (len(steps) - 1 - s) for s in range(len(steps))]
    tau = (sum(w * t for w, (t, _) in zip(weights, steps, strict=True))
           / sum(w * q for w, (_, q) in zip(weights, steps, strict=True)))
    whole = sum(t for t, _ in steps) / sum(q for _, q in steps)
    assert abs(tau - whole) > 0.05 * whole  # the data drift enough to tell the two apart
    estimate = callback.estimate()
    assert estimate.noise_scale == pytest.approx(callback.monitor.noise_scale / tau, rel=1e-9)
