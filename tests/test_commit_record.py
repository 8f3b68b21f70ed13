"""The commit record (:class:`ckptd.protocol.CommitRecord`): frozen, built at its two edges only (a validated ``commit``
request in :class:`ckptd.daemon.commits.Commits`; a record read back after a crash, by
:func:`ckptd.protocol.validate_record`), kept by a committed slot apart from its lease, and written beside the segment
byte for byte as daemons wrote it when it was a dict (a daemon after an upgrade adopts what the one before left).

Real /dev/shm segments (each test's own namespace, purged afterwards), no socket, no persist thread."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd import shm
from ckptd.daemon import recovery
from ckptd.daemon.books import Books
from ckptd.daemon.catalog import CommitClock, StepCatalog
from ckptd.daemon.commits import Commits
from ckptd.daemon.slots import Slot, SlotPool, SlotState
from ckptd.daemon.steps import StepTable, StepTrack
from ckptd.errors import ProtocolError
from ckptd.protocol import RECORD_SCHEMA, CommitRecord, decode_request, request, validate_record

JOB = "rec"
TREE = b'{"step": 7, "note": "caf\\u00e9", "x": [1, 2.5, null]}'  # kept as the trainer sent it, spacing and escapes too
REPLICAS = {"model/w|0,0": "0123456789abcdef", "model/\u00e9|4": "fedcba9876543210"}
# the JSON line as a daemon writing a dict wrote it, for the fields below: the format a new daemon must keep
OLD_LINE = (
    b'{"job":"rec","rank":1,"world_size":2,"local_world_size":2,"step":7,"nbytes":4096,'
    b'"replicas":{"model/w|0,0":"0123456789abcdef","model/\\u00e9|4":"fedcba9876543210"},'
    b'"committed_at":1700000000000000000,"run":12,"after":3}'
)


def _fields(**changes: Any) -> dict[str, Any]:
    """A commit record's fields, in the order the JSON line has them."""
    fields = {"job": JOB, "rank": 1, "world_size": 2, "local_world_size": 2, "step": 7, "nbytes": 4096, "replicas": dict(REPLICAS)}
    return fields | {"committed_at": 1_700_000_000_000_000_000, "run": 12, "after": 3} | changes


def _old_bytes(fields: dict[str, Any], tree: bytes = TREE) -> bytes:
    """A record file as a daemon before typed records wrote it (``write_record(name, record_dict, tree=tree)``)."""
    return json.dumps(fields, separators=(",", ":")).encode() + b"\n" + tree


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[SlotPool]:
    p = SlotPool(shm.SegmentDir(str(tmp_path)), 64 << 20)
    try:
        yield p
    finally:
        shm.purge(str(tmp_path))


def _segment(pool: SlotPool, raw_record: bytes | None = None, size: int = 4096) -> str:
    """A segment of the pool's directory, as a daemon that died left it: with the record file ``raw_record``."""
    name, _ = pool.segments.create(size)
    if raw_record is not None:
        with open(os.open(shm.path_of(name) + shm.RECORD_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_EXCL, shm.RECORD_MODE), "wb") as f:
            f.write(raw_record)
    return name


def _record_file(name: str) -> bytes:
    with open(shm.path_of(name) + shm.RECORD_SUFFIX, "rb") as f:
        return f.read()


# ---------------------------------------------------------------------------- the record


def test_a_record_is_frozen_keyword_only_and_its_line_is_the_schema() -> None:
    rec = validate_record(_fields(), TREE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.step = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        CommitRecord(*_fields().values(), TREE)  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(CommitRecord)] == [*RECORD_SCHEMA, "tree"]
    assert list(rec.fields()) == list(RECORD_SCHEMA) and rec.fields() == _fields()
    assert TREE not in repr(rec).encode() and "step 7 rank 1/2" in repr(rec)  # a tree may be megabytes: never logged


def test_an_old_record_without_its_attempt_is_read_back_as_none() -> None:
    """Records written before they named their attempt (``run``, ``after``) are still taken, as before."""
    old = {k: v for k, v in _fields().items() if k not in ("run", "after")}
    rec = validate_record(json.loads(_old_bytes(old).partition(b"\n")[0]), TREE)
    assert (rec.run, rec.after, rec.tree) == (None, None, TREE)
    assert rec == validate_record(_fields(run=None, after=None), TREE)
    assert old == {k: v for k, v in _fields().items() if k not in ("run", "after")}  # the caller's dict is left alone


