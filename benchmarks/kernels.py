"""What portable CPU kernels cost (not a test; prints a table or JSON).

Every batchbound command computes on portable kernels (``batchbound.kernels``: ATen's baseline
x86-64 kernels, MKL's COMPATIBLE branch, oneDNN and NNPACK off) so that the same command gives
the same numbers on every x86-64 processor. This measures the price: seconds per SGD step
(forward, per-example-summed cross-entropy, backward, update) on one thread, in a fresh
process per contender (the kernel path is fixed per process), native and portable
alternating, repeated; the median ratio portable/native is reported per model.

    python benchmarks/kernels.py
    python benchmarks/kernels.py --repeats 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

CASES = [  # (data set, model spec, batch size)
    ("digits", "fc(depth=2,params=4000)", 64),
    ("mnist5k", "fc(depth=3,params=200000)", 256),
    ("mnist5k", "lenet", 64),
    ("fortunes", "gpt(depth=2,width=64,heads=4)", 16),
]

CHILD = r"""
import json, sys, time
from batchbound import kernels
kernels.use(sys.argv[1])
import torch
from batchbound.data import load_dataset
from batchbound.diversity.losses import resolve_loss
from batchbound.models import build_model
torch.set_num_threads(1)
data, spec, batch, steps = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ds = load_dataset(data)
model = build_model(spec, ds.input_shape, ds.num_outputs, seed=0)
loss_fn = resolve_loss(None, ds.task)
x, y = ds.x_train[:batch], ds.y_train[:batch]
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
def step():
    opt.zero_grad()
    loss_fn(model(x), y).sum().backward()
    opt.step()
for _ in range(3):
    step()
start = time.perf_counter()
for _ in range(steps):
    step()
print(json.dumps({"seconds": (time.perf_counter() - start) / steps,
                  "kernels": kernels.describe()}))
"""


def time_steps(kernels: str, data: str, model: str, batch: int, steps: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "BATCHBOUND_KERNELS"):
        env.pop(name, None)  # the child's own kernels.use() decides
    done = subprocess.run([sys.executable, "-c", CHILD, kernels, data, model, str(batch),
                           str(steps)], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for data, model, batch in CASES:
        seconds: dict[str, list[float]] = {"native": [], "portable": []}
        paths = {}
        for _ in range(args.repeats):
            for kernels in ("native", "portable"):
                out = time_steps(kernels, data, model, batch, args.steps)
                seconds[kernels].append(out["seconds"])
                paths[kernels] = out["kernels"]
        ratios = [p / n for p, n in zip(seconds["portable"], seconds["native"], strict=True)]
        rows.append({"data": data, "model": model, "batch": batch,
                     "native_ms": 1e3 * statistics.median(seconds["native"]),
                     "portable_ms": 1e3 * statistics.median(seconds["portable"]),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "native": paths["native"],
                     "portable": paths["portable"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"native: {rows[0]['native']}; portable: {rows[0]['portable']}; "
          f"{args.repeats} alternating repeats of {args.steps} steps, one thread")
    print(f"{'data':<9} {'model':<32} {'B':>4} {'native ms':>10} {'portable ms':>12} "
          f"{'ratio':>6} {'(min–max)':>12}")
    for r in rows:
        print(f"{r['data']:<9} {r['model']:<32} {r['batch']:>4} {r['native_ms']:>10.2f} "
              f"{r['portable_ms']:>12.2f} {r['ratio']:>6.2f} "
              f"{r['ratio_min']:>5.2f}–{r['ratio_max']:<5.2f}")


if __name__ == "__main__":
    main()
