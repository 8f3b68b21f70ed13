"""The local-disk tier (:mod:`ckptd.storage.local`) on real files: staged shards written durably, fragments,
steps finalized atomically, ``latest`` that never moves back, partial-step removal, retention, and a full
disk (``ENOSPC``, injected with :class:`doubles.FaultyDisk`) in every phase of a write."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from _shards import shard_bytes
from doubles import PHASES, FaultyDisk

from ckptd.client.reader import CheckpointReader
from ckptd.errors import CheckpointError, FormatError
from ckptd.format import digest
from ckptd.layout import (
    MANIFEST,
    complete_steps,
    fetch_dir,
    fragment_name,
    fragments_present,
    is_complete,
    latest_file,
    partial_steps,
    shard_name,
    step_dir,
    tmp_dir,
)
from ckptd.storage import local
from ckptd.storage.retention import AnyOf, KeepLatest, Protect
from ckptd.storage.verify import verify_checkpoint

JOB = "job"
WS = 2  # ranks per step unless a test says otherwise


# ---------------------------------------------------------------------------- helpers


def _rank_tensors(rank: int, ws: int, value: float, rows: int) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """``(key, tensor, global_shape, offsets)`` this rank saves: its rows of ``model/w`` and, rank 0 only, ``model/b``."""
    out = [("model/w", torch.full((rows, 3), value + rank, dtype=torch.float32), (rows * ws, 3), (rows * rank, 0))]
    if rank == 0:
        out.append(("model/b", torch.arange(4, dtype=torch.float16) + value, (4,), (0,)))
    return out


def _shard(rank: int, ws: int = WS, value: float = 1.0, rows: int = 2, slack: int = 0) -> tuple[memoryview, int]:
    """A staged shard as a slot holds it (header, then the chunks' bytes, then ``slack`` unused bytes) and its size."""
    buf = shard_bytes(_rank_tensors(rank, ws, value, rows), slack)
    return memoryview(buf), len(buf) - slack


def _write_ranks(root: str, step: int, ws: int = WS, value: float = 1.0) -> None:
    for r in range(ws):
        view, n = _shard(r, ws, value)
        local.write_shard(root, local.ShardWrite(JOB, step, r, ws, view, n, {"rank": r, "value": value}, committed_at=1000 + step))


def _write_step(root: str, step: int, ws: int = WS, value: float = 1.0) -> str:
    """Every rank's shard, then the step finalized; returns the complete step's directory."""
    _write_ranks(root, step, ws, value)
    return local.finalize_step(root, JOB, step, ws)


def _assert_holds(path: str, value: float, ws: int = WS, rows: int = 2) -> None:
    """The complete step at ``path`` verifies and reads back as written with ``value``."""
    assert verify_checkpoint(path) == []
    want_w = torch.cat([torch.full((rows, 3), value + r, dtype=torch.float32) for r in range(ws)])
    with CheckpointReader(path) as reader:
        assert torch.equal(reader.read_full("model/w"), want_w)
        assert torch.equal(reader.read_full("model/b"), torch.arange(4, dtype=torch.float16) + value)


def _make_complete(root: str, step: int) -> None:
    """A bare complete step directory (a manifest, nothing else): enough for the ``latest`` bookkeeping."""
    os.makedirs(step_dir(root, JOB, step))
    Path(step_dir(root, JOB, step), MANIFEST).write_text("{}")


# ---------------------------------------------------------------------------- write_shard / read_fragment


def test_written_step_round_trips(tmp_path: Path) -> None:
    root = str(tmp_path)
    path = _write_step(root, 5, value=3.0)
    assert path == step_dir(root, JOB, 5)
    want = {MANIFEST} | {shard_name(r) for r in range(WS)} | {fragment_name(r) for r in range(WS)}
    assert set(os.listdir(path)) == want
    assert not os.path.exists(tmp_dir(root, JOB, 5))
    _assert_holds(path, 3.0)
    manifest = json.loads(Path(path, MANIFEST).read_text())
    assert (manifest["job"], manifest["step"], manifest["world_size"]) == (JOB, 5, WS)
    assert [r["tree"] for r in manifest["ranks"]] == [{"rank": 0, "value": 3.0}, {"rank": 1, "value": 3.0}]
    assert local.read_latest(root, JOB) == 5
    assert local.latest_step(root, JOB) == (5, path)


@pytest.mark.parametrize("block,piece", [(64, 64), (7, 7), (3 * 4096, 5), (3 * 4096, 1000), (1 << 20, 1 << 20), (1 << 20, 4096)])
def test_shard_file_is_exactly_the_staged_bytes_and_its_checksums_those_of_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int, piece: int
) -> None:
    """Copied block by block, each block read and hashed a piece at a time while in cache: blocks and pieces that
    end inside the header or a chunk, or hold several, must neither drop nor repeat bytes, in the file or in a
    checksum."""
    from ckptd.format import ShardOf, build_fragment, parse_header

    monkeypatch.setattr(local, "COPY_BLOCK", block)
    monkeypatch.setattr(local, "PIECE_BYTES", piece)
    view, n = _shard(0, ws=1, value=7.0, rows=40, slack=1000)  # the slot is longer than the shard
    view[n:] = b"\xee" * (len(view) - n)
    local.write_shard(str(tmp_path), local.ShardWrite(JOB, 1, 0, 1, view, n, {}), local.WritePolicy(rate_limit=1e12))
    on_disk = Path(tmp_path, JOB, "step-1.tmp", shard_name(0)).read_bytes()
    assert len(on_disk) == n and on_disk == bytes(view[:n])
    frag = json.loads(Path(tmp_path, JOB, "step-1.tmp", fragment_name(0)).read_text())
    of = ShardOf(job=JOB, step=1, rank=0, world_size=1, local_world_size=1, replicas={}, tree={})
    want = build_fragment(of, view[:n], parse_header(view, n))  # hashed over the whole buffer
    assert frag["header_xxh3_64"] == want["header_xxh3_64"] and frag["chunks"] == want["chunks"]