@pytest.mark.parametrize(
    "change,message",
    [
        ({"job": "../escape"}, "invalid job name"),
        ({"rank": 2}, "rank 2 outside world_size 2"),
        ({"local_world_size": 3}, "local_world_size 3 is not within"),
        ({"nbytes": -1}, "'nbytes' = -1 is outside"),
        ({"step": "7"}, "'step' has the wrong type"),
        ({"replicas": {"c": "not a digest"}}, "16-digit digests"),
        ({"committed_at": True}, "'committed_at' has the wrong type"),
        ({"tree": {}}, r"unknown fields \['tree'\]"),
        ({"world_size": None}, "'world_size' has the wrong type"),
    ],
)
def test_a_malformed_record_read_back_is_refused_naming_its_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        validate_record(_fields(**change), TREE)


def test_a_record_missing_a_field_or_not_an_object_is_refused() -> None:
    with pytest.raises(ProtocolError, match="missing field 'committed_at'"):
        validate_record({k: v for k, v in _fields().items() if k != "committed_at"}, TREE)
    with pytest.raises(ProtocolError, match="not a JSON object"):
        validate_record([1, 2], TREE)


# ---------------------------------------------------------------------------- the file beside the segment


def test_write_record_writes_the_old_format_byte_for_byte_and_reads_back_identical(pool: SlotPool) -> None:
    rec = validate_record(_fields(), TREE)
    name = _segment(pool)
    pool.segments.write_record(name, rec)
    assert _record_file(name) == OLD_LINE + b"\n" + TREE == _old_bytes(_fields())
    got = pool.segments.read_record(name)
    assert got is not None and validate_record(*got) == rec
    assert validate_record(*got).tree == TREE and validate_record(*got).replicas == REPLICAS


def test_a_record_an_old_daemon_wrote_is_adopted_after_an_upgrade(pool: SlotPool, tmp_path: Path) -> None:
    steps = StepTable(StepCatalog(str(tmp_path)).complete_path)
    old = {k: v for k, v in _fields().items() if k not in ("run", "after")}
    name = _segment(pool, _old_bytes(old))
    recovery.adopt_segments(pool, steps, str(tmp_path))
    slot = pool.get(name)
    assert slot is not None and slot.state is SlotState.COMMITTED and slot.owner == (JOB, 1)
    assert slot.record == validate_record(old, TREE) and slot.lease is None and slot.tree_bytes == len(TREE)
    track = steps.get((JOB, 7))
    assert track is not None and track.committed == {1} and (track.world_size, track.local_world_size) == (2, 2)
    assert track.committed_at == old["committed_at"] and track.run is None
    assert pool.summary()["staged_bytes"] == 4096


