"""Per-example convolution weight gradients: every way we know, each timed alone on the layer
shapes of benchmarks/diversity.py's LeNet-5 and ResNet-8 at ``measure()``'s chunk sizes (not
a test; prints a table or JSON).

For each convolution of the model, its input on one chunk (recorded by a forward hook) and a
random output gradient of the output's shape go through:

- ``batch``: torch's weight-gradient kernel on the whole chunk, Σ_i g_i only: what autograd
  computes in a plain backward, the cost the per-example ways are measured against;
- ``grouped``: the conv rule's ``"conv"`` method (the examples folded into groups of torch's
  weight-gradient kernel, ``rules/conv.py``; its input channels-last where the rule hands it
  so), the same with the input as laid out (``grouped, NCHW``), and with both operands
  channels-last;
- ``patches``: the rule's ``"patches"`` method (patches copied from strided views of the input
  a block of examples at a time, one batched product per block);
- ``opacus``: a forward convolution with the roles exchanged (input channels as the batch,
  the output gradient as a grouped kernel: Opacus's and torch's expanded weights);
- ``unfold+bmm``: unfolded patches and one batched matrix product;
- ``rows+bmm``: the input unfolded along its rows only (kw copies, not kh·kw) and one batched
  product per kernel row (stride 1, no groups);
- ``shifts`` and ``gram``: the rule's two other methods, which give the squared norms only
  (one batched product per kernel tap; the Gram form over positions, the "ghost norm").

Every way is checked first, in float64, against each example's gradient computed alone (a
batch of one: no other example can enter it); the column is the largest relative error of
the squared norms. Times are process CPU time, the median of ``--repeats`` interleaved rounds
(the ways alternate, so other jobs' load hits them alike), one torch thread, torch's kernels
as they are (oneDNN on, as in benchmarks/diversity.py) or ``--kernels portable`` (oneDNN
off, batchbound's commands' default). ``rule`` is what ``choose_strategy``
picks from the layer's flop counts.

    python benchmarks/conv_grads.py                  # LeNet-5 (256) and ResNet-8 (64)
    python benchmarks/conv_grads.py --models lenet --repeats 21 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound import kernels
from batchbound.diversity.rules import conv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import CASES

CHUNKS = {"lenet": 256, "resnet": 64}  # measure()'s chunks in benchmarks/diversity.py
Way = Callable[[nn.Conv2d, Tensor, Tensor], Tensor]


def _kernel_padding(layer: nn.Conv2d, x: Tensor) -> tuple[Tensor, tuple[int, ...] | int]:
    """(input, padding for the kernel): the kernel pads symmetric zeros itself (no copy), as
    the rule does; any other padding is applied to the input first."""
    if layer.padding_mode == "zeros" and not isinstance(layer.padding, str):
        return x, layer.padding
    return conv._padded(layer, x), 0


def batch(layer: nn.Conv2d, x: Tensor, b: Tensor) -> Tensor:
    return conv._weight_sum(layer, x, b)


def grouped(layer: nn.Conv2d, x: Tensor, b: Tensor) -> Tensor:
    return conv.conv_weight_grads(layer, x, b)


def grouped_nchw(layer: nn.Conv2d, x: Tensor, b: Tensor) -> Tensor:
    """The grouped kernel with the folded input as laid out (NCHW), never channels-last."""
    n = x.shape[0]
    x, padding = _kernel_padding(layer, x)
    grads = torch.nn.grad.conv2d_weight(
        x.reshape(1, -1, *x.shape[2:]),
        (n * layer.out_channels, layer.in_channels // layer.groups, *layer.kernel_size),
        b.reshape(1, -1, *b.shape[2:]), stride=layer.stride, padding=padding,
        dilation=layer.dilation, groups=n * layer.groups)
    return grads.reshape(n, layer.out_channels, -1, *layer.kernel_size)


def grouped_channels_last(layer: nn.Conv2d, x: Tensor, b: Tensor) -> Tensor:
    n = x.shape[0]
    x, padding = _kernel_padding(layer, x)
    folded_x = x.reshape(1, -1, *x.shape[2:]).contiguous(memory_format=torch.channels_last)
    folded_b = b.reshape(1, -1, *b.shape[2:]).contiguous(memory_format=torch.channels_last)
    grads = torch.nn.grad.conv2d_weight(
        folded_x, (n * layer.out_channels, layer.in_channels // layer.groups, *layer.kernel_size),
        folded_b, stride=layer.stride, padding=padding, dilation=layer.dilation,
        groups=n * layer.groups)
    return grads.reshape(n, layer.out_channels, -1, *layer.kernel_size)


def opacus(layer: nn.Conv2d, x: Tensor, b: Tensor) -> Tensor:
    """g_i[o, c] = x_i[c] ⋆ b_i[o]: the input's channels as a batch, each example's output
    gradient as the kernels of one group (stride and dilation exchange roles)."""
    if layer.groups != 1:
        raise NotImplementedError("groups")
    n, c_out = x.shape[0], layer.out_channels
    x, padding = _kernel_padding(layer, x)
    out = F.conv2d(x.transpose(0, 1), b.reshape(n * c_out, 1, *b.shape[2:]),
                   stride=layer.dilation, padding=padding, dilation=layer.stride, groups=n)
    kh, kw = layer.kernel_size
    out = out[:, :, :kh, :kw]  # a stride leaves positions past the kernel: not gradients
    return out.reshape(layer.in_channels, n, c_out, kh, kw).permute(1, 2, 0, 3, 4)


def unfold_bmm(layer: nn.Conv2d, x: Tensor, b: Tensor) -> Tensor:
    if layer.groups != 1:
        raise NotImplementedError("groups")
    n = x.shape[0]
    x, padding = _kernel_padding(layer, x)
    patches = F.unfold(x, layer.kernel_size, dilation=layer.dilation, padding=padding,
                       stride=layer.stride)
    grads = torch.bmm(b.reshape(n, layer.out_channels, -1), patches.transpose(1, 2))
    return grads.reshape(n, layer.out_channels, layer.in_channels, *layer.kernel_size)


def rows_bmm(layer: nn.Conv2d, x: Tensor, b: Tensor) -> Tensor:
    """x unfolded along its columns only (kw copies), laid out so that kernel row u's
    patches are one contiguous slice: one batched product per kernel row."""
    if layer.groups != 1 or layer.stride != (1, 1) or layer.dilation != (1, 1):
        raise NotImplementedError("stride, dilation or groups")
    n, c_in = x.shape[:2]
    kh, kw = layer.kernel_size
    c_out, (oh, ow) = layer.out_channels, b.shape[2:]
    wide = conv._padded(layer, x).unfold(3, kw, 1).permute(0, 2, 3, 1, 4).contiguous()
    flat_b = b.reshape(n, c_out, oh * ow)
    out = x.new_empty(n, c_out, kh, c_in * kw)
    for u in range(kh):
        out[:, :, u] = torch.bmm(flat_b, wide[:, u : u + oh].reshape(n, oh * ow, c_in * kw))
    return out.reshape(n, c_out, kh, c_in, kw).permute(0, 1, 3, 2, 4)


WAYS: dict[str, tuple[Way, bool]] = {  # name -> (function, gives gradients, not norms)
    "batch": (batch, True),
    "grouped": (grouped, True),
    "grouped, NCHW": (grouped_nchw, True),
    "grouped, channels-last": (grouped_channels_last, True),
    "patches": (conv.patches_weight_grads, True),
    "opacus": (opacus, True),
    "unfold+bmm": (unfold_bmm, True),
    "rows+bmm": (rows_bmm, True),
    "shifts": (conv.shifts_weight_sq_norms, False),
    "gram": (conv.gram_weight_sq_norms, False),
}


def layer_inputs(key: str, n: int) -> list[tuple[str, nn.Conv2d, Tensor, Tensor]]:
    """(name, layer, its input on one chunk of n, a random output gradient) per conv."""
    torch.manual_seed(0)
    model = CASES[key].build().eval()
    seen: dict[str, tuple[Tensor, torch.Size]] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
            seen.setdefault(name, (args[0].detach(), out.shape))
        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules()
               if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(CASES[key].inputs(n)[0])
    for h in handles:
        h.remove()
    layers = dict(model.named_modules())
    return [(name, layers[name], x, torch.randn(shape)) for name, (x, shape) in seen.items()]


def sq_norms(value: Tensor, gives_grads: bool, n: int) -> Tensor:
    return value.reshape(n, -1).square().sum(dim=1) if gives_grads else value


def check(layer: nn.Conv2d, x: Tensor, b: Tensor, way: Way, gives_grads: bool) -> float:
    """Largest relative error of the squared norms, float64, on 4 examples, against each
    example's gradient computed alone."""
    layer64 = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size,
                        stride=layer.stride, padding=layer.padding, dilation=layer.dilation,
                        groups=layer.groups, bias=False, padding_mode=layer.padding_mode)
    layer64 = layer64.double()
    x64, b64 = x[:4].double(), b[:4].double()
    alone = torch.stack([batch(layer64, x64[i : i + 1], b64[i : i + 1]) for i in range(4)])
    want = sq_norms(alone, True, 4)
    got = sq_norms(way(layer64, x64, b64), gives_grads, 4)
    return float(((got - want).abs() / want.abs().clamp_min(1e-300)).max())


