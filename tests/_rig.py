"""The daemon's persist path wired by hand, without its socket: the rig the completion and recovery
tests drive (SlotPool, StepTable, StepCatalog, Persister, Completion, EventQueue, as
``ckptd.daemon.server`` wires them), and the shards and commit records they feed it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq
from _shards import shard_bytes

from ckptd import shm
from ckptd.daemon.books import Books
from ckptd.daemon.catalog import StepCatalog
from ckptd.daemon.completion import Completion
from ckptd.daemon.events import EventQueue, ShardPersisted
from ckptd.daemon.persister import Persister, PersistOptions
from ckptd.daemon.slots import Slot, SlotPool
from ckptd.daemon.status import Counters
from ckptd.daemon.steps import StepTable, StepTrack
from ckptd.daemon.waiters import Waiter
from ckptd.protocol import CommitRecord
from ckptd.storage.retention import Protect, RetentionPolicy

MiB = 1 << 20
JOB = "j"
TIMEOUT_S = 30.0  # generous: a worker thread writes a few KiB


# ---------------------------------------------------------------------------- shards


def rank_tensors(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state at ``step``: a row block of a shared weight and a per-rank counter."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"model/w": torch.randn(4, 3, generator=g), f"extra/{rank}/n": torch.arange(5, dtype=torch.int64) + 10 * step + rank}


def shard(step: int, rank: int, world_size: int, *, row: int | None = None) -> bytes:
    """A real shard file; ``row`` places the weight block (default: the rank's own rows)."""
    ts = rank_tensors(step, rank)
    row = rank if row is None else row
    n = ts[f"extra/{rank}/n"]
    return bytes(shard_bytes([("model/w", ts["model/w"], (4 * world_size, 3), (4 * row, 0)), (f"extra/{rank}/n", n, tuple(n.shape), (0,))]))


def tree(rank: int) -> bytes:
    return json.dumps({"model": {"w": {"__ckptd__": "tensor", "key": "model/w"}}, "rank": rank}).encode()


# ---------------------------------------------------------------------------- the rig


class FakeUploader:
    """Records what Completion and the Persister's ``protect`` ask of an uploader; uploads nothing."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, int, int, list[int] | None]] = []
        self.nodes: list[tuple[str, int]] = []  # multi-node: (this node's part's directory, attempt) of each submit
        self.given_up: list[tuple[str, int, int]] = []

    def submit(self, job: str, step: int, world_size: int, ranks: list[int] | None = None, **kw: Any) -> None:
        self.submitted.append((job, step, world_size, ranks))
        if kw.get("node"):  # multi-node: where this node's part is, and its attempt
            self.nodes.append((kw["node"], kw.get("attempt", 0)))

    def give_up(self, job: str, step: int, attempt: int) -> None:
        self.given_up.append((job, step, attempt))

    def pending(self, job: str) -> set[int]:
        return set()


class Rig:
    """SlotPool, StepTable, StepCatalog, Persister, Completion and EventQueue, wired as the server does."""

    def __init__(
        self,
        root: str,
        *,
        workers: int = 2,
        keep: int = 0,
        protect: Callable[[str], RetentionPolicy] = lambda job: Protect(frozenset()),
        uploader: FakeUploader | None = None,
    ) -> None:
        self.root = root
        self.ctx = zmq.Context()
        self.events = EventQueue(self.ctx)
        self.counters = Counters()
        self.pool = SlotPool(shm.SegmentDir(root), 64 * MiB)
        self.catalog = StepCatalog(root)
        self.steps = StepTable(self.catalog.complete_path)
        options = PersistOptions(workers, keep, uploads=uploader is not None)
        self.persister = Persister(root, self.events, options, protect=protect)
        self.uploader = uploader
        self.answers: list[tuple[Waiter, dict[str, Any]]] = []
        books = Books(root, self.steps, self.catalog, self.counters, self.events, self.answers.extend)  # type: ignore[arg-type]
        self.completion = Completion(books, self.persister, uploader, self.pool)

    def commit(
        self,
        step: int,
        rank: int,
        world_size: int,
        data: bytes,
        *,
        lws: int | None = None,
        raw_tree: bytes | None = None,
        at: int | None = None,
        track: StepTrack | None = None,
        run: int | None = None,
        after: int | None = None,
    ) -> Slot:
        """Lease a slot, fill it with ``data`` and commit it as ``Commits.commit`` (ckptd/daemon/commits.py) does (``at``: its
        ``committed_at``, default :func:`record`'s; ``track``: the one ``Admission.admit`` returned; ``run`` and
        ``after``: the attempt, a launch and the step it restored)."""
        lws = world_size if lws is None else lws
        slot = self.pool.lease({"job": JOB, "rank": rank, "world_size": world_size, "step": step, "nbytes": len(data), "pid": os.getpid()})
        assert slot is not None
        with open(shm.path_of(slot.name), "r+b") as f:
            f.write(data)
        fields = {**record(step, rank, world_size, len(data), lws, at, 7 if run is None else run), "after": after}
        rec = CommitRecord(**fields, tree=tree(rank) if raw_tree is None else raw_tree)
        self.pool.segments.write_record(slot.name, rec)
        self.pool.commit(slot, rec)
        key = (JOB, step)
        track = track or self.steps.check_commit(key, rank, world_size, lws)
        self.steps.record_commit(key, track, rank, lws, run, committed_at=rec.committed_at)
        self.completion.persist(slot)
        return slot

    def collect(self, n: int) -> list[ShardPersisted]:
        """Wait for ``n`` events from the persist threads without handling them."""
        out: list[ShardPersisted] = []
        deadline = time.monotonic() + TIMEOUT_S
        while len(out) < n:
            left = deadline - time.monotonic()
            assert left > 0, f"only {len(out)} of {n} ShardPersisted events within {TIMEOUT_S} s: {out}"
            if self.events.wake.poll(int(min(left, 0.5) * 1000)):
                for ev in self.events.drain():
                    assert isinstance(ev, ShardPersisted)
                    out.append(ev)
        assert len(out) == n, f"more events than shards: {out}"
        return out

    def handle(self, ev: ShardPersisted) -> None:
        """What the daemon's loop does with one event."""
        self.completion.on_persisted(ev)

    def pump(self, n: int) -> list[ShardPersisted]:
        """Wait for ``n`` events and handle each as the daemon's loop does."""
        evs = self.collect(n)
        for ev in evs:
            self.handle(ev)
        return evs

    def wait(self, step: int, ident: bytes = b"w", req_id: int = 1) -> dict[str, Any] | None:
        return self.steps.wait((JOB, step), ident, req_id, time.monotonic() + 3600)

    def answered(self, step: int) -> list[dict[str, Any]]:
        return [fields for w, fields in self.answers if w.ident == f"w{step}".encode()]

    def close(self) -> None:
        try:
            self.persister.shutdown()
        finally:
            self.events.close()
            self.ctx.term()


def record(
    step: int, rank: int, world_size: int, nbytes: int, lws: int | None = None, at: int | None = None, run: int | None = 7
) -> dict[str, Any]:
    """A commit record's fields as ``Commits.commit`` (ckptd/daemon/commits.py) writes them (its JSON line: the tree follows)."""
    lws = world_size if lws is None else lws
    return {
        "job": JOB, "rank": rank, "world_size": world_size, "local_world_size": lws, "step": step, "nbytes": nbytes, "replicas": {},
        "committed_at": 1_000_000 + step if at is None else at,  # commit order follows the step here, unless told
        "run": run, "after": None,  # the attempt: one launch that restored nothing, unless told
    }  # fmt: skip


def old_record(fields: dict[str, Any], tree: bytes = b"{}") -> bytes:
    """The bytes of a commit record as daemons before typed records wrote ``fields`` (``shm.SegmentDir.write_record``
    then took a dict): one compact JSON line, then the raw tree. What a daemon after an upgrade finds and adopts."""
    return json.dumps(fields, separators=(",", ":")).encode() + b"\n" + tree


def tear_down(rigs: list[Rig], root: str) -> None:
    """Close every rig, then unlink every segment of ``root``'s namespace, even when closing fails."""
    try:
        for rig in rigs:
            rig.close()
    finally:
        shm.purge(root)
