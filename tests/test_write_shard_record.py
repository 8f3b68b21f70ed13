"""The records :func:`ckptd.storage.local.write_shard` takes (:class:`~ckptd.storage.local.ShardWrite`, what to write
and what its fragment records; :class:`~ckptd.storage.local.WritePolicy`, how): frozen, checked once when built, and
written exactly as the fields say, from a commit record through the persist thread as from a test's buffer."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _shards import shard_bytes

from ckptd.client.reader import CheckpointReader
from ckptd.daemon import persister
from ckptd.daemon.slot import Slot
from ckptd.errors import DiskFull
from ckptd.format import ShardOf, build_fragment, parse_header
from ckptd.layout import fragment_name, shard_name, step_dir, tmp_dir
from ckptd.protocol import CommitRecord
from ckptd.storage import local
from ckptd.storage.local import ShardWrite, WritePolicy
from ckptd.storage.verify import verify_checkpoint

JOB = "job"
W = torch.arange(24, dtype=torch.float32).reshape(4, 6)
B = torch.arange(5, dtype=torch.bfloat16)


def _staged() -> bytearray:
    return shard_bytes([("model/w", W, (4, 6), (0, 0)), ("model/b", B, (5,), (0,))])


def _committed(tmp_path: Path, **fields: Any) -> tuple[CommitRecord, str]:
    """A commit record of step 3 as the daemon keeps it beside a committed segment (the tree still the raw frame), and
    the segment holding the staged shard."""
    buf = _staged()
    segment = tmp_path / "segment"
    segment.write_bytes(bytes(buf))
    rec = {"job": JOB, "step": 3, "rank": 0, "world_size": 1, "local_world_size": 1, "nbytes": len(buf), "replicas": {}, "tree": b"{}"}
    return CommitRecord(**rec | {"committed_at": 0, "run": None, "after": None} | fields), str(segment)


class _Events:
    def __init__(self) -> None:
        self.posted: list[Any] = []

    def post(self, event: Any) -> None:
        self.posted.append(event)


def _persist(root: str, rec: CommitRecord, segment: str, **patches: Any) -> Any:
    """Run one persist thread's job on ``rec`` (the persister's methods ``patches`` replaced); the event it posts."""
    events = _Events()
    open_segment = lambda name: os.open(segment, os.O_RDONLY)  # noqa: E731
    options = persister.PersistOptions(1, 2, local.WritePolicy(1e12))
    p = persister.Persister(root, events, options, open_segment=open_segment)  # type: ignore[arg-type]
    for name, fn in patches.items():
        setattr(p, name, fn)
    try:
        p._run(Slot("seg", rec.nbytes, record=rec), rec, attempt=1)
    finally:
        p.shutdown()
    (event,) = events.posted
    return event


# ---------------------------------------------------------------------------- the records


def test_the_records_are_frozen_and_a_changed_copy_is_checked_again() -> None:
    buf = _staged()
    shard = ShardWrite(JOB, 1, 0, 2, memoryview(buf), len(buf), {"a": 1}, committed_at=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.rank = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        WritePolicy().direct_io = False  # type: ignore[misc]
    assert dataclasses.replace(shard, rank=1).rank == 1 and shard.rank == 0
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        dataclasses.replace(shard, rank=2)


def test_the_optional_fields_are_keyword_only() -> None:
    """The call the records replaced passed 14 arguments by position: past the shard itself, every field is named."""
    with pytest.raises(TypeError):
        ShardWrite(JOB, 1, 0, 1, b"", 0, {}, 1)  # type: ignore[misc]
    assert ShardWrite(JOB, 1, 0, 1, b"", 0, {}).replicas == {}  # a fresh dict for each record


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"rank": 1, "world_size": 1}, "rank 1 is outside world_size 1"),
        ({"rank": -1}, "rank -1 is outside world_size 4"),
        ({"rank": 0, "world_size": 0}, "rank 0 is outside world_size 0"),
        ({"local_world_size": 5}, r"local_world_size 5 is not within 1\.\.world_size \(4\)"),
        ({"local_world_size": 0}, r"local_world_size 0 is not within 1\.\.world_size \(4\)"),
        ({"step": -1}, r"never negative \(step -1, 64 bytes\)"),
        ({"nbytes": -64}, r"never negative \(step 1, -64 bytes\)"),
    ],
)
def test_an_impossible_shard_is_refused_when_its_record_is_built(fields: dict[str, Any], match: str) -> None:
    args = {"job": JOB, "step": 1, "rank": 0, "world_size": 4, "source": b"", "nbytes": 64, "tree": {}} | fields
    with pytest.raises(ValueError, match=match):
        ShardWrite(**args)


def test_replicas_must_be_a_dict_not_none() -> None:
    """``None`` meant "no replicas" to the old signature; written, it would be a fragment no reader takes."""
    with pytest.raises(TypeError, match="replicas must be a dict"):
        ShardWrite(JOB, 1, 0, 1, b"", 0, {}, replicas=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("rate", [-1.0, float("nan")])
def test_a_write_policy_refuses_a_rate_that_is_no_rate(rate: float) -> None:
    with pytest.raises(ValueError, match="bytes per second >= 0"):
        WritePolicy(rate_limit=rate)


# ---------------------------------------------------------------------------- written as the fields say


def test_a_shard_written_through_its_record_reads_back_bit_exact_with_its_checksums(tmp_path: Path) -> None:
    """From a segment's file descriptor, as the daemon writes it: the shard file is the staged bytes, the fragment is
    exactly :func:`ckptd.format.build_fragment` of the record's fields (the on-disk format), and the step verifies."""
    root, buf = str(tmp_path / "root"), _staged()
    segment = tmp_path / "segment"
    segment.write_bytes(bytes(buf) + b"\xee" * 100)  # a slot is longer than its shard
    fd = os.open(segment, os.O_RDONLY)
    try:
        shard = ShardWrite(JOB, 3, 0, 1, fd, len(buf), {"epoch": 2}, replicas={"cid": "ab" * 8}, committed_at=77, run=9, after=2)
        local.write_shard(root, shard, WritePolicy(rate_limit=1e12, direct_io=False))
    finally:
        os.close(fd)
    d = tmp_dir(root, JOB, 3)
    assert Path(d, shard_name(0)).read_bytes() == bytes(buf)
    frag = json.loads(Path(d, fragment_name(0)).read_text())
    layout = parse_header(buf, len(buf))
    of = ShardOf(
        job=JOB, step=3, rank=0, world_size=1, local_world_size=1, replicas={"cid": "ab" * 8}, tree={"epoch": 2}, committed_at=77,
        run=9, after=2,
    )  # fmt: skip
    assert frag == build_fragment(of, bytes(buf), layout)
    path = local.finalize_step(root, JOB, 3, 1)
    assert verify_checkpoint(path) == []
    with CheckpointReader(path) as reader:
        assert torch.equal(reader.read_full("model/w"), W) and torch.equal(reader.read_full("model/b"), B)