def run(key: str, repeats: int) -> list[dict]:
    n = CHUNKS[key]
    rows = []
    for name, layer, x, b in layer_inputs(key, n):
        positions = math.prod(b.shape[2:])
        rule = conv.choose_strategy(n, layer.in_channels, layer.out_channels, layer.groups,
                                    math.prod(layer.kernel_size), positions)
        usable: dict[str, tuple[Way, bool]] = {}
        errors: dict[str, float | str] = {}
        for way_name, (way, gives) in WAYS.items():
            try:
                errors[way_name] = 0.0 if way_name == "batch" else check(layer, x, b, way, gives)
                usable[way_name] = (way, gives)
            except NotImplementedError as exc:
                errors[way_name] = f"n/a ({exc})"
        times: dict[str, list[float]] = {k: [] for k in usable}
        with torch.no_grad():
            for way, _ in usable.values():  # warm-up: oneDNN builds its kernels once
                way(layer, x, b)
            for _ in range(repeats):
                for way_name, (way, _) in usable.items():
                    start = time.process_time()
                    way(layer, x, b)
                    times[way_name].append(time.process_time() - start)
        rows.append({
            "model": CASES[key].name, "layer": name, "examples": n,
            "shape": f"{layer.in_channels}→{layer.out_channels}, {layer.kernel_size[0]}×"
                     f"{layer.kernel_size[1]}, stride {layer.stride[0]}, {positions} positions",
            "rule": rule,
            "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "rel_err": errors,
        })
        print(f"done: {key} {name}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="lenet,resnet", help="comma-separated: lenet, resnet")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (median)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--kernels", choices=kernels.KERNELS, default="native",
                        help="native (oneDNN on: benchmarks/diversity.py's) or portable "
                        "(batchbound's commands' default: oneDNN off)")
    args = parser.parse_args(argv)
    kernels.use(args.kernels)  # before the first tensor operation
    torch.set_num_threads(1)
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    if any(k not in CHUNKS for k in keys):
        parser.error(f"unknown models {keys}; choose from {list(CHUNKS)}")
    rows = [row for key in keys for row in run(key, args.repeats)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"torch {torch.__version__}, {kernels.describe()}, 1 thread, CPU ms per chunk "
          f"(median of {args.repeats}); rel. err.: squared norms against each example "
          "alone, float64")
    print("| layer | shape | examples | rule | " + " | ".join(WAYS) + " |")
    print("|---|---|---|---|" + "---|" * len(WAYS))
    for r in rows:
        cells = []
        for k in WAYS:
            if k in r["ms"]:
                cells.append(f"{r['ms'][k]:.2f} ({r['rel_err'][k]:.0e})" if k != "batch"
                             else f"{r['ms'][k]:.2f}")
            else:
                cells.append("n/a")
        print(f"| {r['model']} {r['layer']} | {r['shape']} | {r['examples']} | {r['rule']} | "
              + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