@pytest.mark.parametrize(
    "raw",
    [
        _old_bytes(_fields(rank=5)),
        _old_bytes(_fields(job="../../etc")),
        _old_bytes({**_fields(), "extra": 1}),
        _old_bytes({k: v for k, v in _fields().items() if k != "nbytes"}),
        _old_bytes(_fields(nbytes=1 << 30)),  # more than the segment holds
    ],
)
def test_a_malformed_record_is_never_adopted(pool: SlotPool, tmp_path: Path, raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    steps = StepTable(StepCatalog(str(tmp_path)).complete_path)
    name = _segment(pool, raw)
    recovery.adopt_segments(pool, steps, str(tmp_path))
    assert pool.get(name) is None and steps.tracks == {}
    assert not os.path.exists(shm.path_of(name)) and not os.path.exists(shm.path_of(name) + shm.RECORD_SUFFIX)
    assert f"ignoring segment {name}: " in caplog.text


def test_the_commit_clock_stamps_after_an_adopted_record(pool: SlotPool, tmp_path: Path) -> None:
    """After a restart a job's commits are stamped later than every record adopted (clock skew or not)."""
    catalog = StepCatalog(str(tmp_path))
    ahead = time.time_ns() + 3600 * 10**9
    _segment(pool, _old_bytes(_fields(committed_at=ahead)))
    recovery.adopt_segments(pool, StepTable(catalog.complete_path), str(tmp_path))
    clock = CommitClock(catalog, pool)
    assert clock.stamp(JOB) == ahead + 1 and clock.stamp("other") < ahead


# ---------------------------------------------------------------------------- the wire edge


class _Admission:
    def __init__(self) -> None:
        self.tracks: dict[tuple[str, int], StepTrack] = {}

    def admit(self, job: str, step: int, rank: int, ws: int, lws: int, peer: Any, after: Any, run: Any = None) -> StepTrack:
        return self.tracks.setdefault((job, step), StepTrack(ws, lws))

    def committed(self, *args: Any) -> None:
        pass


class _Tier:
    def __init__(self) -> None:
        self.sealed: list[Slot] = []

    def set_job(self, *args: Any) -> None:
        pass

    def decide(self, *args: Any, **kw: Any) -> None:
        pass

    def seal(self, slot: Slot) -> None:
        self.sealed.append(slot)


class _Completion:
    def __init__(self) -> None:
        self.persisted: list[Slot] = []

    def persist(self, slot: Slot) -> None:
        self.persisted.append(slot)


def _commits(pool: SlotPool, root: str) -> tuple[Commits, _Tier, _Completion]:
    catalog = StepCatalog(root)
    memory, completion = _Tier(), _Completion()
    steps = StepTable(catalog.complete_path)
    books = Books(root, steps, catalog, None, None, None)  # type: ignore[arg-type]  # what Commits reads of it: root, steps, catalog
    commits = Commits(books, pool, CommitClock(catalog, pool), _Admission(), _Tier(), memory, completion)  # type: ignore[arg-type]
    return commits, memory, completion


def _commit_request(slot: Slot, **fields: Any) -> dict[str, Any]:
    """A ``commit`` of ``slot`` as the server hands it to :meth:`Commits.commit`: decoded, checked, its tree frame added."""
    wire = {k: v for k, v in _fields().items() if k != "committed_at"} | {"segment": slot.name, "lease": slot.token} | fields
    msg = decode_request(request("commit", 3, **wire))
    msg["frames"], msg["peer"], msg["uid"] = [TREE], None, None
    return msg


def test_a_commit_request_makes_the_record_and_the_slot_keeps_it_apart_from_its_lease(pool: SlotPool, tmp_path: Path) -> None:
    commits, memory, completion = _commits(pool, str(tmp_path))
    slot = pool.lease({"job": JOB, "rank": 1, "world_size": 2, "step": None, "nbytes": 4096, "pid": os.getpid()})
    assert slot is not None and slot.lease == {"job": JOB, "rank": 1, "world_size": 2, "step": None} and slot.record is None
    before = time.time_ns()
    commits.commit(_commit_request(slot))
    rec = slot.record
    assert rec is not None and slot.state is SlotState.COMMITTED and slot.lease is None and slot.token is None
    assert rec.fields() == _fields(committed_at=rec.committed_at) and rec.committed_at >= before and rec.tree == TREE
    assert slot.tree_bytes == len(TREE) and pool.summary()["staged_bytes"] == 4096
    assert completion.persisted == [slot] and memory.sealed == [slot] and slot.committed() is rec
    # beside the segment, exactly what a daemon writing a dict wrote for these fields
    assert _record_file(slot.name) == _old_bytes(_fields(committed_at=rec.committed_at))
    got = pool.segments.read_record(slot.name)
    assert got is not None and validate_record(*got) == rec
    pool.persisted(slot, (JOB, 7, 1))
    assert (slot.state, slot.lease, slot.record, slot.tree_bytes) == (SlotState.FREE, None, None, 0)
    with pytest.raises(LookupError, match="holds no committed shard"):
        slot.committed()


def test_a_commit_that_does_not_match_its_lease_leaves_the_slot_leased_and_recordless(pool: SlotPool, tmp_path: Path) -> None:
    commits, _, completion = _commits(pool, str(tmp_path))
    slot = pool.lease({"job": JOB, "rank": 1, "world_size": 2, "step": 7, "nbytes": 4096, "pid": os.getpid()})
    assert slot is not None
    for wrong in ({"rank": 0}, {"step": 8}, {"world_size": 4}):
        with pytest.raises(ProtocolError, match="does not match the lease"):
            commits.commit(_commit_request(slot, **wrong))
    assert slot.state is SlotState.LEASED and slot.lease == {"job": JOB, "rank": 1, "world_size": 2, "step": 7}
    assert slot.record is None and pool.segments.read_record(slot.name) is None and completion.persisted == []
