"""The DDP communication hook on two gloo ranks: with quantization each rank's bucket is
replaced by Q(its gradient) before the average, exactly as a hand computation with the same
generator gives; with no mechanism it is DDP's own averaging."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from batchbound.diversity.mechanisms import quantize_group
from batchbound.train.comm_hook import mechanism_hook, mechanism_hook_state
from batchbound.train.distributed import init_group, teardown

pytestmark = pytest.mark.distributed


def local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    loss = F.cross_entropy(model(x), y)
    return list(torch.autograd.grad(loss, list(model.parameters())))


def ddp_grads(model: nn.Module, spec: str, x, y) -> list[torch.Tensor]:
    ddp = DDP(model, bucket_cap_mb=1024)
    ddp.register_comm_hook(mechanism_hook_state(spec, seed=3), mechanism_hook)
    F.cross_entropy(ddp(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def worker(rank: int, port: int, queue) -> None:
    # init_group, not dist.init_process_group: DDP pulls in torch._dynamo, whose imports
    # would otherwise keep the group alive past teardown (docs/torchrun-abort.md)
    init_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        x, y = torch.randn(20, 6, dtype=torch.float64), torch.randint(0, 3, (20,))
        mine = slice(0, 10) if rank == 0 else slice(10, 20)
        out = {}
        # quantization: one parameter tensor, so the bucket is exactly that gradient
        torch.manual_seed(1)
        single = nn.Linear(6, 3, bias=False).double()
        reference = quantize_group(local_grads(single, x[mine], y[mine]),
                                   mechanism_hook_state("none", seed=3).generator)
        gathered = [torch.empty_like(reference[0]) for _ in range(2)]
        dist.all_gather(gathered, reference[0])
        out["quantized"] = ddp_grads(single, "quantization", x[mine], y[mine])[0]
        out["expected_quantized"] = (gathered[0] + gathered[1]) / 2
        out["local_norm"] = local_grads(single, x[mine], y[mine])[0].norm()
        out["reference"] = reference[0]
        # no mechanism on a two-layer model: DDP's average of the two ranks' gradients
        torch.manual_seed(2)
        mlp = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).double()
        out["plain"] = ddp_grads(mlp, "none", x[mine], y[mine])
        out["full_batch"] = local_grads(mlp, x, y)  # equal halves: mean of means = mean
        # tensors through a queue travel as shared memory that dies with this process
        queue.put((rank, {k: [t.numpy() for t in v] if isinstance(v, list) else v.numpy()
                          for k, v in out.items()}))
    finally:
        teardown()


def test_hook_quantizes_each_worker_then_averages() -> None:
    results = run_ranks(worker)
    results = {rank: {k: [torch.from_numpy(a) for a in v] if isinstance(v, list)
                      else torch.from_numpy(v) for k, v in out.items()}
               for rank, out in results.items()}
    for out in results.values():
        assert torch.allclose(out["quantized"], out["expected_quantized"], rtol=1e-12)
        # Q(g) has entries in {0, ±‖g‖}: it really is quantized, and it differs from g
        values = out["reference"].abs().unique()
        assert all(v == 0 or torch.isclose(v, out["local_norm"]) for v in values)
        for got, want in zip(out["plain"], out["full_batch"], strict=True):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)
    # ranks hold the same averaged gradient, and drew independently (different seeds per rank)
    assert torch.equal(results[0]["quantized"], results[1]["quantized"])
    assert not torch.equal(results[0]["reference"] / results[0]["local_norm"],
                           results[1]["reference"] / results[1]["local_norm"])
