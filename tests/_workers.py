"""Rank bodies for multi-process tests (module-level so spawned processes can import them)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from _models import assert_same, full_state, make, train_step

import ckptd


def wrap(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``model`` the way a user of ``kind`` would on this CPU/gloo machine."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.hidden, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    if kind == "plain":
        return model
    raise ValueError(kind)


def build(kind: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, _ = make(seed)
    model = wrap(kind, model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_expected(path: str, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, path)


def _load_expected(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def save_then_check(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str, blocking: bool) -> dict[str, Any]:
    """Train a few steps, snapshot at step 3 (then keep training), write the expected state."""
    model, optim = build(kind)
    for i in range(3):
        train_step(model, optim, i + 100 * rank)  # ranks see different data, as in real training
    want = full_state(model, optim)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        h = c.snapshot(model, optim, step=3, extra={"rank": rank}, blocking=blocking)
        train_step(model, optim, 50)  # runs while a default-mode copy may still be in flight
        path = h.wait(60)
    if rank == 0:
        _save_expected(expected, want)
    return {"path": path}


def restore_and_compare(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str) -> dict[str, Any]:
    model, optim = build(kind, seed=7)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        extra = c.restore(model, optim)
    got = full_state(model, optim)
    if rank == 0:
        assert_same(got, _load_expected(expected))
    return {"extra": extra}


def snapshot_then_die(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str) -> None:
    """Snapshot (blocking) at step 2 and SIGKILL this rank right after it returns."""
    model, optim = build(kind)
    for i in range(2):
        train_step(model, optim, i + 100 * rank)
    want = full_state(model, optim)
    if rank == 0:
        _save_expected(expected, want)
    dist.barrier()  # expected state written before anyone dies
    c = ckptd.Client(endpoint=endpoint, job=job)
    c.snapshot(model, optim, step=2, extra={"rank": rank, "note": "pre-kill"}, blocking=True)
    state = c._call("wait", job=job, step=2, timeout=0.0)["state"]
    with open(f"{expected}.state-{rank}", "w") as f:
        f.write(state)  # proves the kill came before the step was durable
    os.kill(os.getpid(), signal.SIGKILL)
