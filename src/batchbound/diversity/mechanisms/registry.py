"""The one table of mechanisms: name -> entry, and the spec every caller passes around.

A mechanism registers the function that draws it, ``sample(mech, tensors, generator, *,
batch_dims, rescale) -> tensors``, with ``@register_mechanism(name, ...)``:

- ``tensors`` together form one vector per index of their first ``batch_dims`` dimensions
  (the rest of each tensor is that vector's part); ``sample`` returns M of each vector, in
  the same shapes, drawing from ``generator`` only. ``rescale`` asks for the unbiased form
  where the mechanism's own is biased (DropConnect's 1/(1−p)); others ignore it;
- ``closed_form(mech, sums) -> Δ^DIM`` from the sufficient statistics ``Sums`` (S, T, n, d
  and, with ``needs_R``, R = Σ_i ‖g_i‖₂‖g_i‖₁: per-example L1 norms, which the exact
  measurement then materialises per-example gradients for);
- ``worker(mech, grads, scale, generator)``: M applied in place to one worker's gradient
  tensors, already multiplied by ``scale``. The default runs ``sample`` on them with
  ``rescale``, right for positively homogeneous M (M(c·v) ~ c·M(v) for c > 0);
- ``from_sum(mech, grads, n, scale, generator)``: Σ_i M(g_i)·scale drawn in place from the
  scaled sum Σ_i g_i·scale of n examples, for mechanisms whose sum needs no per-example
  gradient (SGLD: n independent N(0, σ²) draws sum to one N(0, nσ²)); None (the default)
  means example granularity materialises per-example gradients;
- ``options``: the spec's ``key=value`` options (names, types, defaults, the error for a
  missing required one, a check on the value); ``splits_tensors(mech)``: whether each
  parameter tensor is a vector of its own (``quantization(per_tensor=true)``), which changes
  R and how Monte Carlo splits its columns; ``identity``: M(g) = g, nothing to apply.

Options form one flat record across mechanisms (``Mechanism.to_dict`` lists every registered
option, with its default where the mechanism does not have it), so two mechanisms may share
an option name only with the same default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from batchbound.errors import BatchboundError
from batchbound.spec import Spec, did_you_mean, parse_spec

# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Option:
    """One ``key=value`` option of a mechanism spec. The default's type is the option's type:
    a bool takes ``true``/``false``, a float any number (stored as float)."""

    name: str
    default: bool | float
    required: str | None = None  # the error when a spec leaves it out; None: optional
    check: Callable[[Any], str | None] | None = None  # value -> error message, None if fine

    def coerce(self, mechanism: str, value: Any) -> bool | float:
        """A parsed spec value as this option's type, or the error naming both."""
        if isinstance(self.default, bool):
            if not isinstance(value, bool):
                raise BatchboundError(
                    f"{mechanism}: {self.name} must be true or false, got {value!r}"
                )
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BatchboundError(f"{mechanism}: {self.name} must be a number, got {value!r}")
        return float(value)


# ------------------------------------------------------------------------- the table


class Sums(NamedTuple):
    """The sufficient statistics of the closed forms: n examples, d parameters,
    S = Σ‖g_i‖², T = ‖Σg_i‖², and R = Σ_i ‖g_i‖₂‖g_i‖₁ where a mechanism needs it."""

    S: float
    T: float
    n: int
    d: int
    R: float | None = None


class Sampler(Protocol):
    def __call__(
        self,
        mech: Mechanism,
        tensors: list[Tensor],
        generator: torch.Generator | None,
        *,
        batch_dims: int,
        rescale: bool,
    ) -> list[Tensor]: ...


ClosedForm = Callable[["Mechanism", Sums], float]
OnWorker = Callable[["Mechanism", list[Tensor], float, torch.Generator], None]
FromSum = Callable[["Mechanism", list[Tensor], int, float, torch.Generator], None]


@dataclass(frozen=True)
class MechanismEntry:
    name: str
    sample: Sampler
    closed_form: ClosedForm
    worker: OnWorker
    from_sum: FromSum | None  # None: example granularity needs per-example gradients
    options: tuple[Option, ...]
    aliases: tuple[str, ...]
    needs_R: bool
    splits_tensors: Callable[[Mechanism], bool]
    identity: bool


