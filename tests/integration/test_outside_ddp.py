"""gns_hook (integrations/ddp.py) under DDP settings outside users pick, on two gloo ranks,
against McCandlish et al.'s two-batch estimate by hand from the same per-rank gradients
(all-gathered), in float64: a nanoGPT-style model called on dict batches, with its head tied
to its embedding, a LoRA adapter beside a frozen base weight (frozen parameters are in no
bucket), a branch one rank does not use (find_unused_parameters=True) and
gradient_as_bucket_view=True."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from batchbound.diversity.online import OnlineDiversity
from batchbound.integrations.ddp import gns_hook, gns_hook_state
from batchbound.train.distributed import init_group, teardown

pytestmark = pytest.mark.distributed
VOCAB, WIDTH, STEPS, LENGTH = 11, 8, 3, 5
SIZES = {0: 3, 1: 5}


class TiedLoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)  # frozen, as LoRA leaves it
        self.lora_a = nn.Parameter(torch.randn(2, WIDTH) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(WIDTH, 2) * 0.3)
        self.aux = nn.Linear(WIDTH, WIDTH)  # used only by batches that ask for it
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as nanoGPT ties wte and lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                use_aux: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.wte(input_ids)
        h = torch.tanh(self.base(h) + h @ self.lora_a.t() @ self.lora_b.t())
        if use_aux:
            h = h + torch.tanh(self.aux(h))
        logits = self.head(h)
        return logits, F.cross_entropy(logits.transpose(1, 2), labels)


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, VOCAB, (SIZES[rank], LENGTH), generator=g)
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


def run(rank: int) -> dict[str, float]:
    plain = TiedLoRA().double()
    ddp = DDP(TiedLoRA().double(), bucket_cap_mb=1e-4, find_unused_parameters=True,
              gradient_as_bucket_view=True)
    state = gns_hook_state(100, SIZES[rank])
    state.records.monitor = OnlineDiversity(100, decay=None)
    ddp.register_comm_hook(state, gns_hook)
    reference = OnlineDiversity(100, decay=None)
    params = [p for p in plain.parameters() if p.requires_grad]
    for step in range(STEPS):
        ddp.zero_grad(set_to_none=True)
        b = batch(step, rank)
        use_aux = rank == 1  # rank 0 never reaches aux: DDP reduces zeros for it
        ddp(**b, use_aux=use_aux)[1].backward()
        grads = torch.autograd.grad(plain(**b, use_aux=use_aux)[1], params, allow_unused=True,
                                    materialize_grads=True)
        local = torch.cat([g.reshape(-1) for g in grads])
        every = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(every, local)
        small = sum(float(g.square().sum()) for g in every) / 2
        harmonic = 2 / sum(1 / s for s in SIZES.values())
        big = sum(every) / 2
        reference.update_two_batch(small, harmonic, float(big.square().sum()), 2 * harmonic)
    monitor = state.monitor
    return {"steps": monitor.steps, "m2": monitor.m2, "cross": monitor.cross,
            "ref_steps": reference.steps, "ref_m2": reference.m2, "ref_cross": reference.cross}


def worker(rank: int, port: int, queue) -> None:
    init_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        queue.put((rank, run(rank)))
    finally:
        teardown()


def test_hook_on_a_tied_lora_model_with_dict_batches_and_an_unused_branch() -> None:
    results = run_ranks(worker)
    for rank, r in results.items():
        assert r["steps"] == r["ref_steps"] == STEPS, rank
        assert r["m2"] == pytest.approx(r["ref_m2"], rel=1e-10), rank
        assert r["cross"] == pytest.approx(r["ref_cross"], rel=1e-10), rank
