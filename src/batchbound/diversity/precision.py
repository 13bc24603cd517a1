"""Which precision a forward pass actually computed in, and what that means for the numbers.

A float32 model under ``torch.autocast`` (around the step or inside its forward) runs its
matrix products in bfloat16 or float16, and a model may hold low-precision parameters. Its
gradients then carry that rounding. The per-example norms are read from the activations and
output gradients the model actually used and accumulated in float32 and float64; what the
precision decides is how closely they can agree with a per-example loop, which rounds its
own batches of one differently, so the self-check's tolerance is set from it
(``rule_check.tolerance``), and every report states it.

The precision is observed, not assumed: ``rows.RowTracker`` sees every ATen operation of the
forward (after autocast's casts), and ``steps._LossWatch`` every function of the loss written
after it under ``watch``; ``GradientPrecision`` notes where a result drops below an input that
requires grad and counts its dtype when the backward passes there. So a float64 model whose
norms compute in float32 inside (Hugging Face's LlamaRMSNorm and T5's layer norm:
``.to(torch.float32)``) is stated float32: its per-example gradients carry float32 rounding,
which a mean over b examples places differently from a per-example loop's. A
constant computed in float32 from buffers or positions alone (rotary tables) is a value of
the model, not a rounding of its gradients, and does not count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch
from torch.autograd.graph import Node
from torch.overrides import TorchFunctionMode

from batchbound.diversity.stats import LOW_PRECISION

__all__ = ["LOW_PRECISION", "RANK", "Casts", "GradientPrecision", "autocast_dtypes", "digits",
           "lowest", "name", "statement"]
# floating dtypes by precision, lowest first; any other dtype ranks 3 (not floating)
RANK = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}


def lowest(*dtypes: torch.dtype | None) -> torch.dtype:
    """The least precise of the floating ``dtypes`` (None entries ignored; float32 if none)."""
    best, rank = torch.float32, 3  # one pass, no list: called per tensor of every call
    for d in dtypes:
        r = RANK.get(d, 3)  # type: ignore[arg-type]
        if r < rank:
            best, rank = d, r
    return best  # type: ignore[return-value]


class GradientPrecision:
    """The lowest floating dtype a backward pass actually ran in, seen where it is entered.

    A backward computes each operation's gradient in that operation's dtype, so a gradient
    leaves the parameters' precision only through an operation whose result is lower than an
    input that requires grad (``.to(torch.float32)`` in a float64 model, ``softmax(...,
    dtype=torch.float32)``, autocast's casts; type promotion only widens). ``see`` notes such
    results as the operations run; ``arm``, at the forward's end, hooks their autograd nodes,
    and the dtype counts when the backward reaches one. A branch the loss does not use (a
    model's own loss computed beside the logits) never runs backward and never counts."""

    __slots__ = ("_pending", "dtype", "rank")

    def __init__(self) -> None:
        self.dtype: torch.dtype | None = None  # None: the backward stayed at the inputs' dtype
        self.rank = 3
        # lowered results and their versions, until their nodes are hooked
        self._pending: list[tuple[torch.Tensor, int]] = []

    def see(self, result: torch.Tensor, inputs: Iterable[object]) -> None:
        """Note ``result`` if it is lower than a floating input that requires grad. Inside a
        dispatch mode the result has no autograd node yet: it is hooked by ``arm``."""
        r = RANK.get(result.dtype, 3)
        if r >= 2:  # float64 (or not floating) is lower than nothing
            return
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad and 3 > RANK.get(t.dtype, 3) > r:
                self._pending.append((result, result._version))
                return

    def arm(self) -> None:
        """Hook the nodes of the results noted so far (the forward has attached them). A
        result written in place since (or by its own operation, ``copy_`` into a float32
        buffer) has a later node than the lowering one, which the backward may pass by:
        its dtype counts at once (never stated more precise than it is)."""
        for t, version in self._pending:
            if t._version != version:
                self._reached(t.dtype, ())
            elif t.grad_fn is not None:
                self.hook(t.grad_fn, t.dtype)
        self._pending = []

    def hook(self, node: Node, dtype: torch.dtype) -> None:
        node.register_prehook(partial(self._reached, dtype))

    def _reached(self, dtype: torch.dtype, grad_outputs: tuple) -> None:
        r = RANK[dtype]
        if r < self.rank:
            self.dtype, self.rank = dtype, r


class Casts(TorchFunctionMode):
    """Notes the lowered results of the functions run inside it in ``seen`` (above autograd:
    they have their nodes) and arms them on leaving, before the backward: the loss computed
    after the hooks engine's forward, and the whole forward and loss of the loop and vmap
    engines (one observation for every engine; a float64 model with ``logits.float()`` is
    float32 whichever engine measures it)."""

    def __init__(self, seen: GradientPrecision) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: object, types: object, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # type: ignore[operator]
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and RANK.get(t.dtype, 3) < 2:
                self.seen.see(t, (*args, *kwargs.values()))
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.seen.arm()


def autocast_dtypes() -> list[torch.dtype]:
    """The dtypes of the autocast contexts active now. An operation may compute inside itself
    in autocast's dtype and return float32 (``nn.Bilinear`` on CPU), which no dispatch mode
    sees, and a dispatch mode changes that: the per-example loop, run without one, can then
    round where the observed pass did not."""
    return [torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def digits(dtype: torch.dtype) -> int:
    """Significant decimal digits of a floating dtype's mantissa (bfloat16: 2, float16: 3)."""
    return int(-math.log10(torch.finfo(dtype).eps))


def statement(used: torch.dtype, parameters: torch.dtype) -> str:
    """One sentence for a report: the precision used, where it came from, what it costs."""
    where = "" if used == parameters else (
        f" (autocast or casts in the forward; its parameters are {name(parameters)})")
    return (f"{name(used)} gradients: the model computes in {name(used)}{where}, so its "
            f"per-example gradients carry {name(used)} rounding (unit roundoff "
            f"{torch.finfo(used).eps / 2:.1e}) and S, T and Δ hold about {digits(used)} "
            "significant digits (norms and sums accumulated in float32 and float64)")