MECHANISMS: dict[str, MechanismEntry] = {}  # in registration order: the order of listings


def _whole_vector(mech: Mechanism) -> bool:
    return False


def apply_homogeneous(
    mech: Mechanism, grads: list[Tensor], scale: float, generator: torch.Generator
) -> None:
    """The default ``worker``: M(scale·g) ~ scale·M(g) for a positively homogeneous M, so M is
    drawn on the scaled gradients directly (unbiased form: ``rescale=True``)."""
    drawn = mech.entry.sample(mech, grads, generator, batch_dims=0, rescale=True)
    for g, d in zip(grads, drawn, strict=True):
        g.copy_(d)


def register_mechanism(
    name: str,
    *,
    closed_form: ClosedForm,
    options: tuple[Option, ...] = (),
    aliases: tuple[str, ...] = (),
    worker: OnWorker = apply_homogeneous,
    from_sum: FromSum | None = None,
    needs_R: bool = False,
    splits_tensors: Callable[[Mechanism], bool] = _whole_vector,
    identity: bool = False,
) -> Callable[[Sampler], Sampler]:
    """Register the decorated ``sample`` as mechanism ``name`` (see the module docstring for
    what each argument means)."""

    def decorate(sample: Sampler) -> Sampler:
        for key in (name, *aliases):
            if _find(key) is not None:
                raise ValueError(f"mechanism name {key!r} is registered twice")
        shared = _flat_defaults()
        for option in options:
            if option.name in Mechanism.__dataclass_fields__ or hasattr(Mechanism, option.name):
                raise ValueError(f"option {option.name!r} of {name!r} hides a Mechanism attribute")
            if option.name in shared and shared[option.name] != option.default:
                raise ValueError(f"option {option.name!r} of {name!r} has another default "
                                 f"than the registered one, {shared[option.name]!r}")
        MECHANISMS[name] = MechanismEntry(
            name, sample, closed_form, worker, from_sum, tuple(options), tuple(aliases),
            needs_R, splits_tensors, identity,
        )
        return sample

    return decorate


def mechanism_names() -> tuple[str, ...]:
    return tuple(MECHANISMS)


def _find(name: str) -> MechanismEntry | None:
    """The entry for a name or alias, any case."""
    key = name.lower()
    if key in MECHANISMS:
        return MECHANISMS[key]
    return next((e for e in MECHANISMS.values() if key in e.aliases), None)


def _unknown(name: str) -> BatchboundError:
    return BatchboundError(
        f"unknown mechanism {name!r}{did_you_mean([name], mechanism_names())}; choose from "
        f"{', '.join(mechanism_names())}"
    )


def _flat_defaults() -> dict[str, Any]:
    """Every registered option with its default, in registration order."""
    return {o.name: o.default for e in MECHANISMS.values() for o in e.options}


# ----------------------------------------------------------------------------- the spec


@dataclass(frozen=True, init=False, repr=False)
class Mechanism:
    """A parsed mechanism spec: ``none``, ``dropconnect(p=0.5)``, ``sgld(sigma=0.01)``,
    ``quantization`` or ``quantization(per_tensor=true)`` (``quantize`` is an alias).

    ``Mechanism(name, **options)`` takes the registered name (not an alias) and validates the
    options; ``options`` holds all of this mechanism's, defaults filled in, and each is also
    an attribute (``mech.p``); an option of another mechanism reads as its default."""

    name: str
    options: tuple[tuple[str, Any], ...]

    def __init__(self, name: str, **options: Any) -> None:
        entry = MECHANISMS.get(name)
        if entry is None:
            raise _unknown(name)
        _reject_unknown(entry, options)
        values = {o.name: options.get(o.name, o.default) for o in entry.options}
        for o in entry.options:
            problem = o.check(values[o.name]) if o.check else None
            if problem:
                raise BatchboundError(problem)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "options", tuple(values.items()))

    def __getattr__(self, key: str) -> Any:
        # only reached for names that are not real attributes: the options
        own = dict(self.__dict__.get("options", ()))
        if key in own:
            return own[key]
        shared = _flat_defaults()
        if key in shared:
            return shared[key]
        raise AttributeError(f"{type(self).__name__!s} has no attribute or option {key!r}")

    @property
    def entry(self) -> MechanismEntry:
        return MECHANISMS[self.name]

    @property
    def is_identity(self) -> bool:
        """M(g) = g: training and measurement can skip it."""
        return self.entry.identity

    @property
    def needs_per_example(self) -> bool:
        """Whether example granularity must materialise per-example gradients."""
        return self.entry.from_sum is None

    @property
    def needs_R(self) -> bool:
        """Whether the closed form needs R (per-example L1 norms)."""
        return self.entry.needs_R

    @property
    def splits_tensors(self) -> bool:
        """Whether each parameter tensor is a vector of its own."""
        return self.entry.splits_tensors(self)

    def __str__(self) -> str:
        # required options always, optional ones where they differ from the default
        shown = {o.name: value for o, (_, value) in zip(self.entry.options, self.options,
                                                         strict=True)
                 if o.required or value != o.default}
        return str(Spec(self.name, shown))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"{type(self).__name__}({fields})"

    def to_dict(self) -> dict[str, Any]:
        """``name`` and every registered option (one flat record for all mechanisms)."""
        flat = _flat_defaults()
        flat.update(self.options)
        return {"name": self.name, **flat}


