"""Which CPU kernels compute: the same numbers on every x86-64 processor, or the fastest.

A float32 (or float64) result depends on the order of its additions, and PyTorch's CPU kernels
pick that order by the processor: ATen's vectorised kernels use 8 lanes on AVX2 and 16 on
AVX-512, MKL's GEMM blocks and fuses multiply-adds by instruction set, oneDNN and NNPACK
dispatch their own. The last bit differs, and SGD at a large step size is chaotic: we measured
a 1e-16 difference in float64 grow to a 30 % different final loss, a different iteration to
target and a run that diverges on one machine and not on the other, within 30 epochs on digits.
No tolerance can make such a study's decisions agree; one kernel path can.

``portable`` (the default of every ``batchbound`` command, and of a study's worker processes)
pins that path with the libraries' documented settings:

- ATen: ``ATEN_CPU_CAPABILITY=default``, the kernels compiled for baseline x86-64 (read at the
  first operation, so it must be set before any tensor is computed);
- MKL: ``MKL_CBWR=COMPATIBLE``, Intel's conditional numerical reproducibility branch for
  Intel and compatible processors (set through ``mkl_cbwr_set`` when torch is already loaded,
  which works until MKL's first call, and checked);
- oneDNN and NNPACK off, so convolutions run through ATen and MKL;
- one thread per process (``threads()``): a float sum split over k threads adds in another
  order than over 1, so ``OMP_NUM_THREADS`` or the machine's cores would otherwise change the
  last bits, and SGD's chaos the rest (MKL's CNR also needs a fixed count).

Threads: every place batchbound computes (``train`` with any number of workers, each worker;
``measure``; ``advise``'s pilot and its step timing; a study's runs; the Python functions
``train``, ``measure`` and ``advise``) runs on ``threads()`` torch threads: 1, or
``$BATCHBOUND_THREADS``. Neither ``OMP_NUM_THREADS`` nor a caller's ``torch.set_num_threads``
is read: torchrun, schedulers and notebooks set them for their own reasons, and the default
count is the machine's cores, so the same call would give other numbers elsewhere. The Python
functions put the caller's count back when they return.

``native`` leaves every library to choose. Portable costs speed (docs/trust.md, "Same
command, same numbers", has the measured factor) and guarantees nothing on other
architectures (ARM uses other libraries) or on CUDA.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ParamSpec, TypeVar

from batchbound.errors import BatchboundError

KERNELS = ("portable", "native")
ENV = "BATCHBOUND_KERNELS"  # what a process asked for; spawned workers inherit it
PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
MKL_CBWR_BRANCH, MKL_CBWR_COMPATIBLE = 1, 3  # mkl.h's named constants
THREADS_ENV = "BATCHBOUND_THREADS"  # torch threads per process; 1 unless set


def threads() -> int:
    """The torch threads each batchbound process computes on: $BATCHBOUND_THREADS, else 1."""
    value = os.environ.get(THREADS_ENV, "1").strip()
    if not (value.isdigit() and int(value) >= 1):
        raise BatchboundError(f"{THREADS_ENV}={value!r}: a positive whole number of threads")
    return int(value)


@contextmanager
def computing_threads(count: int | None = None) -> Iterator[int]:
    """Compute on ``count`` (default ``threads()``) torch threads inside the block, then put
    the caller's count back: the Python API's functions run in the caller's process."""
    import torch

    count = threads() if count is None else count
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(previous)


P = ParamSpec("P")
R = TypeVar("R")


def on_threads(function: Callable[P, R]) -> Callable[P, R]:
    """A public function that computes in its caller's process, run inside
    ``computing_threads()``."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with computing_threads():
            return function(*args, **kwargs)

    return wrapper


def requested() -> str:
    """The kernels this process was asked for: $BATCHBOUND_KERNELS, else portable."""
    value = os.environ.get(ENV, "portable")
    if value not in KERNELS:
        raise BatchboundError(f"{ENV}={value!r}: choose from {', '.join(KERNELS)}")
    return value


def use(kernels: str | None = None) -> str:
    """Make this process (and the processes it spawns) compute with ``kernels`` (default: as
    requested). Call it before the first tensor is computed. Returns what it runs on, as
    ``describe()``; a portable request that comes too late is a BatchboundError."""
    kernels = requested() if kernels is None else kernels
    if kernels not in KERNELS:
        raise BatchboundError(f"kernels {kernels!r}: choose from {', '.join(KERNELS)}")
    os.environ[ENV] = kernels
    if kernels == "native":
        return describe()
    os.environ.update(PORTABLE_ENV)
    import torch

    torch.backends.mkldnn.enabled = False
    torch.backends.nnpack.set_flags(False)
    _mkl_compatible()
    if not is_portable():
        raise BatchboundError(
            f"portable kernels were asked for after this process had computed with others "
            f"({describe()}); call batchbound.kernels.use() before the first tensor "
            f"operation, or set {ENV}=native to accept processor-dependent numbers")
    return describe()


def _mkl() -> ctypes.CDLL | None:
    """torch's CPU library, which carries MKL's service functions (None on builds without)."""
    import torch

    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = Path(torch.__file__).parent / "lib" / name
        if path.exists():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:
                return None
            return lib if hasattr(lib, "mkl_serv_cbwr_get") else None
    return None


def _mkl_branch() -> int | None:
    lib = _mkl()
    if lib is None:
        return None
    lib.mkl_serv_cbwr_get.restype = ctypes.c_int
    lib.mkl_serv_cbwr_get.argtypes = [ctypes.c_int]
    return int(lib.mkl_serv_cbwr_get(MKL_CBWR_BRANCH))


def _mkl_compatible() -> None:
    lib = _mkl()
    if lib is not None and _mkl_branch() != MKL_CBWR_COMPATIBLE:
        lib.mkl_serv_cbwr_set.restype = ctypes.c_int
        lib.mkl_serv_cbwr_set.argtypes = [ctypes.c_int]
        lib.mkl_serv_cbwr_set(MKL_CBWR_COMPATIBLE)  # refused once MKL has computed: checked


def is_portable() -> bool:
    """Whether this process computes on the portable path now."""
    import torch

    branch = _mkl_branch()
    return (torch.backends.cpu.get_cpu_capability() == "DEFAULT"
            and branch in (None, MKL_CBWR_COMPATIBLE)
            and not torch.backends.mkldnn.enabled
            and not _nnpack_enabled())


def _nnpack_enabled() -> bool:
    import torch

    enabled = torch.backends.nnpack.set_flags(False)[0]  # the public API reads by setting
    torch.backends.nnpack.set_flags(enabled)
    return bool(enabled)


def describe() -> str:
    """What this process computes with, e.g. ``portable (ATen DEFAULT, MKL COMPATIBLE)``."""
    import torch

    branch = _mkl_branch()
    mkl = {None: "no MKL", MKL_CBWR_COMPATIBLE: "MKL COMPATIBLE"}.get(branch, "MKL auto")
    name = "portable" if is_portable() else "native"
    return f"{name} (ATen {torch.backends.cpu.get_cpu_capability()}, {mkl})"
