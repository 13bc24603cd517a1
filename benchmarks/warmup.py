"""Does batch-size warmup pay? ``--batch-policy warmup`` against fixed batches (not a test).

Per case and seed: a fixed-B0 run over the budget gives the training loss L it ends at and,
on its own curve, the step it first reached L (rounded up to the evaluation grid the others
are read on); then each contender trains to L (evaluated every few steps): fixed k·B0 for
the k given by ``--fixed`` (rate η0·√k), and warmup from B0 with each trigger: ``warmup``
(its defaults: the branch trigger, first test after 100·B0 examples and then at doubling
example counts, short branches at B, 2B, 4B read on B's trend line, B grows ×2 or ×4 when
the critical batch's interval is at or above 2B or 4B, the rate by srsr) and
``warmup(every=25,trigger=noise)`` (B doubles when 2B ≤ 0.5·(B_noise − SE) from the two-batch
estimate, the rate by McCandlish et al.'s rule). Reported per contender: optimizer steps,
examples and training seconds to L (mean over the seeds, with their range; the branch
trigger's branch steps and examples are included in its steps and examples, and their
seconds in its seconds), and for each warmup the ratios against fixed B0 (steps, examples)
and against the best fixed batch (seconds). Goals (issue 40): ≤ 0.75× fixed B0's steps at
≤ 1.15× its examples, and no more than 10 % slower than the best fixed batch. The GPT
cases are evaluated on the whole train set every 25 steps (an evaluation costs about four
steps there).

    .venv/bin/python benchmarks/warmup.py --fixed 2     # three cases, seeds 0 1 2 (long)
    .venv/bin/python benchmarks/warmup.py --cases mnist5k-fc --seeds 1
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

from batchbound import kernels
from batchbound.train import TrainConfig, target_list, train

CASES: dict[str, dict[str, Any]] = {
    "mnist5k-fc": dict(dataset="mnist5k", model="fc(depth=2,params=20000)", b0=16, lr=0.1,
                       epochs=4, every=10),
    "fortunes-gpt": dict(dataset="fortunes", model="gpt(depth=2,width=64,heads=4)", b0=16,
                         lr=0.003, epochs=3, every=25),
    # the jobs people run: AdamW (benchmarks/advise.py's case)
    "fortunes-gpt-adamw": dict(dataset="fortunes", model="gpt(depth=2,width=64,heads=4)",
                               b0=16, lr=0.003, epochs=3, every=25,
                               options=dict(optimizer="adamw", betas=(0.9, 0.95),
                                            weight_decay=0.1)),
}
WARMUPS = {"warmup branch": "warmup", "warmup noise": "warmup(every=25,trigger=noise)"}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def to_loss(config: TrainConfig, loss: float, every: int, limit: int) -> dict[str, Any]:
    run = train(config.replace(targets=target_list(train_loss=loss), max_epochs=None,
                               max_iterations=limit, eval_every_epochs=None,
                               eval_every_iterations=every), progress=False)
    hit = run.targets[0]
    sizes = [int(v) for _, _, _, v in run.curve("batch_size")]
    steps = hit.iteration if hit.reached else math.inf
    examples = _examples(run.curve("batch_size"), steps) if hit.reached else math.inf
    # the branch trigger's cost: the run stops at the target, so its branches are all before
    steps += run.final.get("policy_branch_steps", 0)
    examples += run.final.get("policy_branch_examples", 0)
    changes = [(int(i), int(v)) for i, _, _, v in run.curve("batch_size")]
    return {"steps": steps, "examples": examples,
            "seconds": hit.seconds if hit.reached else math.inf, "batches": sizes,
            "changes": changes}


def _examples(changes: list[tuple[int, float, float, float]], steps: float) -> float:
    """Examples used in the first ``steps`` iterations, from the recorded batch sizes."""
    total, (last_it, last_b) = 0.0, (0, changes[0][3])
    for iteration, _, _, batch in changes[1:]:
        total += (min(iteration, steps) - last_it) * last_b
        last_it, last_b = iteration, batch
        if iteration >= steps:
            return total
    return total + (steps - last_it) * last_b


def run_case(name: str, seeds: list[int], fixed: list[int]) -> dict[str, Any]:
    """Fixed B0's run over the budget gives L and, read on its own curve (evaluated every
    few steps, as the others are), the steps and examples it took to first reach L; then
    each contender trains to L."""
    case = CASES[name]
    b0 = case["b0"]
    contenders = {f"fixed B={b0 * k}": (b0 * k, "fixed") for k in fixed if k > 1}
    contenders.update({label: (b0, policy) for label, policy in WARMUPS.items()})
    results: dict[str, list[dict[str, Any]]] = {f"fixed B={b0}": []}
    results.update({c: [] for c in contenders})
    for seed in seeds:
        base = TrainConfig(dataset=case["dataset"], model=case["model"], batch_size=b0,
                           lr=case["lr"], seed=seed, **case.get("options", {}))
        budget = math.ceil(case["epochs"] * _n(base) / b0)
        ref = train(base.replace(max_epochs=None, max_iterations=budget,
                                 eval_every_epochs=None, eval_every_iterations=case["every"]),
                    progress=False)
        loss = ref.final["train_loss"]
        first = next((i, s) for i, _, s, v in ref.curve("train_loss") if v <= loss)
        # the contenders are read on the grid of every `every` steps, where B0's last step
        # may not lie: B0's step is rounded up to that grid too (a contender as fast as B0
        # reads the same), its exact step kept beside it
        grid = math.ceil(first[0] / case["every"]) * case["every"]
        results[f"fixed B={b0}"].append({"steps": grid, "examples": grid * b0,
                                         "seconds": first[1], "batches": [b0],
                                         "exact_steps": first[0]})
        log(f"{name} seed {seed}: fixed B0 over {budget} steps ends at train_loss {loss:.5g}, "
            f"first reached at step {first[0]} (on the {case['every']}-step grid: {grid})")
        for label, (batch, policy) in contenders.items():
            lr = case["lr"] * math.sqrt(batch / b0)
            out = to_loss(base.replace(batch_size=batch, lr=lr, batch_policy=policy), loss,
                          case["every"], 6 * budget)
            results[label].append(out)
            log(f"  {label}: {out['steps']} steps, {out['examples']:.0f} examples, "
                f"{out['seconds']:.3g} s; batches {out['changes']}")
    return {"case": name, "results": results}


def _n(config: TrainConfig) -> int:
    from batchbound.data import load_dataset

    return load_dataset(config.dataset).n_train


def mean_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.mean(values), min(values), max(values)


def report(case: dict[str, Any]) -> dict[str, Any]:
    res = case["results"]
    rows = {}
    for label, runs in res.items():
        rows[label] = {k: mean_range([r[k] for r in runs]) for k in ("steps", "examples",
                                                                     "seconds")}
    fixed = [k for k in rows if k.startswith("fixed")]
    best = min(fixed, key=lambda k: rows[k]["seconds"][0])
    b0 = fixed[0]
    ratios = {}
    for label in WARMUPS:
        warm = res[label]
        ratios[label] = {k: mean_range(v) for k, v in {
            "steps_vs_b0": [w["steps"] / f["steps"] for w, f in zip(warm, res[b0], strict=True)],
            "examples_vs_b0": [w["examples"] / f["examples"]
                               for w, f in zip(warm, res[b0], strict=True)],
            "seconds_vs_best": [w["seconds"] / f["seconds"]
                                for w, f in zip(warm, res[best], strict=True)],
        }.items()}
    return {"case": case["case"], "rows": rows, "best_fixed": best, "ratios": ratios,
            "runs": res}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fixed", type=int, nargs="*", default=[],
                        help="also fixed batches k·B0 for these k (rate η0·√k)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--warmup", nargs="*", metavar="LABEL=SPEC",
                        help="other warmups to compare, in place of the two defaults")
    args = parser.parse_args()
    if args.warmup:
        WARMUPS.clear()
        WARMUPS.update(dict(w.split("=", 1) for w in args.warmup))
    kernels.use()
    start = time.perf_counter()
    reports = [report(run_case(name, args.seeds, args.fixed)) for name in args.cases]
    if args.json:
        print(json.dumps(reports, indent=1))
        return
    print(f"{'case':<18} {'contender':<14} {'steps (range)':>22} {'examples (range)':>26} "
          f"{'seconds (range)':>24}")
    for r in reports:
        for label, row in r["rows"].items():
            cells = [f"{m:.0f} ({lo:.0f}–{hi:.0f})" for m, lo, hi in
                     (row["steps"], row["examples"])]
            m, lo, hi = row["seconds"]
            mark = " (best fixed)" if label == r["best_fixed"] else ""
            print(f"{r['case']:<18} {label + mark:<14} {cells[0]:>22} {cells[1]:>26} "
                  f"{f'{m:.3g} ({lo:.3g}–{hi:.3g})':>24}")
    for r, label in ((r, label) for r in reports for label in WARMUPS):
        q = r["ratios"][label]
        print(f"{r['case']} {label}: warmup/fixed B0 steps {q['steps_vs_b0'][0]:.2f} "
              f"({q['steps_vs_b0'][1]:.2f}–{q['steps_vs_b0'][2]:.2f}; goal ≤ 0.75), examples "
              f"{q['examples_vs_b0'][0]:.2f} ({q['examples_vs_b0'][1]:.2f}–"
              f"{q['examples_vs_b0'][2]:.2f}; goal ≤ 1.15); seconds against the best fixed "
              f"({r['best_fixed']}) {q['seconds_vs_best'][0]:.2f} ({q['seconds_vs_best'][1]:.2f}"
              f"–{q['seconds_vs_best'][2]:.2f}; goal ≤ 1.10); n = {len(args.seeds)} seeds")
    print(f"{(time.perf_counter() - start) / 60:.0f} min")


if __name__ == "__main__":
    main()
