"""The registry of model families, addressed by spec strings such as
``fc(depth=4,params=16000,act=relu)``.

A family is a builder ``(input_shape, num_outputs, **kwargs) -> nn.Module``; register one
with ``@register_family("name")``, and with ``sweep=`` one of ``SWEEP_KINDS`` to make it
sweepable over depth at a fixed parameter budget (``models/sweep.py``). Unknown keys and bad
values raise BatchboundError.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.user import build_user_model, is_user_spec
from batchbound.spec import Spec, check_options, did_you_mean, parse_spec

Builder = Callable[..., nn.Module]
_FAMILIES: dict[str, Builder] = {}
# How a depth sweep at a fixed parameter budget sets the width (models/sweep.py):
# "layers": ``depth`` hidden layers of one ``width``, solved from [width]'s weights-only
#           equation (the budget counts weights);
# "head":   the trunk as the options fix it and a hidden head of ``depth`` layers of one
#           width, the one whose total parameter count is closest (the budget counts all);
# "solved": the family takes ``depth`` and ``params`` and solves its own width.
SWEEP_KINDS = ("layers", "head", "solved")
_SWEEPS: dict[str, str] = {}


def register_family(name: str, sweep: str | None = None) -> Callable[[Builder], Builder]:
    if sweep is not None and sweep not in SWEEP_KINDS:
        raise ValueError(f"model family {name!r}: sweep {sweep!r} is not one of {SWEEP_KINDS}")

    def decorate(builder: Builder) -> Builder:
        if name in _FAMILIES:
            raise ValueError(f"model family {name!r} registered twice")
        _FAMILIES[name] = builder
        if sweep is not None:
            _SWEEPS[name] = sweep
        return builder

    return decorate


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def sweepable_families() -> list[str]:
    """The families a depth sweep at a fixed parameter budget can vary."""
    return sorted(_SWEEPS)


def sweep_kind(name: str) -> str | None:
    """How a sweep sets ``name``'s width (one of SWEEP_KINDS), None when it cannot."""
    get_family(name)
    return _SWEEPS.get(name)


def budget_counts_weights_only(name: str) -> bool:
    """Whether a parameter budget of this family counts weights only ([width]'s fc budget)
    rather than every parameter."""
    return _SWEEPS.get(name) == "layers"


def get_family(name: str) -> Builder:
    if name not in _FAMILIES:
        raise BatchboundError(
            f"unknown model family {name!r}{did_you_mean([name], family_names())}; "
            f"available: {', '.join(family_names())}"
        )
    return _FAMILIES[name]


def build_model(
    spec: str | Spec,
    input_shape: Sequence[int],
    num_outputs: int,
    seed: int | None = None,
) -> nn.Module:
    """Build a model from its spec: a family's (``fc(depth=2)``) or a user's factory
    (``mymodels:small_cnn``, see user.py). With ``seed``, initialisation is reproducible.
    A user's factory always gets an int seed: without one (a build to count parameters or
    check the shape, whose values nobody reads) it is 0, as measure's and train's default,
    since a factory that calls ``torch.manual_seed(seed)`` cannot take None."""
    if is_user_spec(spec):
        seed = 0 if seed is None else seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_user_model(str(spec), input_shape, num_outputs, seed)
        check_fits(spec, model)
        return model
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    builder = get_family(parsed.name)
    options = [p for p in inspect.signature(builder).parameters
               if p not in ("input_shape", "num_outputs")]
    check_options(f"model {parsed.name!r}", parsed.kwargs, options)
    if torch.get_default_device().type != "meta":
        # a real build: count on the meta device first (no memory, no RNG drawn), so a model
        # that cannot fit is refused with its size instead of hanging in the allocator
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            check_fits(parsed, builder(tuple(input_shape), num_outputs, **parsed.kwargs))
    if seed is None:
        return builder(tuple(input_shape), num_outputs, **parsed.kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(tuple(input_shape), num_outputs, **parsed.kwargs)


def memory_bytes() -> int | None:
    """This machine's memory, or its container's limit when lower; None when unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def check_fits(spec: str | Spec, model: nn.Module, bytes_per_value: int = 4) -> None:
    """Refuse a model (built on any device, meta included) whose weights and their gradients
    alone exceed this machine's memory: it could never be trained or measured here."""
    memory = memory_bytes()
    params = sum(p.numel() for p in model.parameters())
    values = 2 * params + sum(b.numel() for b in model.buffers())
    if memory is None or values * bytes_per_value <= memory:
        return
    raise BatchboundError(
        f"model {spec} has {params:,} parameters: {values * bytes_per_value / 1e9:,.1f} GB for "
        f"its weights and gradients ({bytes_per_value} bytes each), more than this machine's "
        f"{memory / 1e9:.1f} GB of memory; choose a smaller width or depth"
    )


def count_parameters(model: nn.Module, include_biases: bool = True) -> int:
    """Trainable parameters; ``include_biases=False`` leaves out parameters named ``*bias``."""
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.requires_grad and (include_biases or not name.endswith("bias"))
    )
