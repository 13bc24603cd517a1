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
import sysconfig
import warnings
from collections.abc import Callable, Iterator


class BatchboundError(ValueError):
    """Bad input: an unknown name, a malformed spec, a shape that does not fit."""

    exit_code = 2


class FaultError(BatchboundError):
    """A fault in the middle of work: the disk filled, a rank died or fell silent. What was
    saved before it (finished runs, the last checkpoint) is kept, and a rerun resumes."""

    exit_code = 1


class InterruptedWorkError(BatchboundError):
    """Work with no checkpoint to resume from (``advise``'s pilot) stopped by SIGINT or
    SIGTERM: exit 130, as an interrupted command, not bad input."""

    exit_code = 130


class UserCodeError(BatchboundError):
    """The user's model, loss or data raised while batchbound ran them in a way of its own
    (``raised_by_user_code``). Bad input for a measurement; for the trainer, a crash of the
    run, recorded as its result."""


class NonFiniteLossError(BatchboundError):
    """An example's loss is inf or NaN. Bad input for ``measure``; for the trainer, after the
    first step, it means the run diverged."""


def warn(message: str) -> None:
    """``warnings.warn`` attributed to the user's line: the first frame outside batchbound
    (and outside ``contextlib``, which runs a ``with watch(...)`` block's end, and torch's
    Python, which runs a layer rule inside the user's ``loss.backward()``), wherever in the
    package the warning is raised and whichever entry point was called."""
    frame, level = sys._getframe(1), 1
    inside = _INSIDE + _torch()
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level + 1)


_INSIDE = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
           os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep + "contextlib")


def _torch() -> tuple[str, ...]:
    """torch's package folder, where torch is imported (a warning from a rule is)."""
    torch = sys.modules.get("torch")
    file = getattr(torch, "__file__", None)
    return (os.path.dirname(os.path.abspath(file)) + os.sep,) if file else ()


@contextlib.contextmanager
def raised_by_user_code(context: Callable[[], str]) -> Iterator[None]:
    """An exception that the user's model, loss or data raise while batchbound runs them in
    a way of its own (in eval mode, on parts of a batch), as a ``UserCodeError``:
    ``context()`` (that way), the exception's type and message, chained to it for its
    traceback. Whose code raised it is read off the traceback, not a list of cases: the
    innermost frame outside torch and Python's standard library. One in batchbound is a
    bug of ours, and passes as it is; so does running out of memory, which a caller may
    retry with less."""
    try:
        yield
    except BatchboundError:
        raise
    except Exception as exc:
        if isinstance(exc, _resources()) or not _from_user_code(exc):
            raise
        said = " ".join(str(exc).split())
        raise UserCodeError(f"{type(exc).__name__}: {said} (raised as {context()})") from exc


def _resources() -> tuple[type[BaseException], ...]:
    torch = sys.modules.get("torch")
    return (MemoryError, *((torch.OutOfMemoryError,) if torch is not None else ()))


def _from_user_code(exc: BaseException) -> bool:
    last = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        # batchbound's dispatch and function modes hand each operation on: what raises
        # below one is the operation's, the caller's
        handed_on = tb.tb_next is not None and code.co_name in _HANDING_ON
        if not (_passed_through(code.co_filename) or handed_on):
            last = code.co_filename
        tb = tb.tb_next
    return last is not None and not last.startswith(_INSIDE[0])


_HANDING_ON = frozenset({"__torch_dispatch__", "__torch_function__"})


def _passed_through(filename: str) -> bool:
    """torch's own frames and the standard library's: code that user code and ours both
    call."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.__file__ is not None and filename.startswith(
            os.path.dirname(torch.__file__) + os.sep):
        return True
    return filename.startswith(("<frozen", _STDLIB)) and "-packages" not in filename


_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
