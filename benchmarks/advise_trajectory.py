"""How well does the pilot's noise-scale extrapolation follow the whole run? (offline, issue 36)

Trains one benchmarks/advise.py case's planned run at B0 as a pilot over all K steps (the
two-batch (M2, C) of every step kept, no extra work), cuts it into segments as advise does,
then for pilots of 5, 10, 15 and 20 % of K prints the predicted iterations at each ``--measured``
batch divided by the measured ones, for

- ``kappa``: advise's central trajectory (B_noise·L = κ, the loss on its power law);
- ``q``: B_noise ∝ L^−q, q fitted to the pilot's later segments (Kaplan et al. 2020);
- ``t``: B_noise ∝ t^a, a fitted likewise (clamped to [0, 1]);
- ``full``: the whole run's own segments, no extrapolation (the best the noise scale can do).

    .venv/bin/python benchmarks/advise_trajectory.py fortunes-gpt-adamw \\
        --measured 32=672,64=495,128=430
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import numpy as np
import torch

from advise import CASES, OPTIMISER_KEYS
from batchbound import kernels
from batchbound.advise import pilot as pilot_module
from batchbound.advise.advice import _data_of
from batchbound.advise.iterations import Pilot, predict_iterations
from batchbound.advise.trajectory import Segment, Step, _grid, _loss_trend, extrapolate, segments
from batchbound.train import TrainConfig


def fitted(later: Sequence[Segment], x: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of log B_noise on log x, weighted by the segments' relative errors."""
    lx, ly = np.log(x), np.log([max(s.noise, 1e-9) for s in later])
    w = np.array([(s.noise / max(s.se, 1e-12)) ** 2 for s in later])
    design = np.vstack([np.ones_like(lx), lx]).T
    beta = np.linalg.solve(design.T @ (w[:, None] * design), design.T @ (w * ly))
    return float(beta[0]), float(beta[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=list(CASES))
    parser.add_argument("--measured", required=True, help="B=iterations,... (benchmark rows)")
    args = parser.parse_args()
    measured = {int(b): float(k) for b, k in (p.split("=") for p in args.measured.split(","))}
    kernels.use()
    case = CASES[args.case]
    config = TrainConfig(dataset=case["dataset"], model=case["model"], batch_size=case["b0"],
                         lr=case["lr"], eval_subset=case["eval_subset"],
                         **{k: case[k] for k in OPTIMISER_KEYS if k in case})
    data = _data_of(config)
    kept: list[Step] = []
    original = pilot_module.segments

    def keep(steps: Sequence[Step], n: int, sampling: str) -> list[Segment]:
        kept.extend(steps)
        return original(steps, n, sampling)

    pilot_module.segments = keep
    planned = round(case["epochs"] * data.n_train / case["b0"])
    run = pilot_module.run_pilot(config, data, torch.device("cpu"), iterations=planned)
    sampling = "without_replacement" if config.sampling == "epoch" else "with_replacement"
    b0 = case["b0"]
    whole = run.segments
    print("whole run: (middle, B_noise ± se, batch loss, B_noise·L)")
    for s in whole:
        print(f"  {s.middle:7.0f} {s.noise:8.2f} ± {s.se:5.2f} {s.loss:9.4g} "
              f"{s.noise * s.loss:9.4g}")
    truth = Pilot(b0, config.lr, planned, tuple(round(s.middle) for s in whole),
                  tuple(1 + s.noise for s in whole))
    for fraction in (0.05, 0.1, 0.15, 0.2):
        tp = round(planned * fraction)
        segs = segments(kept[:tp], data.n_train, sampling)
        path = extrapolate(segs, tp, planned, b0, config.lr)
        later = segs[1:] if len(segs) > 2 else segs
        exponent, loss_end = _loss_trend(later, tp)
        grid = _grid(tp, planned)
        c_l, s_l = fitted(later, [s.loss for s in later])
        c_t, s_t = fitted(later, [s.middle for s in later])
        q_end = math.exp(c_l + s_l * math.log(loss_end))
        t_end, a = math.exp(c_t + s_t * math.log(tp)), min(max(s_t, 0.0), 1.0)

        def trajectory(beyond: list[float], segs: list[Segment] = segs,
                       grid: list[int] = grid) -> Pilot:
            return Pilot(b0, config.lr, planned, tuple([round(s.middle) for s in segs] + grid),
                         tuple(1 + max(b, 0.0) for b in [s.noise for s in segs] + beyond))

        by_q = trajectory([q_end * (t / tp) ** (exponent * -s_l) for t in grid])
        by_t = trajectory([t_end * (t / tp) ** a for t in grid])
        print(f"pilot {fraction:.0%} ({tp} steps): q = {-s_l:.2f}, a = {s_t:.2f}; "
              "predicted / measured:")
        for batch, k in measured.items():
            ratios = [predict_iterations(p, batch) / k for p in (path.central, by_q, by_t, truth)]
            print(f"  B = {batch}: kappa {ratios[0]:.2f}  q {ratios[1]:.2f}  t {ratios[2]:.2f}  "
                  f"full {ratios[3]:.2f}")


if __name__ == "__main__":
    main()
