"""Worker functions for tests/test_batchnorm.py (spawned ranks import them by name)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _models import full_state
from _workers import _save_expected

import ckptd


class BNNet(torch.nn.Module):
    """A BatchNorm between two layers: its running statistics come from each rank's own batches."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 10)
        self.bn = torch.nn.BatchNorm1d(10)
        self.out = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


def wrap(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def save_batchnorm(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str) -> dict[str, Any]:
    """Two training steps on this rank's own data, a blocking snapshot of step 2; rank 0 writes the state it holds
    (its own buffers: what DDP's next forward would broadcast)."""
    torch.manual_seed(0)
    model = wrap(kind, BNNet())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        optim.zero_grad()
        model(torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 + i + 100 * rank))).pow(2).mean().backward()
        optim.step()
    want = full_state(model, optim)  # a collective: every rank
    if rank == 0:
        _save_expected(expected, want)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        path = c.snapshot(model, optim, step=2, blocking=True).wait(60)
    return {"path": path, "running_mean": want["model/bn.running_mean"].tolist()}