def _reject_unknown(entry: MechanismEntry, given: Mapping[str, Any]) -> None:
    allowed = [o.name for o in entry.options]
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        valid = ", ".join(allowed) if allowed else "none"
        raise BatchboundError(
            f"mechanism {entry.name!r} has no option {unknown[0]!r}; options: {valid}"
        )


def parse_mechanism(spec: str | Mechanism) -> Mechanism:
    """``"dropconnect(p=0.5)"`` → Mechanism; unknown names and options are errors that list the
    valid choices."""
    if isinstance(spec, Mechanism):
        return spec
    parsed = parse_spec(spec)
    entry = _find(parsed.name)
    if entry is None:
        raise _unknown(parsed.name)
    _reject_unknown(entry, parsed.kwargs)
    for option in entry.options:
        if option.required and option.name not in parsed.kwargs:
            raise BatchboundError(option.required)
    values = {
        o.name: o.coerce(entry.name, parsed.kwargs[o.name])
        for o in entry.options
        if o.name in parsed.kwargs
    }
    return Mechanism(entry.name, **values)


# ------------------------------------------------------------------- generic dispatch


def diversity_under(
    mechanism: str | Mechanism, *, S: float, T: float, n: int, d: int, R: float | None = None
) -> float:
    """Δ^DIM from the sufficient statistics; R is needed by mechanisms with ``needs_R``
    (quantization) only."""
    mech = parse_mechanism(mechanism)
    if mech.needs_R and R is None:
        raise BatchboundError(f"{mech.name} needs R = Σ‖g_i‖₂‖g_i‖₁ (per-example L1 norms)")
    return mech.entry.closed_form(mech, Sums(S, T, n, d, R))


def ratio(num: float, den: float) -> float:
    """num/den, with 0/0 = nan and x/0 = inf (all-zero gradients have no diversity)."""
    num, den = float(num), float(den)
    if den == 0.0:
        return math.nan if num == 0.0 else math.inf
    return num / den


def apply_mechanism(
    mechanism: str | Mechanism,
    grads: Tensor | Mapping[str, Tensor],
    generator: torch.Generator | None = None,
    *,
    batch_dims: int = 1,
    rescale: bool = False,
) -> Tensor | dict[str, Tensor]:
    """Draw M(g) independently for each of the vectors indexed by the first ``batch_dims``
    dimensions (default: per-example gradients of shape (n, ...)). ``grads`` is one tensor or
    a dict of per-parameter tensors that together form the vector. ``rescale`` applies
    DropConnect's 1/(1−p) (ignored by the other mechanisms).

    A ``generator`` must live on the device of the tensors it samples for (torch's rule)."""
    mech = parse_mechanism(mechanism)
    named = dict(grads) if isinstance(grads, Mapping) else {"": grads}
    drawn = mech.entry.sample(
        mech, list(named.values()), generator, batch_dims=batch_dims, rescale=rescale
    )
    out = dict(zip(named, drawn, strict=True))
    return out if isinstance(grads, Mapping) else out[""]
