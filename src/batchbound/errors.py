"""The exceptions users see as one line, without a traceback.

``BatchboundError`` is bad input: raised before any work starts, with a message that names
the problem and, where it helps, lists what would have been accepted (exit code 2).
``FaultError`` is a fault in the middle of work (a full disk, a dead or silent rank): the
message says what happened and what was kept, and nothing already saved is lost (exit code
1, as for a failed run).
"""

import contextlib
import os
import sys
import warnings


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


def warn(message: str) -> None:
    """``warnings.warn`` attributed to the user's line: the first frame outside batchbound
    (and outside ``contextlib``, which runs a ``with watch(...)`` block's end), wherever in
    the package the warning is raised and whichever entry point was called."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level + 1)


_INSIDE = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
           os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep + "contextlib")
