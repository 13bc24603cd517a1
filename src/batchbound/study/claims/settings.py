"""Where a study's setting differs from the paper a claim comes from, in one sentence shown
beside the verdict. Each function reads the study spec (``StudySpec.to_dict()``) and returns
"" when the study ran the paper's setting."""

from __future__ import annotations

from typing import Any

from batchbound.spec import parse_spec


def _model_specs(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(family, options) of every model the study names."""
    models = spec.get("models", {})
    if models.get("specs"):
        return [(parsed.name, parsed.kwargs) for parsed in map(parse_spec, models["specs"])]
    return [(str(models.get("family")), dict(models.get("options") or {}))]


def stability(spec: dict[str, Any]) -> str:
    """[diversity]'s stability runs sum the gradients (w ← w − ηΣg) with η tuned per B."""
    train, lr = spec.get("train", {}), spec.get("lr", {})
    notes = []
    if train.get("convention", "mean") != "sum":
        notes.append("[diversity] sums the gradients (w ← w − ηΣg, convention = \"sum\"); this "
                     "study averaged them")
    if lr.get("tuning") == "none" or lr.get("tune_at") == "base_batch":
        notes.append("[diversity] tunes η per batch size; this study used one step size for "
                     "every B")
    return "; ".join(notes)


def tuned_per_batch(spec: dict[str, Any]) -> str:
    """[diversity]'s replication runs tune the constant step size per (r, B)."""
    lr = spec.get("lr", {})
    if lr.get("tuning") == "none" or lr.get("tune_at") == "base_batch":
        return ("[diversity] tunes the step size per configuration; this study used one for "
                "every B")
    return ""


def gaussian_linear(spec: dict[str, Any]) -> str:
    """[width]'s theory: linear networks with N(0, σ²) weights."""
    models = _model_specs(spec)
    notes = []
    if any(family != "linear" for family, _ in models):
        notes.append("[width]'s theory is for linear networks; these have activations")
    if any(options.get("init") != "normal" for _, options in models):
        notes.append("it draws the weights from a Gaussian (linear(init=normal)); these use "
                     "PyTorch's default initialisation")
    return "; ".join(notes)


def mechanism_timing(spec: dict[str, Any]) -> str:
    """[diversity] Table 1: a CNN on MNIST on 2 workers, seconds to 90/95/99 % training
    accuracy; its cost per DropConnect step is not stated."""
    train = spec.get("train", {})
    names = [entry["dataset"] for entry in spec.get("data", [])]
    notes = []
    if any(parse_spec(name).name != "mnist" for name in names):
        notes.append(f"[diversity] times MNIST to 90/95/99 % training accuracy; this study "
                     f"times {', '.join(map(str, names))} to its own targets")
    if train.get("mechanism_granularity") == "example":
        notes.append("here each example's mask is applied through per-example gradients, "
                     "several plain steps' cost, and the 2 workers are local processes whose "
                     "all-reduce, which a larger batch saves, is cheap")
    return "; ".join(notes)
