"""gns_hook on two gloo ranks: the monitor it feeds equals McCandlish et al.'s two-batch
estimate computed by hand from the same per-rank gradients (all-gathered), for mean and sum
losses, unequal local batches, several buckets, no_sync accumulation and GradScaler loss
scaling; an inf step is not folded. No extra collective is involved in the hook itself.
A trunk whose .grad the loop leaves to grow (a zero_grad of the head's optimizer only) gets
its steps skipped on every rank, not folded wrong; zeros kept by set_to_none=False change
nothing. Uneven inputs under Join: the steps a joined rank shadows (DDP runs the hook there
on zero buckets; they were read as its data) are skipped; static_graph changes nothing."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from batchbound.diversity.online import OnlineDiversity
from batchbound.integrations.ddp import gns_hook, gns_hook_state
from batchbound.train.distributed import init_group, teardown

pytestmark = pytest.mark.distributed

STEPS = 4
SIZES = {0: 6, 1: 10}  # unequal local batches


def make_model() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def batch(step: int, rank: int, size: int, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + part)
    return (torch.randn(size, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (size,), generator=g))


def flat_grad(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def run_case(rank: int, case: str) -> dict[str, float]:
    model = make_model()
    b = SIZES[rank] if case in ("mean", "sum") else 8
    reduction = "sum" if case == "sum" else "mean"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if case == "amp" else None
    local_size = 2 * b if case == "no_sync" else b
    # bucket_cap_mb tiny: several buckets, so the per-bucket norms must add up
    ddp = DDP(make_model(), bucket_cap_mb=1e-4, static_graph=case == "static")
    state = gns_hook_state(100, local_size, reduction, loss_scale=scaler)
    state.records.monitor = OnlineDiversity(100, decay=None)
    ddp.register_comm_hook(state, gns_hook)
    reference = OnlineDiversity(100, decay=None)
    # join: rank 1 runs out of data two steps early and shadows rank 0's last two
    steps = STEPS - 2 * rank if case == "join" else STEPS
    with Join([ddp]) if case == "join" else contextlib.nullcontext():
        run_steps(case, rank, ddp, model, b, steps, reduction, scaler, reference)
    monitor = state.monitor
    return {"steps": monitor.steps, "ref_steps": reference.steps, "skipped": state.skipped,
            "carried": state.carried, "shadowed": state.shadowed,
            "m2": monitor.m2, "ref_m2": reference.m2, "cross": monitor.cross,
            "ref_cross": reference.cross, "bound": monitor.batch_bound,
            "ref_bound": reference.batch_bound}


def run_steps(case: str, rank: int, ddp: DDP, model: nn.Module, b: int, steps: int,
              reduction: str, scaler, reference: OnlineDiversity) -> None:
    for step in range(steps):
        if case == "head":  # the head's optimizer's zero_grad: the trunk's .grad grows
            ddp.module[2].zero_grad(set_to_none=True)
        else:
            ddp.zero_grad(set_to_none=case != "zeros")
        if case == "no_sync":
            parts = [batch(step, rank, b, part) for part in range(2)]
            with ddp.no_sync():
                F.cross_entropy(ddp(parts[0][0]), parts[0][1]).div(2).backward()
            F.cross_entropy(ddp(parts[1][0]), parts[1][1]).div(2).backward()
            x = torch.cat([parts[0][0], parts[1][0]])
            y = torch.cat([parts[0][1], parts[1][1]])
        else:
            x, y = batch(step, rank, b)
            if case == "amp" and step == 2 and rank == 0:
                x = x * float("inf")  # an overflowing step: a GradScaler would skip it
            loss = F.cross_entropy(ddp(x), y, reduction=reduction)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if case == "join" and step >= STEPS - 2:
            continue  # rank 0 alone: no gather for the reference
        # by hand: this rank's mean gradient from the plain model, all ranks' via all_gather
        local = flat_grad(model, F.cross_entropy(model(x), y))
        grads, sizes = gather(local), gather(torch.tensor([float(x.shape[0])]))
        if not all(torch.isfinite(g).all() for g in grads) or (case == "head" and step):
            continue
        sizes = [float(s) for s in sizes]
        small = sum(float(g.square().sum()) for g in grads) / len(grads)
        harmonic = len(sizes) / sum(1 / s for s in sizes)
        if reduction == "mean":  # DDP averages the ranks' means
            big_grad, big_size = sum(grads) / len(grads), len(sizes) * harmonic
        else:  # the ranks' sums, averaged: the global mean over Σb examples
            big_grad = sum(s * g for s, g in zip(sizes, grads, strict=True)) / sum(sizes)
            big_size = sum(sizes)
        reference.update_two_batch(small, harmonic, float(big_grad.square().sum()), big_size)
        # DDP's gradient is still DDP's average
        reduced = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        expected = big_grad * (big_size / len(sizes) if reduction == "sum" else 1.0)
        assert torch.allclose(reduced / (scaler.get_scale() if scaler else 1.0), expected,
                              rtol=1e-10, atol=1e-13)


def worker(rank: int, port: int, queue) -> None:
    # init_group, not dist.init_process_group: DDP pulls in torch._dynamo, whose imports
    # would otherwise keep the group alive past teardown (docs/torchrun-abort.md)
    init_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = {case: run_case(rank, case)
               for case in ("mean", "sum", "amp", "no_sync", "head", "zeros", "static",
                            "join")}
        queue.put((rank, out))
    finally:
        teardown()


def test_hook_matches_two_batch_estimate_by_hand() -> None:
    results = run_ranks(worker)
    for rank, cases in results.items():
        for case, r in cases.items():
            where = f"rank {rank}, {case}"
            # head: all but the first; join: the two rank 0 ran alone
            dropped = {"amp": 1, "head": STEPS - 1, "join": 2}.get(case, 0)
            assert r["steps"] == r["ref_steps"] == STEPS - dropped, where
            assert r["skipped"] == dropped, where
            assert r["carried"] == (dropped if case == "head" else 0), where
            assert r["shadowed"] == (2 if case == "join" and rank == 1 else 0), where
            for key in ("m2", "cross", "bound"):
                assert r[key] == pytest.approx(r["ref_" + key], rel=1e-9), (where, key)
    # every rank holds the same (global) estimate
    for case in results[0]:
        assert results[0][case]["bound"] == pytest.approx(results[1][case]["bound"], rel=1e-12)


def test_example_runs_under_torchrun(tmp_path) -> None:
    """examples/ddp_gns.py, as docs/integrations.md shows it, on two CPU ranks; no gloo thread
    outlives its destroy_process_group (one that does can abort the rank at interpreter exit,
    a few runs in a hundred: docs/torchrun-abort.md)."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "ddp_gns.py"
    wrapper = tmp_path / "run_example.py"
    wrapper.write_text(
        "import glob, os, runpy\n"
        f"runpy.run_path({str(example)!r}, run_name='__main__')\n"
        "names = [open(p).read().strip() for p in glob.glob('/proc/self/task/*/comm')]\n"
        # one file per rank: two ranks printing to one pipe interleave their lines
        f"with open(os.path.join({str(tmp_path)!r}, 'gloo-' + os.environ['RANK']), 'w') as f:\n"
        "    f.write(str(sum('gloo' in n for n in names)))\n")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(wrapper)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if Path("/proc/self/task").is_dir():
        left = {p.name: p.read_text() for p in tmp_path.glob("gloo-*")}
        assert left == {"gloo-0": "0", "gloo-1": "0"}, left
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 3 and "n·Δ" in lines[-1]