def test_a_chunk_named_like_nothing_does_not_take_the_headers_checksum(tmp_path: Path) -> None:
    """A lessee names a chunk "": its checksum is the chunk's, the header's stays the header's."""
    from ckptd.format import build_layout

    data = bytes(range(16))
    layout = build_layout([("", "model/w", torch.uint8, (16,), (16,), (0,))])
    buf = layout.header + data
    local.write_shard(str(tmp_path), local.ShardWrite(JOB, 1, 0, 1, memoryview(buf), len(buf), {}))
    frag = json.loads(Path(tmp_path, JOB, "step-1.tmp", fragment_name(0)).read_text())
    assert frag["header_xxh3_64"] == digest(layout.header) and frag["chunks"][0]["xxh3_64"] == digest(data)


def test_a_segment_truncated_under_the_persist_fails_its_shard_and_leaves_nothing(tmp_path: Path) -> None:
    """The lessee can still truncate its segment (it holds it open for writing): the daemon reads it with
    pread, so a short segment is a clear error for this shard, never a SIGBUS that kills the daemon."""
    view, n = _shard(0, ws=1, value=7.0, rows=400)
    seg = tmp_path / "segment"
    seg.write_bytes(bytes(view[: n // 2]))  # the rest was cut off
    fd = os.open(seg, os.O_RDONLY)
    try:
        with pytest.raises(FormatError, match="its segment was truncated"):
            local.write_shard(str(tmp_path / "root"), local.ShardWrite(JOB, 1, 0, 1, fd, n, {}))
    finally:
        os.close(fd)
    assert os.listdir(tmp_path / "root" / JOB / "step-1.tmp") == []


def test_fragment_describes_its_shard(tmp_path: Path) -> None:
    root = str(tmp_path)
    view, n = _shard(1, ws=4, value=2.0)
    local.write_shard(root, local.ShardWrite(JOB, 9, 1, 4, view, n, {"t": [1, 2]}, replicas={"cid": "ab" * 8}, local_world_size=2))
    frag = local.read_fragment(root, JOB, 9, 1)
    assert frag["kind"] == "ckptd-fragment"
    assert (frag["job"], frag["step"], frag["rank"], frag["world_size"], frag["local_world_size"]) == (JOB, 9, 1, 4, 2)
    assert (frag["file"], frag["size"]) == (shard_name(1), n)
    assert frag["replicas"] == {"cid": "ab" * 8} and frag["tree"] == {"t": [1, 2]}
    data = Path(tmp_dir(root, JOB, 9), shard_name(1)).read_bytes()
    for c in frag["chunks"]:
        b, e = c["byte_range"]
        assert c["xxh3_64"] == digest(data[b:e])
    assert [c["key"] for c in frag["chunks"]] == ["model/w"]
    assert fragments_present(root, JOB, 9) == {1}
    with pytest.raises(FileNotFoundError):
        local.read_fragment(root, JOB, 9, 0)


def test_local_world_size_defaults_to_world_size(tmp_path: Path) -> None:
    view, n = _shard(0)
    local.write_shard(str(tmp_path), local.ShardWrite(JOB, 1, 0, WS, view, n, {}))
    assert local.read_fragment(str(tmp_path), JOB, 1, 0)["local_world_size"] == WS


@pytest.mark.parametrize(
    "delta,match",
    [(64, "header describes"), (-1, "beyond the"), (None, "not valid JSON")],
    ids=["longer", "shorter", "not-a-shard"],
)
def test_write_shard_refuses_a_header_of_another_size(tmp_path: Path, delta: int | None, match: str) -> None:
    view, n = _shard(0, slack=64)
    if delta is None:
        view[:] = bytes(len(view))  # zeros: no header at all
    else:
        n += delta
    with pytest.raises(FormatError, match=match):
        local.write_shard(str(tmp_path), local.ShardWrite(JOB, 1, 0, WS, view, n, {}))
    assert not os.path.exists(tmp_dir(str(tmp_path), JOB, 1)), "nothing may be written for a refused shard"


def test_rewritten_shard_replaces_the_old_one(tmp_path: Path) -> None:
    root = str(tmp_path)
    big, n_big = _shard(0, ws=1, value=1.0, rows=8)
    local.write_shard(root, local.ShardWrite(JOB, 1, 0, 1, big, n_big, {}))
    small, n_small = _shard(0, ws=1, value=4.0, rows=2)
    local.write_shard(root, local.ShardWrite(JOB, 1, 0, 1, small, n_small, {}))
    assert os.path.getsize(os.path.join(tmp_dir(root, JOB, 1), shard_name(0))) == n_small  # truncated, not overlaid
    _assert_holds(local.finalize_step(root, JOB, 1, 1), 4.0, ws=1)


# ---------------------------------------------------------------------------- fragment_sizes


def test_fragment_sizes_reads_the_first_readable_fragment(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert local.fragment_sizes(root, JOB, 3, {0, 1}) == (None, None)  # no step at all
    for r in (0, 1):
        view, n = _shard(r, ws=8)
        local.write_shard(root, local.ShardWrite(JOB, 3, r, 8, view, n, {}, local_world_size=4))
    assert local.fragment_sizes(root, JOB, 3, {0, 1}) == (8, 4)
    assert local.fragment_sizes(root, JOB, 3, set()) == (None, None)
    Path(tmp_dir(root, JOB, 3), fragment_name(0)).write_text("{not json")
    assert local.fragment_sizes(root, JOB, 3, {0, 1}) == (8, 4)  # rank 0 unreadable: rank 1 answers
    assert local.fragment_sizes(root, JOB, 3, {0, 5}) == (None, None)  # rank 5 has none
    frag = json.loads(Path(tmp_dir(root, JOB, 3), fragment_name(1)).read_text())
    del frag["local_world_size"]  # a fragment from before multi-node steps: one node holds every rank
    Path(tmp_dir(root, JOB, 3), fragment_name(1)).write_text(json.dumps(frag))
    assert local.fragment_sizes(root, JOB, 3, {0, 1}) == (8, 8)


# ---------------------------------------------------------------------------- finalize_step / latest


def test_finalize_refuses_to_overwrite_a_complete_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    first = _write_step(root, 1, value=1.0)
    _write_ranks(root, 1, value=2.0)
    with pytest.raises(CheckpointError, match="already exists"):
        local.finalize_step(root, JOB, 1, WS)
    _assert_holds(first, 1.0)  # the complete step is untouched
    assert local.latest_step(root, JOB) == (1, first)


def test_steps_finalized_out_of_order_keep_latest_on_the_newest(tmp_path: Path) -> None:
    root = str(tmp_path)
    _write_ranks(root, 2)
    newer = _write_step(root, 3)
    local.finalize_step(root, JOB, 2, WS)  # an older step completing later must not move latest back
    assert local.read_latest(root, JOB) == 3
    assert local.latest_step(root, JOB) == (3, newer)
    assert complete_steps(root, JOB) == [2, 3]


@pytest.mark.parametrize(
    "current,existing,step,want",
    [
        (None, [], 4, 4),
        ("5", [5], 3, 5),  # never back while the newer step exists
        ("5", [5], 5, 5),
        ("5", [5], 7, 7),
        ("5", [], 3, 3),  # the newer step is gone (removed): latest may name an older one
        ("garbage", [], 3, 3),
    ],
)
def test_update_latest(tmp_path: Path, current: str | None, existing: list[int], step: int, want: int) -> None:
    root = str(tmp_path)
    os.makedirs(os.path.join(root, JOB))
    for s in existing:
        _make_complete(root, s)
    if current is not None:
        Path(latest_file(root, JOB)).write_text(current + "\n")
    local.update_latest(root, JOB, step)
    assert local.read_latest(root, JOB) == want
    assert not os.path.exists(latest_file(root, JOB) + ".tmp")


@pytest.mark.parametrize("content,want", [(None, None), (b"7\n", 7), (b"12", 12), (b"", None), (b"seven\n", None), (b"\xff\xfe", None)])
def test_read_latest(tmp_path: Path, content: bytes | None, want: int | None) -> None:
    os.makedirs(os.path.join(tmp_path, JOB))
    if content is not None:
        Path(latest_file(str(tmp_path), JOB)).write_bytes(content)
    assert local.read_latest(str(tmp_path), JOB) == want


def test_latest_step_falls_back_to_the_highest_complete_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert local.latest_step(root, JOB) == (None, None)  # no job directory
    os.makedirs(os.path.join(root, JOB))
    assert local.latest_step(root, JOB) == (None, None)
    for s in (1, 2, 4):
        _make_complete(root, s)
    os.makedirs(step_dir(root, JOB, 8))  # a step directory without a manifest is not complete
    os.makedirs(tmp_dir(root, JOB, 9))  # nor is a partial step
    assert local.latest_step(root, JOB) == (4, step_dir(root, JOB, 4))  # no latest file
    Path(latest_file(root, JOB)).write_text("2\n")
    assert local.latest_step(root, JOB) == (2, step_dir(root, JOB, 2))  # latest names a complete step: it wins
    for named in ("6", "8", "9", "junk"):  # a missing, incomplete, partial or unreadable step
        Path(latest_file(root, JOB)).write_text(named + "\n")
        assert local.latest_step(root, JOB) == (4, step_dir(root, JOB, 4)), named


# ---------------------------------------------------------------------------- remove_partial


def test_remove_partial_removes_only_that_partial_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    done = _write_step(root, 1)
    _write_ranks(root, 1, value=9.0)  # step-1.tmp beside complete step-1
    _write_ranks(root, 2)
    local.remove_partial(root, JOB, 1)
    assert partial_steps(root, JOB) == [2]
    assert fragments_present(root, JOB, 2) == {0, 1}
    _assert_holds(done, 1.0)
    local.remove_partial(root, JOB, 1)  # already gone: no error
    local.remove_partial(root, "no-such-job", 1)


# ---------------------------------------------------------------------------- apply_retention


def test_retention_keeps_the_latest_n(tmp_path: Path) -> None:
    root = str(tmp_path)
    for s in range(1, 5):
        _write_step(root, s, value=float(s))
    assert local.apply_retention(root, JOB, KeepLatest(2)) == [1, 2]
    assert complete_steps(root, JOB) == [3, 4]
    assert not os.path.exists(step_dir(root, JOB, 1)) and not os.path.exists(step_dir(root, JOB, 2))
    assert local.latest_step(root, JOB) == (4, step_dir(root, JOB, 4))
    _assert_holds(step_dir(root, JOB, 3), 3.0)
    assert local.apply_retention(root, JOB, KeepLatest(2)) == []


def test_retention_of_a_number_whose_earlier_delete_is_unfinished_still_runs(tmp_path: Path) -> None:
    """A ``step-1.del`` still being deleted (an earlier step 1, replaced by a rolled-back run) does not stop
    retention from removing the step 1 there is now."""
    root = str(tmp_path)
    for s in range(1, 4):
        _write_step(root, s, value=float(s))
    os.makedirs(os.path.join(root, JOB, "step-1.del"))
    open(os.path.join(root, JOB, "step-1.del", "rank-00000.safetensors"), "wb").write(b"old")
    assert local.apply_retention(root, JOB, KeepLatest(2)) == [1]
    assert complete_steps(root, JOB) == [2, 3] and not os.path.exists(os.path.join(root, JOB, "step-1.del"))


def test_retention_keeps_a_protected_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    for s in range(1, 5):
        _write_step(root, s, value=float(s))
    assert local.apply_retention(root, JOB, AnyOf((KeepLatest(2), Protect(frozenset({1}))))) == [2]
    assert complete_steps(root, JOB) == [1, 3, 4]
    _assert_holds(step_dir(root, JOB, 1), 1.0)


def test_retention_does_not_touch_partial_steps(tmp_path: Path) -> None:
    root = str(tmp_path)
    for s in (2, 3, 4):
        _write_step(root, s)
    _write_ranks(root, 1)  # older than every complete step
    _write_ranks(root, 9)  # newer
    os.makedirs(fetch_dir(root, JOB, 7))  # a download in progress
    before = {s: sorted(os.listdir(tmp_dir(root, JOB, s))) for s in (1, 9)}
    assert local.apply_retention(root, JOB, AnyOf(())) == [2, 3]  # a policy that keeps nothing but the latest
    assert complete_steps(root, JOB) == [4]
    assert partial_steps(root, JOB) == [1, 9]
    assert {s: sorted(os.listdir(tmp_dir(root, JOB, s))) for s in (1, 9)} == before
    assert os.path.isdir(fetch_dir(root, JOB, 7))
    _assert_holds(local.finalize_step(root, JOB, 9, WS), 1.0)  # the partial step can still complete


# ---------------------------------------------------------------------------- a full disk, phase by phase

# phase -> (what a full disk raises there today, which call raises it)
FAULTS: dict[str, tuple[type[Exception], str]] = {
    "shard": (CheckpointError, "write_shard"),  # caught in write_shard, partial files removed, re-raised
    "fragment": (CheckpointError, "write_shard"),
    "manifest": (OSError, "finalize_step"),  # finalize_step lets the OSError through
    "rename": (OSError, "finalize_step"),
}  # "latest": after the rename the step is complete; finalize_step logs the failure (its own test below)


def _attempt(root: str, step: int, value: float, calls: list[str]) -> str:
    """Write every rank of ``step`` and finalize it, recording each call as it starts."""
    for r in range(WS):
        view, n = _shard(r, WS, value)
        calls.append("write_shard")
        local.write_shard(root, local.ShardWrite(JOB, step, r, WS, view, n, {"rank": r}, committed_at=1000 + step))
    calls.append("finalize_step")
    return local.finalize_step(root, JOB, step, WS)


def _assert_state_after_fault(root: str, phase: str) -> None:
    """What a fault in ``phase`` leaves of step 2 (step 1 was complete before it)."""
    tmp, final = tmp_dir(root, JOB, 2), step_dir(root, JOB, 2)
    shards_and_frags = {shard_name(r) for r in range(WS)} | {fragment_name(r) for r in range(WS)}
    if phase in ("shard", "fragment"):
        assert os.listdir(tmp) == []  # rank 0's partial shard and fragment removed; rank 1 never started
    elif phase == "manifest":
        assert set(os.listdir(tmp)) == shards_and_frags  # every rank durable: finalizing again can complete it
    elif phase == "rename":
        assert set(os.listdir(tmp)) == shards_and_frags | {MANIFEST}  # merged, not renamed: still partial
    assert not os.path.exists(final) and not is_complete(final)
    assert complete_steps(root, JOB) == [1]


@pytest.mark.parametrize("phase", sorted(FAULTS))
def test_full_disk_in_each_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str) -> None:
    root = str(tmp_path)
    first = _write_step(root, 1, value=1.0)
    exc_type, failing_call = FAULTS[phase]
    calls: list[str] = []
    with FaultyDisk(monkeypatch).phase(phase), pytest.raises((CheckpointError, OSError)) as info:
        _attempt(root, 2, 2.0, calls)
    assert isinstance(info.value, exc_type), repr(info.value)
    if exc_type is OSError:
        assert info.value.errno == errno.ENOSPC
    else:
        assert os.strerror(errno.ENOSPC) in str(info.value)
    assert calls[-1] == failing_call
    _assert_state_after_fault(root, phase)
    # the previous step is untouched and still the latest
    _assert_holds(first, 1.0)
    assert local.read_latest(root, JOB) == 1
    assert local.latest_step(root, JOB) == (1, first)
    # the fault clears: the write is retried and succeeds
    path = _attempt(root, 2, 2.0, [])
    assert local.latest_step(root, JOB) == (2, path)
    assert complete_steps(root, JOB) == [1, 2] and partial_steps(root, JOB) == []
    _assert_holds(path, 2.0)
    _assert_holds(first, 1.0)


def test_fault_table_covers_every_phase() -> None:
    assert set(FAULTS) | {"latest"} == set(PHASES)


def test_a_full_disk_updating_latest_does_not_fail_the_complete_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step was renamed into place: it is complete and durable. Reporting it failed (as before) would
    make the trainer retry a step that exists; instead latest_step() finds it by its manifest."""
    root = str(tmp_path)
    _write_step(root, 1, value=1.0)
    with FaultyDisk(monkeypatch).phase("latest"):
        path = _attempt(root, 2, 2.0, [])
    assert local.read_latest(root, JOB) == 1  # the file could not be moved...
    assert local.latest_step(root, JOB) == (2, path)  # ...the step committed last is still the latest
    assert complete_steps(root, JOB) == [1, 2] and not os.path.exists(latest_file(root, JOB) + ".tmp")
    _assert_holds(path, 2.0)


def test_latest_follows_commit_order_not_step_numbers(tmp_path: Path) -> None:
    """A rollback: steps 100, 200, 300 committed, then 110 and 120 after a restore of 100."""
    root = str(tmp_path)
    for at, step in enumerate((100, 200, 300, 110, 120)):
        for r in range(WS):
            view, n = _shard(r, WS, float(step))
            local.write_shard(root, local.ShardWrite(JOB, step, r, WS, view, n, {"rank": r}, committed_at=10 + at))
        local.finalize_step(root, JOB, step, WS)
        assert local.latest_step(root, JOB)[0] == step and local.read_latest(root, JOB) == step
    assert local.steps_by_commit(root, JOB) == [100, 200, 300, 110, 120]
    assert local.apply_retention(root, JOB, KeepLatest(3)) == [100, 200]  # the oldest commits, not the lowest numbers
    assert complete_steps(root, JOB) == [110, 120, 300]
    os.unlink(latest_file(root, JOB))  # even without the file: the manifests order the steps
    assert local.latest_step(root, JOB) == (120, step_dir(root, JOB, 120))


def test_an_older_commit_completing_later_does_not_move_latest(tmp_path: Path) -> None:
    root = str(tmp_path)
    for step, at in ((11, 2), (10, 1)):  # 10 was committed first, 11 completed first
        for r in range(WS):
            view, n = _shard(r, WS)
            local.write_shard(root, local.ShardWrite(JOB, step, r, WS, view, n, {"rank": r}, committed_at=at))
    local.finalize_step(root, JOB, 11, WS)
    local.finalize_step(root, JOB, 10, WS)
    assert local.read_latest(root, JOB) == 11 and local.latest_step(root, JOB)[0] == 11


def test_retention_never_removes_the_latest_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    for step in (1, 2, 3):
        _write_step(root, step)
    Path(latest_file(root, JOB)).write_text("3\n")
    assert local.apply_retention(root, JOB, AnyOf(())) == [1, 2]
    assert complete_steps(root, JOB) == [3]


def test_a_crash_mid_retention_never_leaves_a_half_deleted_step_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention renames the step out of the committed namespace first; the daemon dies during the
    delete (here: rmtree raises); ls/latest never see step 1, and the restart finishes deleting it."""
    root = str(tmp_path)
    for step in (1, 2):
        _write_step(root, step)

    def crash(path: str, ignore_errors: bool = False) -> None:
        os.unlink(os.path.join(path, shard_name(0)))  # half deleted
        raise SystemExit("killed")

    monkeypatch.setattr(local.shutil, "rmtree", crash)
    with pytest.raises(SystemExit):
        local.apply_retention(root, JOB, KeepLatest(1))
    monkeypatch.undo()
    assert complete_steps(root, JOB) == [2] and local.latest_step(root, JOB)[0] == 2
    assert local.empty_trash(root, JOB) == [1]
    assert sorted(os.listdir(os.path.join(root, JOB))) == ["latest", "step-2"]


def test_a_failed_durable_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd import files

    def full(fd: int, data: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "write_all", full)
    target = tmp_path / "manifest.json"
    with pytest.raises(OSError):
        files.write_durable(str(target), b"{}")
    assert os.listdir(tmp_path) == []  # no manifest.json.tmp a later rename could pick up
