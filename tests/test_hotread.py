"""A hot restore's whole chunks, read from the daemon's segment by several threads with ``pread``
(:mod:`ckptd.client.hotread`): into CPU tensors straight, and into GPU tensors through page-locked slots. The GPU
side runs here with a stand-in for ``cuda.Uploads`` that copies on the CPU at once and records what a stream and
its events would have been asked; ``tests/test_cuda.py`` runs the real thing where a GPU is."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest
import torch
from _shards import shard_bytes

from ckptd.client import hotread
from ckptd.client.hotread import Flat, HotRead, plan
from ckptd.client.reader import CheckpointReader, _whole
from ckptd.errors import FormatError
from ckptd.layout import shard_name
from ckptd.state import TAG
from ckptd.storage import local

GPU = torch.device("cuda", 0)


class Fence:
    def __init__(self, log: list[str], slot: int) -> None:
        self.log, self.slot, self.passed = log, slot, False

    def synchronize(self) -> None:
        self.passed = True
        self.log.append(f"wait {self.slot}")


class CopiesOnCpu:
    """What ``HotRead`` asks of ``cuda.Uploads``: page-locked slots (plain memory here), a side stream (the
    copies happen at once), fences (recorded: a slot must not be read into before its fence passed)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.made: list[torch.Tensor] = []
        self.bound: set[str] = set()  # the threads that made the side stream theirs
        self.ordered = 0
        self.fenced = 0  # events recorded on this GPU's stream
        self.kept: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def pinned(self, n: int) -> torch.Tensor:
        buf = torch.empty(n, dtype=torch.uint8)
        with self._lock:
            self.made.append(buf)
        return buf

    def after_current(self) -> None:
        self.ordered += 1

    def bind(self) -> None:
        with self._lock:
            self.bound.add(threading.current_thread().name)

    def keep(self, dst: torch.Tensor) -> None:
        self.kept.append(dst)

    def fence(self) -> Fence:
        with self._lock:
            self.fenced += 1
        return Fence(self.log, len(self.log))


def _step(tmp_path: Any, tensors: dict[str, torch.Tensor]) -> str:
    buf = shard_bytes([(k, t.clone(), tuple(t.shape), (0,) * t.dim()) for k, t in tensors.items()])
    tree = {"model": {k.split("/", 1)[1]: {TAG: "tensor", "key": k} for k in tensors}}
    local.write_shard(str(tmp_path), local.ShardWrite("j", 1, 0, 1, memoryview(buf), len(buf), tree, local_world_size=1, committed_at=7))
    return local.finalize_step(str(tmp_path), "j", 1, 1)


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"model/small{i}": torch.randn(3, 17, generator=g) for i in range(30)}  # 204 bytes each: read together
    out["model/big"] = torch.randn(1000, 7, generator=g)  # 28,000 bytes: more than a slot below, read in parts
    out["model/count"] = torch.tensor(7, dtype=torch.int64)  # a 0-d tensor
    out["model/mask"] = torch.rand(33, generator=g) > 0.5  # 1-byte elements
    return out


def _flats(path: str, state: dict[str, torch.Tensor], device: torch.device | None) -> tuple[dict[str, torch.Tensor], list[Flat]]:
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    out = {k: torch.zeros_like(t) for k, t in state.items()}
    flats = []
    for k, t in out.items():
        (c,) = manifest["tensors"][k]["chunks"]
        flats.append(Flat(k, c, t.view(-1).view(torch.uint8), device))
    return out, flats


def _read(path: str, flats: list[Flat], up: CopiesOnCpu | None = None, **kw: Any) -> None:
    fds = {name: os.open(os.path.join(path, name), os.O_RDONLY) for name in {f.c["file"] for f in flats}}
    try:
        HotRead(fds, lambda name: os.path.join(path, name), lambda dev: up, **kw).read(flats)
    finally:
        for fd in fds.values():
            os.close(fd)


