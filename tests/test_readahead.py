"""Restores from disk read the saved chunks on a thread, ahead of the verify-and-copy
(:mod:`ckptd.client.readahead`): adjacent chunks in one read, only the chunks a rank takes, the same
bytes as the plain path; a corrupt or truncated file is a ``FormatError`` and the thread never outlives
the restore."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _shards import shard_bytes

import ckptd.client.readahead as readahead
from ckptd.client.reader import CheckpointReader
from ckptd.errors import FormatError
from ckptd.layout import shard_name
from ckptd.state import TAG
from ckptd.storage import local

JOB = "ra"
WS = 2
ROWS = 8  # rows of every tensor; rank r saved rows [4r, 4r + 4)


def _tensors() -> dict[str, torch.Tensor]:
    """Many small tensors (one read holds many) and one large one (a run of its own)."""
    g = torch.Generator().manual_seed(0)
    out = {f"model/small{i}": torch.randn(ROWS, 16, generator=g) for i in range(300)}
    out["model/big"] = torch.randn(ROWS, (readahead.RUN_BYTES // 4) // ROWS + 1000, generator=g)
    return out


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    root = str(tmp_path_factory.mktemp("ra"))
    full = _tensors()
    half = ROWS // WS
    for r in range(WS):
        chunks = [(k, t[half * r : half * (r + 1)].clone(), tuple(t.shape), (half * r, 0)) for k, t in full.items()]
        buf = shard_bytes(chunks)
        tree = {"model": {k.split("/", 1)[1]: {TAG: "tensor", "key": k} for k in full}}
        local.write_shard(root, local.ShardWrite(JOB, 1, r, WS, memoryview(buf), len(buf), tree, local_world_size=WS, committed_at=7))
    return local.finalize_step(root, JOB, 1, WS), full


class Counting(CheckpointReader):
    """Counts the reads of each shard file (the read-ahead thread's and the plain path's)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.reads: list[tuple[int, int, int]] = []  # (fd, offset, bytes)
        self._lock = threading.Lock()

    def _pread(self, fd: int, into: torch.Tensor, offset: int) -> int:
        with self._lock:
            self.reads.append((fd, offset, into.numel()))
        return super()._pread(fd, into, offset)


def _read(reader: CheckpointReader, full: dict[str, torch.Tensor], rows: tuple[int, int]) -> dict[str, torch.Tensor]:
    out = {k: torch.empty(rows[1] - rows[0], t.shape[1], dtype=t.dtype) for k, t in full.items()}
    pieces = [p for k, t in out.items() for p in reader.pieces(k, t, (rows[0], 0))]
    reader.read_many(pieces)
    return out


def _no_thread_left() -> bool:
    return not any(t.name == "ckptd-readahead" for t in threading.enumerate())


def test_every_rank_reads_the_same_bytes_in_a_few_large_reads(step: tuple[str, dict[str, torch.Tensor]]) -> None:
    path, full = step
    with Counting(path) as reader:
        out = _read(reader, full, (0, ROWS))
        reads = list(reader.reads)
    assert all(torch.equal(out[k], full[k]) for k in full)
    # 301 chunks per file in at most a handful of reads per file (not one per tensor)
    assert len(reads) <= 2 * 4, reads
    assert _no_thread_left()


