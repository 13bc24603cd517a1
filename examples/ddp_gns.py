"""The batch-size bound n·Δ and the noise scale in your own DDP loop, from a communication
hook (no extra collective): torchrun --standalone --nproc_per_node 2 examples/ddp_gns.py"""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before the group exists: docs/torchrun-abort.md
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from batchbound.integrations.ddp import gns_hook, gns_hook_state


def train() -> None:
    torch.manual_seed(0)
    x = torch.randn(4096, 20)
    data = TensorDataset(x, (x[:, :5].sum(1) > 0).long())
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data), drop_last=True)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 2)))
    state = gns_hook_state(len(data), local_batch_size=64)  # n, examples per rank and step
    model.register_comm_hook(state, gns_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        m = state.monitor  # folds the steps the hook recorded (every rank holds the same numbers)
        if dist.get_rank() == 0:
            low, high = m.batch_bound_interval  # ± 2 SE and the EMA's lag behind a moving n·Δ
            print(f"epoch {epoch}: n·Δ = {m.batch_bound:.0f} ({low:.0f}–{high:.0f}), "
                  f"noise scale {m.noise_scale:.0f}, Δ = {m.diversity:.3f}")


if __name__ == "__main__":
    dist.init_process_group("gloo")  # "nccl" on GPUs
    train()  # DDP holds the group: it must be gone before the group is destroyed
    dist.destroy_process_group()
