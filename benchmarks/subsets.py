"""How well the cheap mode's number agrees with the full one (not a test; prints a table or
JSON): the exact batch bound n·Δ = n·S/T over a whole data set, of all trainable parameters
and of the LayerNorm/RMSNorm parameters alone (``watch(subset="norms")``'s quantity, Gray et
al. 2024), at several points of one training run.

Model: Hugging Face GPT2LMHeadModel built from a config (4 layers, width 128, 4 heads, context
64), trained with AdamW (lr 1e-3, batch 32, one thread) on the ``fortunes`` text data set
(1 389 sequences of 64 characters); each checkpoint measures all training sequences exactly
(per-example losses = each sequence's mean next-token cross-entropy, dropout off).

    python benchmarks/subsets.py                       # steps 0, 25, 100, 300
    python benchmarks/subsets.py --steps 0,50 --json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.data import load_dataset
from batchbound.diversity import PreparedStats
from batchbound.diversity.subsets import monitored_parameters


class Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx).logits


def token_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


def gpt2(vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return Logits(GPT2LMHeadModel(GPT2Config(
        n_layer=4, n_embd=128, n_head=4, n_positions=64, vocab_size=vocab, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))


def bounds(model: nn.Module, x: Tensor, y: Tensor, chunk: int = 128) -> dict[str, float]:
    """n·S/T over (x, y) for every parameter and for the norm layers' alone (float64 sums)."""
    norms = set(monitored_parameters(model, "norms"))
    stats_of = PreparedStats(model, token_loss, "hooks")
    S: dict[str, float] = {}
    G: dict[str, Tensor] = {}
    for start in range(0, x.shape[0], chunk):
        stats = stats_of(x[start : start + chunk], y[start : start + chunk])
        for name, sq in stats.sq_norms.items():
            S[name] = S.get(name, 0.0) + float(sq.double().sum())
            g = stats.grad_sum[name].double()
            G[name] = G[name] + g if name in G else g
    n = x.shape[0]

    def bound(names: list[str]) -> float:
        s = sum(S[k] for k in names)
        t = sum(float(G[k].square().sum()) for k in names)
        return n * s / t

    return {"all": bound(list(S)), "norms": bound([k for k in S if k in norms]),
            "norm_params": sum(model.get_parameter(k).numel() for k in norms),
            "params": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="0,25,100,300")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = load_dataset("fortunes")
    x, y = data.x_train, data.y_train
    torch.manual_seed(0)
    model = gpt2(int(max(x.max(), y.max())) + 1).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rows, done = [], 0
    for target in sorted(int(s) for s in args.steps.split(",")):
        while done < target:
            idx = torch.randint(x.shape[0], (32,), generator=g)
            optimizer.zero_grad(set_to_none=True)
            token_loss(model(x[idx]), y[idx]).mean().backward()
            optimizer.step()
            done += 1
        row = {"step": done, **bounds(model, x, y)}
        row["ratio"] = row["norms"] / row["all"]
        rows.append(row)
        if not args.json:
            print(f"step {done:>4}: n·Δ all {row['all']:9.1f}   LayerNorm only "
                  f"{row['norms']:9.1f}   ratio {row['ratio']:.2f}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"(LayerNorm parameters: {rows[0]['norm_params']} of {rows[0]['params']}; "
              f"n = {x.shape[0]} sequences)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
