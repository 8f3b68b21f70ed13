"""Rank bodies for the multi-rank memory tier tests (module-level so spawned processes can import them)."""

from __future__ import annotations

import os
import time
from typing import Any

from _models import assert_same, full_state, train_step
from _workers import _load_expected, _save_expected, build

import ckptd

HOLD_S = 120.0  # the longest a saving rank stays alive waiting for the test to release it


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def save_memory_tier_and_hold(
    rank: int, world: int, kind: str, endpoint: str, job: str, expected: str, every: int, ready: str, release: str
) -> dict[str, Any]:
    """Snapshot steps 1, 2, 3 (default, non-blocking) with ``persist_every=every``, a train step before each;
    rank 0 writes the state as of step 3's snapshot to ``expected``; then train on. Each rank then marks
    ``{ready}.{rank}`` and stays alive until ``release`` exists: the daemon persists a memory-only step once
    every process that committed it is gone, and the test needs it held in memory meanwhile."""
    model, optim = build(kind)
    with ckptd.Client(endpoint=endpoint, job=job, persist_every=every) as c:
        for step in (1, 2, 3):
            train_step(model, optim, step + 100 * rank)  # ranks see different data, as in real training
            c.snapshot(model, optim, step=step, extra={"rank": rank})
        want = full_state(model, optim)  # a collective: every rank; while step 3's copy may be in flight
        train_step(model, optim, 50 + 100 * rank)  # mutates what step 3's copy reads: waits for it first
        # no wait() on steps 2 and 3: a wait for a memory-only step would persist it
    # close() finished the background copy and commit of step 3
    if rank == 0:
        _save_expected(expected + ".part", want)
        os.replace(expected + ".part", expected)
    with open(f"{ready}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    _wait_for(release, HOLD_S)
    return {"pid": os.getpid()}


def restore_from_daemon(rank: int, world: int, kind: str, endpoint: str, job: str, expected: str, hot: bool) -> dict[str, Any]:
    """Restore the newest step of ``job`` through the daemon into a fresh model in layout ``kind``; rank 0
    compares the full state with ``expected``, bit for bit."""
    model, optim = build(kind, seed=7)
    with ckptd.Client(endpoint=endpoint, job=job) as c:
        extra = c.restore(model, optim, hot=hot)
        last = dict(c.last_restore or {})
    got = full_state(model, optim)  # a collective: every rank
    if rank == 0:
        assert_same(got, _load_expected(expected))
    train_step(model, optim, 99)  # and training goes on from it
    return {"extra": dict(extra), "step": last.get("step"), "source": last.get("source")}
