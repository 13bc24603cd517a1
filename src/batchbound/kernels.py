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
- one thread per run (the study's executors already set it; MKL's CNR needs a fixed count).

``native`` leaves every library to choose. Portable costs speed (docs/trust.md, "Same
command, same numbers", has the measured factor) and guarantees nothing on other
architectures (ARM uses other libraries) or on CUDA.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from batchbound.errors import BatchboundError

KERNELS = ("portable", "native")
ENV = "BATCHBOUND_KERNELS"  # what a process asked for; spawned workers inherit it
PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
MKL_CBWR_BRANCH, MKL_CBWR_COMPATIBLE = 1, 3  # mkl.h's named constants


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
