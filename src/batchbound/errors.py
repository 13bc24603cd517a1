"""The exceptions users see as one line, without a traceback.

``BatchboundError`` is bad input: raised before any work starts, with a message that names
the problem and, where it helps, lists what would have been accepted (exit code 2).
``FaultError`` is a fault in the middle of work (a full disk, a dead or silent rank): the
message says what happened and what was kept, and nothing already saved is lost (exit code
1, as for a failed run).
"""


class BatchboundError(ValueError):
    """Bad input: an unknown name, a malformed spec, a shape that does not fit."""

    exit_code = 2


class FaultError(BatchboundError):
    """A fault in the middle of work: the disk filled, a rank died or fell silent. What was
    saved before it (finished runs, the last checkpoint) is kept, and a rerun resumes."""

    exit_code = 1


class NonFiniteLossError(BatchboundError):
    """An example's loss is inf or NaN. Bad input for ``measure``; for the trainer, after the
    first step, it means the run diverged."""
