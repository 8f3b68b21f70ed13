"""Rank bodies for tests/test_user_mistakes.py: what a user gets wrong in a distributed loop (run by
``_dist.run_ranks`` in spawned processes)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from _models import full_state, make, train_step
from _workers import _load_expected, _save_expected, build, wrap

import ckptd


def _error(fn: Any) -> str | None:
    try:
        fn()
    except ckptd.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return None


def different_steps(rank: int, world: int, endpoint: str, job: str) -> dict[str, Any]:
    """Rank 1 is off by one: ``snapshot(step=global_step + rank)``."""
    model, optim = build("fsdp2")
    train_step(model, optim, rank)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        err = _error(lambda: c.snapshot(model, optim, step=4 + rank, blocking=True))
        status = c.status()
    return {"error": err, "in_flight": status["jobs"].get(job, {}).get("in_flight", [])}


def restore_different_steps(rank: int, world: int, endpoint: str, job: str) -> dict[str, Any]:
    """Steps 2 and 4 saved; then each rank restores a step of its own (``strict=False`` skips the check a
    strict restore makes) and saves step 5: a step after a restore must follow the same step everywhere."""
    model, optim = build("ddp")
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        for step in (2, 4):
            train_step(model, optim, step)
            c.snapshot(model, optim, step=step, blocking=True).wait(60)
        c.restore(model, optim, step=2 if rank == 0 else 4, strict=False)
        err = _error(lambda: c.snapshot(model, optim, step=5, blocking=True))
    return {"error": err}


def snapshot_on_rank0_only(rank: int, world: int, endpoint: str, job: str) -> dict[str, Any]:
    """``if rank == 0: ckptd.snapshot(...)``: rank 0 gets an error, not a hang and a gloo abort."""
    model, optim = build("ddp")
    train_step(model, optim, rank)
    err = None
    if rank == 0:
        with ckptd.Client(endpoint=endpoint, job=job) as c:
            err = _error(lambda: c.snapshot(model, optim, step=1))
    dist.barrier()  # rank 1 waits here meanwhile; both end cleanly
    return {"error": err}


def die_before_commit(rank: int, world: int, endpoint: str, job: str) -> None:
    """Steps 1-2, snapshot step 2; steps 3-4 and snapshot step 4, where rank 1 dies just before its
    commit (rank 0's commit of step 4 is in the daemon)."""
    model, optim = build("fsdp2")
    c = ckptd.Client(endpoint=endpoint, job=job)
    for i in range(4):
        train_step(model, optim, i + 100 * rank)
        if i + 1 == 2:
            c.snapshot(model, optim, step=2, blocking=True).wait(60)
    if rank == 1:
        c._commit = lambda *a: os._exit(9)  # type: ignore[method-assign]
    c.snapshot(model, optim, step=4, blocking=True)
    os._exit(9)  # rank 0: gone too, its step 4 pending for ever in the old daemon


def resume_and_save_again(rank: int, world: int, endpoint: str, job: str, expected: str) -> dict[str, Any]:
    """The relaunch: restore the latest (step 2), train steps 3-4 on other data, snapshot step 4."""
    model, optim = build("fsdp2", seed=5)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        got = c.restore(model, optim)
        for i in range(2, 4):
            train_step(model, optim, i + 1000 + 100 * rank)
        want = full_state(model, optim)
        if rank == 0:
            _save_expected(expected, want)
        path = c.snapshot(model, optim, step=4, blocking=True).wait(60)
    return {"restored": got.step, "path": path}


def restore_and_compare(rank: int, world: int, endpoint: str, job: str, expected: str) -> dict[str, Any]:
    model, optim = build("fsdp2", seed=9)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        step = c.restore(model, optim, hot=False).step
    want, got = _load_expected(expected), full_state(model, optim)
    return {"step": step, "same": want.keys() == got.keys() and all(want[k].equal(got[k]) for k in want)}


def restore_into_a_model_one_rank_extended(rank: int, world: int, endpoint: str, job: str) -> dict[str, Any]:
    """Rank 1's model has a buffer the checkpoint lacks: both ranks get the same error (rank 0 does not
    go on alone)."""
    model, optim = build("ddp")
    train_step(model, optim, rank)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(60)
        inner, _ = make(seed=3)
        if rank == 1:
            inner.register_buffer("extra_stat", torch.zeros(2))
        other = wrap("ddp", inner)
        err = _error(lambda: c.restore(other, torch.optim.AdamW(other.parameters())))
    return {"error": err}


def bad_extra_on_one_rank(rank: int, world: int, endpoint: str, job: str) -> dict[str, Any]:
    """Rank 1's extra holds a set: rank 1 gets its own error, rank 0 one naming rank 1, at once."""
    model, optim = build("fsdp2")
    train_step(model, optim, rank)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        err = _error(lambda: c.snapshot(model, optim, step=1, extra={"seen": {1, 2}} if rank == 1 else {}))
        ok = c.snapshot(model, optim, step=2, blocking=True).wait(60)  # the ranks are still in step
    return {"error": err, "then": ok}
