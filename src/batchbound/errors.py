"""The one exception type users see for bad input.

Raised before any work starts, with a message that names the problem and, where it helps,
lists what would have been accepted. The CLI prints it without a traceback.
"""


class BatchboundError(ValueError):
    """Bad input: an unknown name, a malformed spec, a shape that does not fit."""


class NonFiniteLossError(BatchboundError):
    """An example's loss is inf or NaN. Bad input for ``measure``; for the trainer, after the
    first step, it means the run diverged."""
