"""Rank bodies for the DCP Writer / Reader tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models import assert_same, full_state, train_step
from _workers import _load_expected, _save_expected, build
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptd.dcp


def dcp_save(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str) -> dict[str, Any]:
    """Train; ``dcp.save`` step 1 and ``dcp.async_save`` step 2 through the Writer; training goes on while
    step 2 is persisted. Rank 0 writes each step's expected full state to ``expected``.<step>."""
    model, optim = build(kind)
    writer = ckptd.dcp.Writer(job, endpoint=endpoint)
    # DCP's background thread needs a group of its own: the training thread's FSDP collectives run meanwhile
    save_group = dist.new_group(backend="gloo")
    for step in (1, 2):
        train_step(model, optim, step + 100 * rank)
        want = full_state(model, optim)
        if rank == 0:
            _save_expected(f"{expected}.{step}", want)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "trainer": {"step": step, "rank_seen": rank}}
        if step == 1:
            dcp.save(state, storage_writer=writer, checkpoint_id=str(step))
        else:
            fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=str(step), process_group=save_group)
            train_step(model, optim, 77)  # mutates every parameter and moment while the save is in flight
            fut.result()
    return {"job": job}


def dcp_load(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str, step: int) -> dict[str, Any]:
    """``dcp.load`` step ``step`` of ``job`` through ``Reader(job=...)`` into layout ``kind``; compare."""
    model, optim = build(kind, seed=7)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "trainer": {"step": -1, "rank_seen": -1}}
    reader = ckptd.dcp.Reader(job=job, endpoint=endpoint, step=step)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_state(model, optim)
    if rank == 0:
        assert_same(got, _load_expected(f"{expected}.{step}"))
    train_step(model, optim, 5)  # training goes on from it
    return {"trainer": state["trainer"], "source": reader.last_restore["source"]}
