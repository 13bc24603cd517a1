"""The adaptive batch policies against the best fixed batch, over 3 seeds.

On digits (fc, depth 2, ~4000 weights, lr 0.1 for every batch: strategy blr) to 95 % train
accuracy, one worker: fixed B ∈ {16, 32, 64, 128, 256}, ``adaptive(delta=1,...)`` (B ≈ n·Δ̂,
[slides]) and ``adaptive(pick=time,...)`` (least t(B)·(1 + B_noise/B), the advise model),
both re-deciding every 20 iterations between 16 and 512 from an exact Δ̂ whose cost counts
in their seconds. Prints per policy the median over seeds of iterations, examples and
seconds to the target, and each adaptive policy's ratio to the best fixed batch (the fixed
B with the least median seconds).

    .venv/bin/python benchmarks/adaptive.py            # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import math
import statistics

from batchbound.train import TrainConfig, target_list, train

SEEDS = (0, 1, 2)
FIXED = (16, 32, 64, 128, 256)
ADAPTIVE = {"adaptive (B ≈ n·Δ̂)": "adaptive(delta=1,min=16,max=512,every=20)",
            "adaptive (pick=time)": "adaptive(min=16,max=512,every=20,pick=time)"}
BASE = TrainConfig(dataset="digits", model="fc(depth=2,params=4000)", lr=0.1, batch_size=16,
                   targets=target_list(train_acc=0.95), max_epochs=60,
                   eval_every_iterations=2, eval_every_epochs=None)


def measure(config: TrainConfig) -> dict[str, float]:
    """Median over seeds of iterations, examples and seconds to the target (∞ if missed)."""
    its, examples, seconds = [], [], []
    for seed in SEEDS:
        result = train(config.replace(seed=seed))
        t = result.targets[0]
        n = result.environment["n_train"]
        its.append(t.iteration if t.reached else math.inf)
        examples.append(t.epoch * n if t.reached else math.inf)
        seconds.append(t.seconds if t.reached else math.inf)
    return {"iterations": statistics.median(its), "examples": statistics.median(examples),
            "seconds": statistics.median(seconds)}


def main() -> int:
    # no options: the parser is there so that --help explains instead of starting 2 minutes
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rows = {f"fixed B = {b}": measure(BASE.replace(batch_size=b)) for b in FIXED}
    best = min((r for r in rows if r.startswith("fixed")), key=lambda r: rows[r]["seconds"])
    for name, policy in ADAPTIVE.items():
        rows[name] = measure(BASE.replace(batch_policy=policy))
    print("| policy | iterations | examples | seconds | ×best fixed (its / examples / s) |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        ratio = " / ".join(f"{r[k] / rows[best][k]:.2f}" for k in ("iterations", "examples",
                                                                   "seconds"))
        print(f"| {name}{' (best fixed)' if name == best else ''} | {r['iterations']:.0f} | "
              f"{r['examples']:.0f} | {r['seconds']:.3g} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