def _flip(path: str, key: str, at: int = 3) -> None:
    with open(os.path.join(path, "manifest.json")) as f:
        (c,) = json.load(f)["tensors"][key]["chunks"]
    with open(os.path.join(path, c["file"]), "r+b") as f:
        f.seek(c["byte_range"][0] + at)
        b = f.read(1)
        f.seek(c["byte_range"][0] + at)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("workers", [1, 3])
def test_every_chunk_arrives_through_the_slots_on_threads_of_their_own(tmp_path, state, workers, monkeypatch) -> None:  # noqa: ANN001
    path = _step(tmp_path, state)
    out, flats = _flats(path, state, GPU)
    up = CopiesOnCpu()
    copies: list[int] = []
    monkeypatch.setattr(HotRead, "_copy", staticmethod(lambda dst, src: (copies.append(src.numel()), dst.copy_(src))))
    _read(path, flats, up, workers=workers, slot=4096)
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert up.ordered == 1  # the side stream waits once for the work queued before (fresh zeros_like destinations)
    assert 1 <= len(up.made) == len(up.bound) <= workers  # a pair of slots and the stream, per thread that took a run
    assert threading.current_thread().name not in up.bound  # the caller's current stream is left alone
    assert all(s.numel() == 2 * 4096 for s in up.made)
    assert sorted(id(t) for t in up.kept) == sorted(id(f.dst) for f in flats)  # each destination handed to the stream once
    assert len(copies) == len(state) - 1 + -(-28000 // 4096) and max(copies) == 4096  # the big chunk: one copy per slot


def test_small_chunks_next_to_each_other_are_one_read_and_a_large_one_is_read_in_slot_sized_parts(tmp_path, state) -> None:  # noqa: ANN001
    path = _step(tmp_path, state)
    _, flats = _flats(path, state, GPU)
    runs = plan(flats, 4096)
    sizes = sorted(len(r.flats) for r in runs)
    assert sum(sizes) == len(flats) and max(sizes) > 10  # the small ones share reads
    assert all(r.end - r.start <= 4096 or len(r.flats) == 1 for r in runs)
    assert runs[0].flats[0].key == "model/big"  # the longest run is taken first


def test_a_slot_is_read_into_again_only_after_the_copies_from_it_ended(tmp_path, state, monkeypatch) -> None:  # noqa: ANN001
    path = _step(tmp_path, state)
    _, flats = _flats(path, state, GPU)
    up = CopiesOnCpu()
    last: dict[int, Fence] = {}  # slot address -> the fence recorded after the copies from it
    reading: list[int] = []  # the slot the latest read went into
    real_fence = up.fence

    def fence() -> Fence:
        f = last[reading[-1]] = real_fence()
        return f

    up.fence = fence  # type: ignore[method-assign]
    ok: list[bool] = []
    real_pread = hotread.pread_into

    def pread(fd: int, into: torch.Tensor, offset: int, seen: Any = None) -> int:
        ok.append(into.data_ptr() not in last or last[into.data_ptr()].passed)
        reading.append(into.data_ptr())
        return real_pread(fd, into, offset, seen)

    monkeypatch.setattr(hotread, "pread_into", pread)
    _read(path, flats, up, workers=1, slot=4096)
    assert len(ok) > 4 and all(ok) and len(last) == 2  # two slots, used in turn, each reused only after its fence
    assert all(f.passed for f in last.values())  # the thread waits for its last copies before it ends


def test_into_cpu_tensors_the_bytes_land_in_the_destination_without_slots(tmp_path, state) -> None:  # noqa: ANN001
    path = _step(tmp_path, state)
    out, flats = _flats(path, state, None)
    _read(path, flats, None, workers=2)  # no Uploads is asked for
    assert all(torch.equal(out[k], state[k]) for k in state)


@pytest.mark.parametrize("device", [None, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("key,at", [("model/small4", 5), ("model/big", 27_990)], ids=["small", "big-last-part"])
def test_a_corrupt_chunk_in_the_segment_is_a_format_error_naming_it(tmp_path, state, device, key, at) -> None:  # noqa: ANN001
    path = _step(tmp_path, state)
    _flip(path, key, at)
    _, flats = _flats(path, state, device)
    with pytest.raises(FormatError, match=rf"checksum mismatch .*{key!r}"):
        _read(path, flats, CopiesOnCpu(), workers=2, slot=4096)


@pytest.mark.parametrize("device", [None, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("piece", [100, 4096, 1 << 20])
def test_chunks_hashed_piece_by_piece_as_they_are_read_verify_wherever_the_pieces_cut_them(
    tmp_path, state, device, piece, monkeypatch
) -> None:  # noqa: ANN001
    """Chunks are hashed a piece at a time as they are read (not read whole, then hashed from memory): pieces that cut
    chunks anywhere (100 bytes: inside each 204-byte chunk; 4096: a slot), one chunk into two destinations, every
    chunk arrives and verifies; a byte flipped past a piece boundary is caught, naming its tensor."""
    monkeypatch.setattr(hotread, "PIECE_BYTES", piece)
    path = _step(tmp_path, state)
    out, flats = _flats(path, state, device)
    twin = torch.zeros_like(state["model/small3"])
    flats.append(Flat("model/small3", next(f.c for f in flats if f.key == "model/small3"), twin.view(-1).view(torch.uint8), device))
    _read(path, flats, CopiesOnCpu(), workers=2, slot=4096)
    assert all(torch.equal(out[k], state[k]) for k in state) and torch.equal(twin, state["model/small3"])
    for key, at in (("model/small9", 200), ("model/big", 27_000)):
        _flip(path, key, at)
        _, flats = _flats(path, state, device)
        with pytest.raises(FormatError, match=rf"checksum mismatch .*{key!r}"):
            _read(path, flats, CopiesOnCpu(), workers=2, slot=4096)
        _flip(path, key, at)  # back as it was


@pytest.mark.parametrize("step", [1, 37, 1000])
def test_spans_hash_each_range_of_the_pieces_seen_once(step: int) -> None:
    from ckptd.format import digest

    data = os.urandom(1000)
    ranges = [(0, 10), (5, 600), (5, 600), (6, 7), (600, 1000), (999, 999), (300, 301)]  # overlapping, twice, inside, empty
    spans = hotread.Spans(ranges)
    for pos in range(0, 1000, step):
        spans.seen(pos, memoryview(data)[pos : pos + step])
    for b, e in ranges:
        assert spans.hexdigest(b, e) == digest(data[b:e])


def test_a_segment_cut_short_under_the_reader_is_a_format_error_not_a_short_destination(tmp_path, state) -> None:  # noqa: ANN001
    # the reader checked the size when it opened the segment; a file shortened after that must not leave zeros unnoticed
    path = _step(tmp_path, state)
    _, flats = _flats(path, state, GPU)
    with open(os.path.join(path, "manifest.json")) as f:
        (c,) = json.load(f)["tensors"]["model/big"]["chunks"]
    os.truncate(os.path.join(path, c["file"]), c["byte_range"][0] + 10_000)
    with pytest.raises(FormatError, match="truncated"):
        _read(path, flats, CopiesOnCpu(), workers=2, slot=4096)


def test_a_mismatch_is_raised_first_when_another_thread_failed_before_it(tmp_path, state, monkeypatch) -> None:  # noqa: ANN001
    # the FormatError sends a hot restore to the disk's intact copy: another thread's earlier error must not hide it
    path = _step(tmp_path, state)
    _flip(path, "model/big", 5)
    _, flats = _flats(path, state, GPU)
    copy_failed = threading.Event()

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        try:
            dst.copy_(src)
        except RuntimeError:
            copy_failed.set()
            raise

    monkeypatch.setattr(HotRead, "_copy", staticmethod(copy))
    real_check = HotRead._check

    def check(self: HotRead, f: Flat, got: str | None) -> None:
        try:
            real_check(self, f, got)
        except FormatError:
            assert copy_failed.wait(30)  # the mismatch is found after the other thread's copy failed
            raise

    monkeypatch.setattr(HotRead, "_check", check)
    next(f for f in flats if f.key == "model/small7").dst = torch.empty(0, dtype=torch.uint8)  # its copy fails
    with pytest.raises(FormatError, match="model/big") as got:
        _read(path, flats, CopiesOnCpu(), workers=2, slot=4096)
    assert isinstance(got.value.__cause__, RuntimeError)


def test_a_step_kept_only_in_memory_has_no_checksums_and_is_read_unchecked(tmp_path, state) -> None:  # noqa: ANN001
    path = _step(tmp_path, state)
    out, flats = _flats(path, state, GPU)
    for f in flats:
        f.c = dict(f.c, xxh3_64=None)
    _read(path, flats, CopiesOnCpu(), workers=2, slot=4096)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_one_chunk_into_two_destinations_fills_both(tmp_path, state) -> None:  # noqa: ANN001
    path = _step(tmp_path, state)
    out, flats = _flats(path, state, GPU)
    twin = {k: torch.zeros_like(state[k]) for k in ("model/big", "model/small3")}
    flats += [Flat(k, next(f.c for f in flats if f.key == k), t.view(-1).view(torch.uint8), GPU) for k, t in twin.items()]
    _read(path, flats, CopiesOnCpu(), workers=2, slot=4096)
    assert all(torch.equal(t, state[k]) for k, t in twin.items())
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_whole_is_the_destinations_bytes_only_where_the_chunk_fills_a_contiguous_part_of_it() -> None:
    c = {"offsets": [0, 0], "sizes": [4, 6]}
    dst = torch.nn.Parameter(torch.zeros(4, 6))
    flat = _whole(dst, (0, 0), c, [0, 0], [4, 6], torch.float32)
    assert flat is not None and flat.numel() == 96 and flat.data_ptr() == dst.data_ptr() and not flat.requires_grad
    rows = torch.zeros(8, 6)  # the chunk is rows 4-7 of a larger destination: a contiguous part
    c2 = {"offsets": [4, 0], "sizes": [4, 6]}
    part = _whole(rows, (0, 0), c2, [4, 0], [8, 6], torch.float32)
    assert part is not None and part.data_ptr() == rows[4].data_ptr()
    assert _whole(torch.zeros(4, 12), (0, 0), c, [0, 0], [4, 6], torch.float32) is None  # columns: not contiguous
    assert _whole(dst, (0, 0), c, [0, 0], [4, 3], torch.float32) is None  # the chunk is larger than the region
    assert _whole(dst, (0, 0), c, [0, 0], [4, 6], torch.bfloat16) is None  # a cast
    assert _whole(torch.zeros(4, 6).t(), (0, 0), {"offsets": [0, 0], "sizes": [6, 4]}, [0, 0], [6, 4], torch.float32) is None


def test_a_cpu_restore_from_the_segment_reads_whole_chunks_without_mapping_it(tmp_path, state) -> None:  # noqa: ANN001
    path = _step(tmp_path, state)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    reader = CheckpointReader(path, manifest=manifest, files={shard_name(0): os.path.join(path, shard_name(0))})
    out = {k: torch.zeros_like(t) for k, t in state.items()}
    with reader:
        reader.read_many([p for k, t in out.items() for p in reader.pieces(k, t, (0,) * t.dim())])
        assert not reader._maps
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_with_two_gpus_a_slot_waits_for_the_copies_on_the_gpu_they_went_to(tmp_path, state) -> None:  # noqa: ANN001
    # one process restoring onto two GPUs (a pipeline stage each): a thread's slots serve both, and a slot last
    # copied to the second GPU must wait for that GPU's stream, not the first one's
    path = _step(tmp_path, state)
    second = torch.device("cuda", 1)
    out, flats = _flats(path, state, GPU)
    for f in flats[::2]:
        f.device = second
    ups = {GPU: CopiesOnCpu(), second: CopiesOnCpu()}
    fds = {shard_name(0): os.open(os.path.join(path, shard_name(0)), os.O_RDONLY)}
    try:
        HotRead(fds, str, lambda dev: ups[dev], workers=1, slot=4096).read(flats)
    finally:
        os.close(fds[shard_name(0)])
    assert all(torch.equal(out[k], state[k]) for k in state)
    runs = plan(flats, 4096)
    reads = {d: sum(1 if r.end - r.start <= 4096 else -(-(r.end - r.start) // 4096) for r in runs if r.device == d) for d in ups}
    fenced = {d: up.fenced for d, up in ups.items()}
    assert fenced == reads  # one fence per read into a slot, on the stream of the GPU the copies from it went to


def test_a_tensor_subclass_destination_is_not_read_into_as_bytes(tmp_path, state) -> None:  # noqa: ANN001
    class Wrapped(torch.Tensor):  # a stand-in for a quantized or __torch_dispatch__ wrapper: its bytes are not its values
        pass

    c = {"offsets": [0, 0], "sizes": [4, 6]}
    assert _whole(torch.zeros(4, 6).as_subclass(Wrapped), (0, 0), c, [0, 0], [4, 6], torch.float32) is None
    path = _step(tmp_path, state)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    reader = CheckpointReader(path, manifest=manifest, files={shard_name(0): os.path.join(path, shard_name(0))})
    out = {k: torch.zeros_like(t).as_subclass(Wrapped) for k, t in state.items()}
    with reader:
        reader.read_many([p for k, t in out.items() for p in reader.pieces(k, t, (0,) * t.dim())])
    assert all(torch.equal(out[k].as_subclass(torch.Tensor), state[k]) for k in state)


def test_threads_already_started_are_joined_when_starting_another_fails(tmp_path, state, monkeypatch) -> None:  # noqa: ANN001
    # the caller closes the segments' descriptors once read() raises: no thread of it may still be reading then
    path = _step(tmp_path, state)
    _, flats = _flats(path, state, None)
    real_start = threading.Thread.start
    starts: list[int] = []

    def start(self: threading.Thread) -> None:
        starts.append(1)
        if len(starts) == 2:
            raise RuntimeError("can't start new thread")
        real_start(self)

    never = threading.Event()
    real_host = HotRead._to_host
    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(HotRead, "_to_host", lambda self, run: (never.wait(1.0), real_host(self, run))[1])
    with pytest.raises(RuntimeError, match="can't start new thread"):
        _read(path, flats, None, workers=3, slot=4096)
    assert len(starts) == 2 and not [t for t in threading.enumerate() if t.name.startswith("ckptd-hotread")]


@pytest.mark.parametrize(
    ("cpus", "machine", "local", "want"),
    [
        (16, 16, None, 16),  # one rank on a 16-core host: as measured on one H100
        (64, 64, None, 16),  # never more than 16
        (16, 16, "8", 2),  # eight ranks restarting together share the cores: 16 threads in all, not 128
        (16, 16, "32", 1),
        (2, 16, "8", 2),  # bound to two cores of its own (numactl, a launcher's binding): its share already
        (1, 1, "bad", 1),
    ],
)
def test_a_rank_reads_with_its_share_of_the_nodes_cores(
    monkeypatch: pytest.MonkeyPatch, cpus: int, machine: int, local: str | None, want: int
) -> None:
    from ckptd.client import hotread

    monkeypatch.setattr(hotread.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(hotread.os, "cpu_count", lambda: machine)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert hotread.thread_share() == want
    assert hotread.HotRead({}, str, lambda dev: None).workers == want
