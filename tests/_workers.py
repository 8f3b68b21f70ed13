"""Rank bodies for multi-process tests (module-level so spawned processes can import them)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from _models import assert_same, full_state, make, train_step

import ckptd
from ckptd.client.rpc import Channel


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
    # default mode: the background copy (on CPU state "auto" copies before returning, as blocking does)
    with ckptd.Client(endpoint=endpoint, job=job, overlap="auto" if blocking else "always") as c:
        h = c.snapshot(model, optim, step=3, extra={"rank": rank}, blocking=blocking)
        train_step(model, optim, 50)  # runs while a default-mode copy may still be in flight
        h.wait(60)
        # a second snapshot goes through the capture cache where the wrapper allows it
        want = full_state(model, optim)
        h = c.snapshot(model, optim, step=4, extra={"rank": rank}, blocking=blocking)
        train_step(model, optim, 51)
        path = h.wait(60)
    if rank == 0:
        _save_expected(expected, want)
    return {"path": path}


def restore_and_compare(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str, hot: bool = True) -> dict[str, Any]:
    model, optim = build(kind, seed=7)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        extra = c.restore(model, optim, hot=hot)
        source = c.last_restore["source"]
    got = full_state(model, optim)
    if rank == 0:
        assert_same(got, _load_expected(expected))
    return {"extra": extra, "source": source}


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
    with Channel(endpoint, 30.0) as rpc:
        state = rpc.call("wait", job=job, step=2, timeout=0.0)["state"]
    with open(f"{expected}.state-{rank}", "w") as f:
        f.write(state)  # proves the kill came before the step was durable
    os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- any layout


def save_layout(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str) -> dict[str, Any]:
    """Train 2 steps in layout ``kind`` and snapshot step 2 (blocking); rank 0 writes the expected state."""
    model, optim = build(kind)
    for i in range(2):
        train_step(model, optim, i + 100 * rank)
    want = full_state(model, optim)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        path = c.snapshot(model, optim, step=2, extra={"rank": rank}, blocking=True).wait(60)
    if rank == 0:
        _save_expected(expected, want)
    return {"path": path}


def restore_layout(rank: int, world: int, kind: str, path: str, expected: str) -> dict[str, Any]:
    """Restore ``path`` into a fresh model in layout ``kind``; rank 0 compares the full state."""
    model, optim = build(kind, seed=7)
    extra = ckptd.restore(model, optim, path=path)
    got = full_state(model, optim)
    if rank == 0:
        assert_same(got, _load_expected(expected))
    train_step(model, optim, 99)  # and training goes on from it
    return {"extra": extra}


# ----------------------------------------------------------------------------- MoE


class MoE(torch.nn.Module):
    """Dense layers plus experts; ``experts`` names the experts this rank holds ('s': a frozen expert
    replicated across groups)."""

    def __init__(self, experts: list[str], names: dict[str, str] | None = None, d: int = 16, h: int = 24) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(d, h)
        every = {e: torch.nn.Linear(h, h) for e in ("0", "1", "s")}
        every["s"].requires_grad_(False)
        self.experts = torch.nn.ModuleDict({(names or {}).get(e, e): every[e] for e in experts})
        self.out = torch.nn.Linear(h, 4)
        self.register_buffer("counter", torch.zeros(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(torch.relu(sum(e(h) for e in self.experts.values())))


def build_moe_fsdp1(rank: int, names: dict[str, str] | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """4 ranks: dense sharded over all; expert 0 over {0,1}, expert 1 over {2,3}, expert s over each group."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = rank // 2
    model = MoE([str(g), "s"], names)
    cpu = torch.device("cpu")
    for name in list(model.experts):
        model.experts[name] = FSDP(model.experts[name], process_group=groups[g], use_orig_params=True, device_id=cpu)
    model = FSDP(model, use_orig_params=True, device_id=cpu)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def build_moe(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = MoE(["0", "1", "s"])
    torch.manual_seed(7)
    for p in model.parameters():  # fresh weights: the restore must overwrite every one
        torch.nn.init.normal_(p)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for e in model.experts.values():
            fully_shard(e, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def save_moe(rank: int, world: int, endpoint: str, job: str, expected: str) -> dict[str, Any]:
    model, optim = build_moe_fsdp1(rank)
    for i in range(2):
        train_step(model, optim, i + 100 * rank)
    want = full_state(model, optim)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        path = c.snapshot(model, optim, step=2, blocking=True).wait(60)
    if rank in (0, 2):  # between them, every global tensor
        _save_expected(f"{expected}.{rank}", {k: v for k, v in want.items() if k != "optim/lr"})
    return {"path": path}


def save_moe_colliding(rank: int, world: int, endpoint: str, job: str) -> dict[str, Any]:
    """Per-group expert names: both groups call their expert 'local'. The step must be refused."""
    model, optim = build_moe_fsdp1(rank, names={"0": "local", "1": "local"})
    train_step(model, optim, rank)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        h = c.snapshot(model, optim, step=1, blocking=True)
        try:
            h.wait(60)
        except ckptd.CheckpointError as e:
            return {"error": str(e)}
    return {"error": None}


def restore_moe(rank: int, world: int, kind: str, path: str) -> dict[str, Any]:
    model, optim = build_moe(kind)
    ckptd.restore(model, optim, path=path)
    got = full_state(model, optim)
    if rank == 0:
        _save_expected(f"{path}/../got-{kind}-{world}.safetensors", {k: v for k, v in got.items() if k != "optim/lr"})
    train_step(model, optim, 99)
    return {}


# ----------------------------------------------------------------------------- multi-node


def save_multinode(rank: int, world: int, kind: str, endpoints: list[str], job: str, expected: str) -> dict[str, Any]:
    """Ranks spread over ``len(endpoints)`` "nodes": rank r talks to node r // (world / nodes)'s daemon.
    Snapshots steps 2 and 4 (blocking) and waits for each; rank 0 writes the state at step 4."""
    per_node = world // len(endpoints)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)  # what torchrun sets on each node
    model, optim = build(kind)
    paths = []
    with ckptd.Client(endpoint=endpoints[rank // per_node], job=job) as c:
        for step in (2, 4):
            for i in range(2):
                train_step(model, optim, i + 10 * step + 100 * rank)
            paths.append(c.snapshot(model, optim, step=step, extra={"rank": rank}, blocking=True).wait(120))
    want = full_state(model, optim)  # a collective: every rank
    if rank == 0:
        _save_expected(expected, want)
    return {"paths": paths}


def resave_multinode(rank: int, world: int, kind: str, endpoints: list[str], job: str, expected: str) -> dict[str, Any]:
    """A new launch after :func:`save_multinode`: restores step 2 (rolling back past step 4), trains on other
    data and saves step 4 again; rank 0 writes the state it saved."""
    per_node = world // len(endpoints)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    model, optim = build(kind, seed=3)
    with ckptd.Client(endpoint=endpoints[rank // per_node], job=job) as c:
        c.restore(model, optim, step=2)
        for i in range(2):
            train_step(model, optim, 1000 + i + 100 * rank)
        want = full_state(model, optim)  # a collective: every rank
        path = c.snapshot(model, optim, step=4, extra={"rank": rank, "line": "new"}, blocking=True).wait(120)
    if rank == 0:
        _save_expected(expected, want)
    return {"path": path}


def restore_via_daemon(rank: int, world: int, kind: str, endpoint: str | list[str], job: str, expected: str) -> dict[str, Any]:
    """Restore the newest step through ``endpoint``'s daemon (which may fetch it from the bucket, or from the job's
    daemons); a list of endpoints: the ranks spread over that many "nodes", each through its node's daemon."""
    endpoints = endpoint if isinstance(endpoint, list) else [endpoint]
    if len(endpoints) > 1:
        os.environ["LOCAL_WORLD_SIZE"] = str(world // len(endpoints))  # what torchrun sets on each node
    model, optim = build(kind, seed=7)
    with ckptd.Client(endpoint=endpoints[rank * len(endpoints) // world], job=job) as c:
        extra = c.restore(model, optim)
        last = c.last_restore
    got = full_state(model, optim)  # a collective: every rank
    if rank == 0:
        assert_same(got, _load_expected(expected))
    return {"extra": extra, "step": last["step"], "source": last["source"]}


def snapshot_multinode_no_wait(rank: int, world: int, kind: str, endpoints: list[str], job: str, expected: str) -> dict[str, Any]:
    """Like :func:`save_multinode`, one step (2), without waiting for durability."""
    per_node = world // len(endpoints)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    model, optim = build(kind)
    for i in range(2):
        train_step(model, optim, i + 100 * rank)
    with ckptd.Client(endpoint=endpoints[rank // per_node], job=job) as c:
        c.snapshot(model, optim, step=2, extra={"rank": rank}, blocking=True)
    want = full_state(model, optim)  # a collective: every rank
    if rank == 0:
        _save_expected(expected, want)
    return {}


def save_mesh(
    rank: int, world: int, kind: str, endpoints: list[str], job: str, expected: str, steps: list[int], every: int | None = None
) -> dict[str, Any]:
    """Ranks spread over ``len(endpoints)`` "nodes" whose daemons hold a job's steps in each other's memory (no bucket):
    snapshot ``steps``; rank 0 writes the state of the last one. Returns what became of the last step's replication and
    of a wait for durability."""
    from ckptd.client.rpc import Channel

    per_node = world // len(endpoints)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    model, optim = build(kind)
    endpoint = endpoints[rank // per_node]
    with ckptd.Client(endpoint=endpoint, job=job, persist_every=every) as c:
        for step in steps:
            train_step(model, optim, step + 100 * rank)
            handle = c.snapshot(model, optim, step=step, extra={"rank": rank, "step": step})
        with Channel(endpoint, 120) as rpc:
            memory = rpc.call("wait", job=job, step=steps[-1], timeout=60, persist=False)["state"]
        replicated = handle.wait_replicated(120)
        try:
            handle.wait(60)
            durable = "durable"
        except ckptd.HeldInMemory:
            durable = "held in memory"
    want = full_state(model, optim)  # a collective: every rank
    if rank == 0:
        _save_expected(expected, want)
    return {"memory": memory, "replicated": replicated, "durable": durable}
