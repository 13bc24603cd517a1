"""How the Hugging Face callbacks (``integrations/transformers.py``) are continued from a
Trainer checkpoint: what a callback saved (its ``ExportableState.state()``), found on a
resumed run, and the batch-size warmups' accumulation put back on the Trainer's arguments.
Duck-typed on the Trainer's state and arguments: nothing here imports transformers."""

from __future__ import annotations

import json
from typing import Any

from batchbound.errors import warn


def checkpoint_state(callback: Any, state: Any) -> dict[str, Any] | None:
    """What ``callback`` saved (its ``state()``'s ``saved``) in the checkpoint this run
    resumed from (global_step > 0): put on it by the Trainer's own restore
    (restore_callback_states_from_checkpoint), else read from the resumed TrainerState; None
    on a run that did not resume."""
    saved, callback.saved = callback.saved, None
    if state.global_step == 0:
        return None
    return saved if saved is not None else restored_attributes(
        state, type(callback).__name__, callback.settings()).get("saved")


def restored_attributes(state: Any, name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The attributes the callback of class ``name`` saved in the checkpoint the Trainer
    resumed from (``TrainerState.stateful_callbacks``); {} where none did. Where several
    callbacks of the class are, the Trainer keeps a list to which each save appends: the
    last entry with these ``settings`` is the latest (two callbacks alike hold the same
    estimate)."""
    stored = (getattr(state, "stateful_callbacks", None) or {}).get(name)
    if not isinstance(stored, list):
        return stored.get("attributes") or {} if isinstance(stored, dict) else {}
    mine = [e["attributes"] for e in stored if isinstance(e, dict)
            and all(e.get("attributes", {}).get(k) == _as_json(v) for k, v in settings.items())]
    if not mine:
        warn(f"batchbound: the checkpoint holds the states of several {name}s, none with this "
             f"one's settings {settings}; its estimate starts afresh")
    return mine[-1] if mine else {}


def _as_json(value: Any) -> Any:
    """A value as it comes back from trainer_state.json (tuples as lists)."""
    return json.loads(json.dumps(value))


def resume_accumulation(args: Any, state: Any, warmup: Any) -> None:
    """A resumed run goes on at the accumulation its warmup had grown to. The Trainer counts
    the epochs and batches it skips on resume at the accumulation it was given, so where the
    warmup had grown it before the checkpoint the resumed run starts at another batch than
    the one the stopped run stopped at: said."""
    given = args.gradient_accumulation_steps
    if warmup.accumulation != given:
        warn(f"batchbound: resuming at step {state.global_step} with gradient_accumulation_"
             f"steps={warmup.accumulation}, which the batch-size warmup had grown it to; the "
             f"Trainer counted the epochs and batches it skips on resume at {given}, so the "
             "resumed run does not start at the batch where the stopped one stopped: it "
             "trains again on batches, up to whole epochs, that the stopped run had trained "
             "on (resume from a checkpoint saved before the first growth to resume exactly)")
    args.gradient_accumulation_steps = warmup.accumulation


def resumed_inside_epoch(state: Any) -> bool:
    """Whether this on_epoch_begin is a resumed run's, inside an epoch (the Trainer calls it
    there too): a growth decided before the checkpoint waits for the next epoch's start,
    as it did in the stopped run."""
    return not float(state.epoch).is_integer()
