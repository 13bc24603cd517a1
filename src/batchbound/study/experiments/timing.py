"""Wall-clock time to target with a diversity-inducing mechanism ([diversity], "Gradient
Diversity", Sec. 6 and Table 1).

The paper runs plain mini-batch SGD and DropConnect on 2 workers, tunes the step size and
B per setting for the fastest convergence, and compares the seconds to 90, 95 and 99 %
training accuracy: DropConnect raises gradient diversity, which allows a larger batch, which saves
communication. Here, for any study whose mechanisms include ``none`` and at least one
other: per setting, the batch size whose runs reach the hardest target every setting reaches
soonest (median seconds over seeds; the step size is the study's tuned one for that batch),
then the mean seconds to every target at that (η, B) and the gain over plain SGD. Seconds
are training time as the trainer records it (evaluation and Δ excluded); runs executed side
by side share the machine, so compare settings of one study, not across studies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from batchbound.study.evidence import means
from batchbound.study.experiments.frames import finals
from batchbound.study.experiments.registry import Section, register_experiment

if TYPE_CHECKING:  # the bundle's module imports this one
    from batchbound.study.summary import StudyAnalysis


def seconds_to_targets(a: StudyAnalysis) -> pd.DataFrame:
    """Final runs × targets: mechanism, batch_size, lr, seed, target, reached, seconds."""
    runs = finals(a)[["key", "mechanism", "batch_size", "lr", "seed"]]
    targets = a.frames["targets"].rename(columns={"name": "target"})
    out = runs.merge(targets[["key", "target", "reached", "seconds"]], on="key")
    out["seconds"] = out["seconds"].where(out["reached"].astype(bool), np.inf)
    return out


def best_batches(times: pd.DataFrame, order: list[str]) -> tuple[str, dict[str, int]]:
    """The hardest target every setting reaches at some batch in every seed, and per setting
    the batch whose median seconds to it are smallest."""
    for target in reversed(order):
        part = times[times["target"] == target]
        medians = part.groupby(["mechanism", "batch_size"])["seconds"].median()
        best = {m: int(cells.droplevel(0).idxmin()) for m, cells in medians.groupby(level=0)
                if np.isfinite(cells.min())}
        if len(best) == times["mechanism"].nunique():
            return target, best
    return "", {}


@register_experiment
def timing(a: StudyAnalysis) -> Section | None:
    mechanisms = list(dict.fromkeys(a.frames["runs"]["mechanism"]))
    if "none" not in mechanisms or len(mechanisms) < 2 or not a.targets:
        return None
    times = seconds_to_targets(a)
    chosen_target, best = best_batches(times, a.targets)
    if not best:
        return None
    chosen = pd.concat([times[(times["mechanism"] == m) & (times["batch_size"] == b)]
                        for m, b in best.items()])
    rows, draws = [], {}
    for mechanism in mechanisms:
        mine = chosen[chosen["mechanism"] == mechanism]
        row: dict[str, Any] = {"setting": mechanism, "B": best[mechanism],
                               "η": float(mine["lr"].iloc[0]), "seeds": mine["seed"].nunique()}
        for target in a.targets:
            secs = mine[mine["target"] == target]["seconds"].to_numpy(float)
            draws[(mechanism, target)] = means(secs)
            row[f"s to {target}"] = float(secs.mean())
            base = chosen[(chosen["mechanism"] == "none") & (chosen["target"] == target)]
            if mechanism != "none":
                row[f"gain % {target}"] = 100 * (1 - secs.mean() / base["seconds"].mean())
        rows.append(row)
    table = pd.DataFrame(rows)

    def draw(fig: Any) -> None:
        from batchbound.study.plots import legend

        ax = fig.add_subplot()
        width = 0.8 / len(mechanisms)
        x = np.arange(len(a.targets))
        for i, mechanism in enumerate(mechanisms):
            heights = [draws[(mechanism, t)][0] for t in a.targets]
            spread = np.array([np.nanpercentile(draws[(mechanism, t)][1:], [2.5, 97.5])
                               for t in a.targets]).T
            finite = np.isfinite(heights)
            ax.bar(x[finite] + i * width, np.array(heights)[finite], width,
                   yerr=np.abs(spread - heights)[:, finite], capsize=3,
                   label=f"{mechanism} (B={best[mechanism]})")
        ax.set_xticks(x + width * (len(mechanisms) - 1) / 2, a.targets)
        ax.set_ylabel("seconds (mean over seeds)")
        ax.set_title("time to target at each setting's best (η, B)")
        legend(ax, fontsize=8)

    workers = a.spec.get("train", {}).get("workers", 1)
    return Section(
        key="timing", title="Time to accuracy with a diversity-inducing mechanism",
        source="diversity",
        text=(f"{workers} worker(s); settings {', '.join(mechanisms)} "
              f"(granularity: {a.spec.get('train', {}).get('mechanism_granularity', 'worker')})."
              f" Each setting keeps the batch size whose runs reach {chosen_target} soonest "
              "(median over seeds) at its tuned step size η; the table gives the mean seconds "
              "to every target at that (η, B) and the gain over plain SGD. A run that misses "
              "a target counts as never reaching it (∞)."),
        tables=[("Seconds to target (mean over seeds) and gain over plain SGD", table)],
        figures=[("timing", "Seconds of training to each target at each setting's best "
                  "(η, B), with 95 % bootstrap intervals over seeds [diversity, Table 1].",
                  draw)],
        data={"draws": draws, "targets": list(a.targets), "best": best,
              "seeds": {str(r["setting"]): int(r["seeds"]) for r in rows}},
    )