def test_local_world_size_defaults_to_the_whole_world_and_a_multi_node_one_is_recorded(tmp_path: Path) -> None:
    root = str(tmp_path)
    for rank, lws in ((0, None), (1, 2)):
        buf = _staged()
        local.write_shard(root, ShardWrite(JOB, 1, rank, 4, memoryview(buf), len(buf), {}, local_world_size=lws))
    frags = [json.loads(Path(tmp_dir(root, JOB, 1), fragment_name(r)).read_text()) for r in (0, 1)]
    assert [f["local_world_size"] for f in frags] == [4, 2]
    assert ["run" in f for f in frags] == [False, False]  # no run: no attempt recorded, as before


# ---------------------------------------------------------------------------- the persist thread builds it once


def test_the_persist_thread_builds_one_record_from_the_commit_and_writes_it_again_after_making_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "root")
    rec, segment = _committed(tmp_path, committed_at=41, run=3, tree=json.dumps({"epoch": 1}).encode())
    calls: list[tuple[ShardWrite, WritePolicy]] = []
    real = local.write_shard

    def write_shard(root_: str, shard: ShardWrite, policy: WritePolicy) -> None:
        calls.append((shard, policy))
        if len(calls) == 1:
            raise DiskFull("writing it failed: No space left on device")
        real(root_, shard, policy)

    monkeypatch.setattr(local, "write_shard", write_shard)
    event = _persist(root, rec, segment, _make_room=lambda job, step: True)
    assert event.error is None and event.path == step_dir(root, JOB, 3)
    (first, policy), (again, _) = calls
    assert again is first and policy == WritePolicy(rate_limit=1e12, direct_io=True)
    assert (first.tree, first.committed_at, first.run, first.after, first.local_world_size) == ({"epoch": 1}, 41, 3, None, 1)
    assert verify_checkpoint(event.path) == []


def test_a_commit_record_with_a_bad_tree_fails_its_shard_before_anything_is_written(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    rec, segment = _committed(tmp_path, tree=b"[1, 2]")
    event = _persist(root, rec, segment)
    assert "not a JSON object" in event.error and event.path is None
    assert not os.path.exists(tmp_dir(root, JOB, 3))
