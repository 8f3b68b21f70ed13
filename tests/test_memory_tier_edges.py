"""The memory tier at its edges, each found by a review of it and written as the user's situation: a
restore of a memory-only step while a newer step is on its way to disk, a daemon stopped between two
ranks' commits of a memory-only step, and what ``status`` says a crash could lose."""

from __future__ import annotations

import os

import torch
from _models import assert_same, full_state
from _poll import until
from _rig import shard, tree

from ckptd import shm


def _big(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 25 MB with Adam
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    torch.manual_seed(i)
    model(torch.randn(4, 1024)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def test_a_memory_only_step_restores_from_memory_while_a_newer_step_is_written_to_disk(make_daemon) -> None:  # noqa: ANN001
    """A loss spike: roll back to step 2, which ``status`` lists as memory only, while step 3 is being written to
    a slow disk. hot_open offered only the newest step in memory (3, not yet on disk), and the restore then asked
    the disk for step 2: "step 2 of job 'j' is not a committed checkpoint". Now step 2 comes from memory."""
    d = make_daemon("--write-rate-limit", "4M", "--workers", "1")
    model, optim = _big()
    with d.client("j", persist_every=2) as c:
        for step in (1, 2):  # 1: disk (the first), 2: memory only
            _step(model, optim, step)
            c.snapshot(model, optim, step=step, blocking=True)
        until(lambda: (s := c.status()["jobs"]["j"]).get("latest") == 1 and s.get("memory_only") == [2], what="step 1 durable")
        want = full_state(model, optim)
        _step(model, optim, 3)
        c.snapshot(model, optim, step=3, blocking=True)  # due for disk: 25 MB at 4 MB/s
        assert 3 in c.status()["jobs"]["j"].get("in_flight", []) and c.status()["jobs"]["j"]["memory_only"] == [2]
        m2, o2 = _big(seed=5)
        c.restore(m2, o2, step=2)
        assert c.last_restore["step"] == 2 and c.last_restore["source"] == "memory"
        assert_same(full_state(m2, o2), want)


def _commit(d, rank: int, step: int, ws: int = 2) -> None:  # noqa: ANN001
    """Rank ``rank``'s shard of ``step``, committed as a client does, to a job that keeps one step in 100 on disk."""
    data = shard(step, rank, ws)
    with d.rpc() as rpc:
        rep = rpc.call("alloc", job="j", rank=rank, world_size=ws, step=step, nbytes=len(data), pid=os.getpid())
        with open(shm.path_of(rep["segment"]), "r+b") as f:
            f.write(data)
        fields = dict(job="j", rank=rank, world_size=ws, local_world_size=ws, step=step, segment=rep["segment"], lease=rep["lease"])
        rpc.call("commit", **fields, nbytes=len(data), replicas={}, run=7, after=None, frames=(tree(rank),), persist_every=100)


def test_a_memory_only_step_half_committed_when_the_daemon_is_restarted_completes_after_it(make_daemon) -> None:  # noqa: ANN001
    """``systemctl restart ckptd`` between rank 0's and rank 1's commits of memory-tier step 2: rank 0's shard was
    held in memory only, and a SIGTERM unlinked it with the pool; rank 1's commit to the new daemon then left step 2
    pending for good (a SIGKILL, or a step due for disk, kept it). Now its shards stay for the next start to adopt."""
    d = make_daemon()
    for rank in (0, 1):
        _commit(d, rank, 1)  # the job's first step: persisted
    with d.rpc() as rpc:
        assert rpc.call("wait", job="j", step=1, timeout=20.0)["state"] == "durable"
    _commit(d, 0, 2)  # memory tier; rank 1 has not committed yet
    assert d.stop() == 0
    assert len(d.segments()) == 1  # rank 0's shard of step 2, with its commit record
    d.start()
    _commit(d, 1, 2)
    with d.rpc() as rpc:
        assert rpc.call("wait", job="j", step=2, timeout=30.0, persist=False)["state"] in ("durable", "memory")
    assert "not every rank had committed it" in d.log.read_text()


def test_status_counts_a_memory_only_step_as_committed_not_yet_durable(make_daemon) -> None:  # noqa: ANN001
    """``status`` and the ``ckptd_staged_bytes`` gauge say what a crash of the node could lose; a memory-only step
    is exactly that, yet they read 0 while one was held."""
    d = make_daemon()
    for rank in (0, 1):
        _commit(d, rank, 1)
    for rank in (0, 1):
        _commit(d, rank, 2)  # memory only
    with d.rpc() as rpc:
        assert rpc.call("wait", job="j", step=2, timeout=20.0, persist=False)["state"] == "memory"
        st = until(lambda: (s := rpc.call("status"))["slots"].get("committed", 0) == 0 and s, what="step 1's slots freed")
    assert st["jobs"]["j"]["memory_only"] == [2]
    assert st["staged_bytes"] == sum(len(shard(2, r, 2)) for r in (0, 1)), (st["slots"], st["staged_bytes"])
