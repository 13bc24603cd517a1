"""The batch-size warmup schedule a pilot implies, beside the fixed-batch rows.

``--batch-policy warmup`` (``batchbound.train.adaptive``) doubles B every ``every`` steps when
2B ≤ fraction·B_noise. Along the predicted trajectory of B_noise (``trajectory.py``), that
rule is simulated step by step: a step at B advances the run by (1 + B_noise/B0)/(1 +
B_noise/B) steps' worth of B0 (McCandlish et al.'s S(B0)/S(B), the rate near its best),
until the plan's K steps at B0 are made up. The result: when B doubles (as a share of the
plan), and the steps and examples the warmed run needs against fixed B0. The estimate's
noise, which delays the trainer's doublings, is not simulated: a prediction of the rule's
best case. It is the noise trigger's rule (``trigger=noise``); the branch trigger, the
trainer's default, decides from branches this prediction does not run, and is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchbound.advise.iterations import Pilot
from batchbound.errors import BatchboundError
from batchbound.train.adaptive import BatchPolicy, parse_batch_policy


@dataclass(frozen=True)
class WarmupPlan:
    policy: str
    steps: int  # optimizer steps of the warmed run
    examples: int
    planned_steps: int  # fixed B0's
    planned_examples: int
    changes: tuple[tuple[float, int, int], ...]  # (share of the plan done, step, new batch)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "steps": self.steps, "examples": self.examples,
                "steps_vs_fixed_b0": self.steps / self.planned_steps,
                "examples_vs_fixed_b0": self.examples / self.planned_examples,
                "changes": [{"progress": p, "step": s, "batch_size": b}
                            for p, s, b in self.changes]}

    def text(self) -> str:
        steps = ", ".join(f"B = {b} from {p:.0%} of the plan (step {s})"
                          for p, s, b in self.changes) or "B never doubles"
        return (f"batch-size warmup ({self.policy}, predicted best case): {steps}; "
                f"{self.steps} steps ({self.steps / self.planned_steps:.0%} of fixed B0's "
                f"{self.planned_steps}), {self.examples / self.planned_examples:.0%} of its "
                "examples")


def warmup_schedule(pilot: Pilot, policy: str = "warmup(every=25,trigger=noise)",
                    max_batch: int | None = None) -> WarmupPlan:
    """Simulate the warmup rule along ``pilot`` (a trajectory over the whole plan)."""
    rule: BatchPolicy = parse_batch_policy(policy)
    if rule.trigger != "noise":
        raise BatchboundError(f"the warmup schedule is predicted for the noise trigger; "
                              f"{policy!r} uses trigger={rule.trigger}: add trigger=noise")
    b0, planned = pilot.batch_size, pilot.iterations
    ceiling = min(rule.max, max_batch or rule.max)
    batch, done, steps, examples = b0, 0.0, 0, 0
    changes: list[tuple[float, int, int]] = []
    while done < planned:
        noise = pilot.noise_scale(done)
        if steps and steps % rule.every == 0:
            wanted = rule.warmed(batch, noise, 0.0)
            if batch < wanted <= ceiling:
                batch = wanted
                changes.append((done / planned, steps, batch))
        done += (1.0 + noise / b0) / (1.0 + noise / batch)
        steps += 1
        examples += batch
    return WarmupPlan(policy, steps, examples, planned, planned * b0, tuple(changes))