def test_a_rank_at_another_world_size_reads_only_the_file_holding_its_rows(step: tuple[str, dict[str, torch.Tensor]]) -> None:
    path, full = step
    with Counting(path) as reader:
        out = _read(reader, full, (ROWS // 2, ROWS))  # rank 1 of 2 -> this one rank's rows: only rank-00001's chunks
        fds = {fd for fd, _, _ in reader.reads}
        assert fds == {reader._fds[shard_name(1)]}
        size = os.path.getsize(os.path.join(path, shard_name(1)))
        assert sum(n for _, _, n in reader.reads) <= size  # nothing read twice, nothing beyond the file
    assert all(torch.equal(out[k], full[k][ROWS // 2 :]) for k in full)


def _flip_byte_of(path: str, name: str, key: str) -> None:
    man = json.loads(open(os.path.join(path, "manifest.json")).read())
    (c,) = [c for c in man["tensors"][key]["chunks"] if c["file"] == name]
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(c["byte_range"][0] + 3)
        b = f.read(1)
        f.seek(c["byte_range"][0] + 3)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupt_chunk_in_the_middle_fails_the_read_and_stops_the_thread(
    tmp_path: Path, step: tuple[str, dict[str, torch.Tensor]]
) -> None:
    import shutil

    path = str(tmp_path / "copy")
    shutil.copytree(step[0], path)
    _flip_byte_of(path, shard_name(0), "model/small150")
    with CheckpointReader(path) as reader, pytest.raises(FormatError, match=r"checksum mismatch in .*rank-00000.*small150"):
        _read(reader, step[1], (0, ROWS))
    assert _no_thread_left()


def _chunks(*spans: tuple[str, int, int]) -> list[dict[str, Any]]:
    return [{"file": f, "byte_range": [b, e]} for f, b, e in spans]


def test_runs_join_adjacent_chunks_of_one_file_up_to_the_limit() -> None:
    big = readahead.RUN_BYTES
    runs = readahead.plan_runs(
        _chunks(
            ("a", 0, 100),
            ("a", 128, 200),  # after alignment padding: joined
            ("a", 128, 200),  # the same chunk again (two regions need it): in the run already
            ("a", 200 + readahead.GAP_BYTES + 1, 9000),  # a gap (a chunk this rank does not take): a new read
            ("b", 9000, 9100),  # another file
            ("b", 9100, 9100 + big),  # would make the run longer than RUN_BYTES: a new read
        )
    )
    assert [(r.name, r.start, r.end, r.count) for r in runs] == [
        ("a", 0, 200, 3),
        ("a", 200 + readahead.GAP_BYTES + 1, 9000, 1),
        ("b", 9000, 9100, 1),
        ("b", 9100, 9100 + big, 1),
    ]


def test_a_file_shorter_than_its_chunks_is_a_format_error_from_the_thread() -> None:
    def short(name: str, into: torch.Tensor, offset: int) -> int:
        into.fill_(1)
        return into.numel() - 1 if offset > 0 else into.numel()

    chunks = _chunks(("f", 0, 10), ("f", 10 + readahead.GAP_BYTES + 1, 8192))
    with readahead.ReadAhead(chunks, short, lambda name: f"/x/{name}") as ra:
        assert ra.take(chunks[0]).tolist() == [1] * 10
        with pytest.raises(FormatError, match=r"/x/f ends inside bytes 4107-8192: truncated"):
            ra.take(chunks[1])
    assert _no_thread_left()


def test_taking_chunks_out_of_the_planned_order_is_refused() -> None:
    chunks = _chunks(("f", 0, 10), ("g", 0, 10))
    with readahead.ReadAhead(chunks, lambda n, into, off: into.numel(), str) as ra:
        with pytest.raises(RuntimeError, match="out of the planned order"):
            ra.take(chunks[1])
    assert _no_thread_left()


def test_leaving_early_stops_a_thread_that_waits_for_a_buffer() -> None:
    chunks = _chunks(*[("f", i * (readahead.GAP_BYTES + 100), i * (readahead.GAP_BYTES + 100) + 10) for i in range(10)])
    with readahead.ReadAhead(chunks, lambda n, into, off: into.numel(), str) as ra:
        ra.take(chunks[0])  # the thread has filled the second buffer and waits for the first back
    assert _no_thread_left()


class _Fence:
    """Stands in for a CUDA event after the copies from a buffer: the thread must wait for it."""

    def __init__(self) -> None:
        self.passed = threading.Event()

    def synchronize(self) -> None:
        assert self.passed.wait(30), "the fence was never passed"


def test_a_buffer_is_refilled_only_after_its_fence_has_passed() -> None:
    """For a GPU destination the caller's copies from a buffer run after take() returns (DMA): the thread
    waits for the fence made when the caller moved on before reading the next run into that buffer."""
    step = readahead.GAP_BYTES + 100
    chunks = _chunks(*[("f", i * step, i * step + 10 * (i + 1)) for i in range(3)])  # three runs of 10, 20, 30 bytes
    reads: list[int] = []
    made: list[tuple[int, str]] = []
    fences: list[_Fence] = []

    def pread(name: str, into: torch.Tensor, offset: int) -> int:
        reads.append(offset)
        into.fill_(len(reads))
        return into.numel()

    def alloc(n: int) -> torch.Tensor:
        made.append((n, threading.current_thread().name))
        return torch.empty(n, dtype=torch.uint8)

    def fence() -> _Fence:
        fences.append(_Fence())
        return fences[-1]

    with readahead.ReadAhead(chunks, pread, str, alloc=alloc, fence=fence) as ra:
        assert made == [(30, threading.current_thread().name)] * 2  # both buffers, the largest run, made here
        assert ra.take(chunks[0]).tolist() == [1] * 10
        assert ra.take(chunks[1]).tolist() == [2] * 20  # the first buffer is handed back behind a fence
        assert len(fences) == 1
        threading.Event().wait(0.2)
        assert reads == [0, step]  # run 3 waits for the copies from the first buffer
        fences[0].passed.set()
        assert ra.take(chunks[2]).tolist() == [3] * 30
        assert reads == [0, step, 2 * step]
    assert _no_thread_left()


def test_the_thread_is_set_up_by_init_and_a_failing_init_reaches_the_caller() -> None:
    """For a GPU destination ``init`` sets the thread's device before any fence is waited for there."""
    chunks = _chunks(("f", 0, 10), ("f", 10 + readahead.GAP_BYTES + 1, 8192))
    ran: list[str] = []
    with readahead.ReadAhead(
        chunks, lambda n, into, off: into.numel(), str, init=lambda: ran.append(threading.current_thread().name)
    ) as ra:
        ra.take(chunks[0])
    assert ran == ["ckptd-readahead"]

    def broken() -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    with readahead.ReadAhead(chunks, lambda n, into, off: into.numel(), str, init=broken) as ra:
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            ra.take(chunks[0])
    assert _no_thread_left()
