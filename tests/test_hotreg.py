"""A hot restore into a GPU straight from segments on huge pages (:mod:`ckptd.client.hotreg`): which path a segment
takes, and the registered path's order (a chunk's copy only once its bytes are registered), checks and fall-backs.
The GPU side runs with a stand-in for ``cuda.Uploads`` that copies on the CPU and records the registrations;
``tests/test_cuda.py`` runs the real thing where a GPU is."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from ckptd.client import hotreg
from ckptd.client.hotread import Flat
from ckptd.client.hotreg import RegisteredRead, huge_backed, path_for, read_registered
from ckptd.errors import FormatError
from ckptd.format import digest

GPU = torch.device("cuda", 0)
CUT = 64 << 10  # the registration ranges here


class Registers:
    """What ``RegisteredRead`` asks of ``cuda.Uploads``: ranges registered (recorded, in order; ``refuse_at``: the
    n-th is refused), a side stream (None: the copies happen at once), destinations kept."""

    def __init__(self, log: list[tuple[Any, ...]], refuse_at: int | None = None) -> None:
        self.log, self.refuse_at, self.stream, self.ordered, self.kept = log, refuse_at, None, 0, []
        self.ranges: list[tuple[int, int]] = []

    def register_range(self, ptr: int, size: int) -> bool:
        if self.refuse_at is not None and len(self.ranges) == self.refuse_at:
            return False
        self.ranges.append((ptr, size))
        self.log.append(("register", ptr, size))
        return True

    def after_current(self) -> None:
        self.ordered += 1

    def keep(self, dst: torch.Tensor) -> None:
        self.kept.append(dst)
        self.log.append(("copy", dst))


def _check(key: str, c: dict[str, Any], raw: torch.Tensor) -> None:
    if c["xxh3_64"] is not None and digest(memoryview(raw.numpy())) != c["xxh3_64"]:
        raise FormatError(f"checksum mismatch in {c['file']} (tensor {key!r})")


def _segment(sizes: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    data = os.urandom(sum(sizes) + 64 * len(sizes))
    spans, pos = [], 0
    for n in sizes:
        spans.append((pos, pos + n))
        pos += n + 64
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), spans


def _flats(seg: torch.Tensor, spans: list[tuple[int, int]], checked: bool = True) -> list[Flat]:
    return [
        Flat(f"t{i}", {"file": "s", "byte_range": [b, e], "xxh3_64": digest(memoryview(seg[b:e].numpy())) if checked else None},
             torch.zeros(e - b, dtype=torch.uint8), GPU)
        for i, (b, e) in enumerate(spans)
    ]  # fmt: skip


def _read(seg: torch.Tensor, flats: list[Flat], up: Registers, workers: int = 3) -> list[Flat]:
    return RegisteredRead(
        lambda name: seg, lambda dev: up, _check, lambda name: f"/dev/shm/{name}", workers=workers, register_bytes=CUT
    ).read(flats)


SIZES = [300, 5000, 100 << 10, 17, 200 << 10, 4096, 30 << 10]


def test_every_chunk_arrives_from_ranges_registered_once_each_in_order_with_no_overlap() -> None:
    seg, spans = _segment(SIZES)
    flats = _flats(seg, spans)
    up = Registers([])
    assert _read(seg, flats, up) == []
    assert all(torch.equal(f.dst, seg[b:e]) for f, (b, e) in zip(flats, spans))
    at = [p - seg.data_ptr() for p, _ in up.ranges]
    assert at == sorted(at) and all(a % CUT == 0 for a in at)
    assert all(a + n <= b for (a, n), b in zip(up.ranges, [p for p, _ in up.ranges[1:]]))  # no two overlap
    assert up.ordered == 1 and len(up.kept) == sum(len(parts) for *_, parts in hotreg.ranges(flats, seg.numel(), CUT))


@pytest.mark.parametrize("size_cut", [CUT, 4096, 3 * CUT])
def test_a_chunk_across_ranges_is_copied_in_parts_each_inside_one_registration(size_cut: int) -> None:
    seg, spans = _segment(SIZES)
    flats = _flats(seg, spans)
    flats.append(Flat("twin", flats[4].c, torch.zeros_like(flats[4].dst), GPU))  # one chunk into two destinations
    size = seg.numel()
    cuts = hotreg.ranges(flats, size, size_cut)
    assert [s for s, _, _ in cuts] == sorted({s for s, _, _ in cuts})
    covered: dict[int, list[tuple[int, int]]] = {}
    for start, end, parts in cuts:
        assert start % size_cut == 0 and start < end <= min(size, start + size_cut) and end % hotreg.PAGE in (0, size % hotreg.PAGE)
        for f, b, e in parts:
            assert start <= b < e <= end  # the part's bytes are all in this registration
            covered.setdefault(id(f), []).append((b, e))
    for f in flats:  # each chunk's parts, in order, cover it exactly once
        got = sorted(covered[id(f)])
        assert got[0][0] == f.c["byte_range"][0] and got[-1][1] == f.c["byte_range"][1]
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


@pytest.mark.parametrize("which", [0, 4, 6])
def test_a_corrupt_chunk_is_a_format_error_naming_it(which: int) -> None:
    seg, spans = _segment(SIZES)
    flats = _flats(seg, spans)
    seg[spans[which][0] + 3] ^= 0xFF
    with pytest.raises(FormatError, match=f"'t{which}'"):
        _read(seg, flats, Registers([]))


def test_a_mismatch_is_raised_even_when_a_copy_failed_first() -> None:
    seg, spans = _segment(SIZES)
    flats = _flats(seg, spans)
    seg[spans[5][0]] ^= 1
    flats[0].dst = torch.zeros(3, dtype=torch.uint8)  # the copy of t0 fails (a shape mismatch)
    with pytest.raises(FormatError, match="'t5'") as got:
        _read(seg, flats, Registers([]))
    assert isinstance(got.value.__cause__, RuntimeError)


def test_a_refused_registration_leaves_the_rest_of_the_segment_to_the_slots() -> None:
    seg, spans = _segment(SIZES)
    flats = _flats(seg, spans)
    up = Registers([], refuse_at=2)
    left = _read(seg, flats, up)
    copied = [f for f in flats if f not in left]
    assert left and copied and len(up.ranges) == 2
    assert all(f.c["byte_range"][1] > 2 * CUT for f in left)  # those whose bytes were not all registered
    assert all(torch.equal(f.dst, seg[f.c["byte_range"][0] : f.c["byte_range"][1]]) for f in copied)


def test_a_segment_shorter_than_its_chunks_is_a_format_error_before_any_copy() -> None:
    seg, spans = _segment(SIZES)
    flats = _flats(seg, spans)
    up = Registers([])
    with pytest.raises(FormatError, match="truncated"):
        _read(seg[: spans[-1][1] - 1], flats, up)
    assert up.ranges == [] and up.kept == []


def test_a_step_kept_only_in_memory_has_no_checksums_and_is_copied_unchecked() -> None:
    seg, spans = _segment(SIZES)
    flats = _flats(seg, spans, checked=False)
    seg[spans[0][0]] ^= 1  # (nothing to catch it: a memory-tier step never left the daemon's memory)
    assert _read(seg, flats, Registers([])) == []
    assert torch.equal(flats[0].dst, seg[spans[0][0] : spans[0][1]])


def _fake_kernel(tmp_path: Any, monkeypatch: Any, shmem: str, mounts: list[str]) -> None:
    (tmp_path / "shmem").write_text(shmem + "\n")
    (tmp_path / "mounts").write_text("".join(m + "\n" for m in mounts))
    monkeypatch.setattr(hotreg, "SHMEM_ENABLED", str(tmp_path / "shmem"))
    monkeypatch.setattr(hotreg, "MOUNTS", str(tmp_path / "mounts"))
    monkeypatch.delenv("CKPTD_HOT_PATH", raising=False)


ROOT = "/dev/root / ext4 rw,relatime 0 0"


@pytest.mark.parametrize(
    "shmem,mount,huge",
    [
        ("always within_size advise [never] deny force", "tmpfs /dev/shm tmpfs rw,size=100k,huge=within_size 0 0", True),
        ("always within_size advise [never] deny force", "tmpfs /dev/shm tmpfs rw,huge=always 0 0", True),
        ("always within_size advise [never] deny force", "tmpfs /dev/shm tmpfs rw,size=100k 0 0", False),
        ("always within_size advise [never] deny force", "tmpfs /dev/shm tmpfs rw,huge=advise 0 0", False),
        ("always within_size advise never deny [force]", "tmpfs /dev/shm tmpfs rw 0 0", True),
        ("always within_size advise never [deny] force", "tmpfs /dev/shm tmpfs rw,huge=always 0 0", False),
        ("always within_size advise [never] deny force", "shm /dev/shm ext4 rw,huge=always 0 0", False),  # not a tmpfs
    ],
)
def test_a_segment_takes_the_registered_path_only_where_its_tmpfs_gives_huge_pages(tmp_path, monkeypatch, shmem, mount, huge) -> None:  # noqa: ANN001
    _fake_kernel(tmp_path, monkeypatch, shmem, [ROOT, mount])
    assert huge_backed("/dev/shm/ckptd-0-slot-3") is huge
    assert path_for("/dev/shm/ckptd-0-slot-3") == ("register" if huge else "pread")


def test_the_mount_nearest_the_segment_decides(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    shmem = "always within_size advise [never] deny force"
    _fake_kernel(tmp_path, monkeypatch, shmem, [ROOT, "tmpfs /run tmpfs rw,huge=always 0 0", "tmpfs /run/ckptd tmpfs rw 0 0"])
    assert huge_backed("/run/ckptd/seg") is False and huge_backed("/run/other/seg") is True and huge_backed("/runs/seg") is False


def test_ckptd_hot_path_overrides_and_a_wrong_value_is_a_clear_error(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    _fake_kernel(tmp_path, monkeypatch, "[never]", [ROOT, "tmpfs /dev/shm tmpfs rw 0 0"])
    monkeypatch.setenv("CKPTD_HOT_PATH", "register")
    assert path_for("/dev/shm/x") == "register"
    monkeypatch.setenv("CKPTD_HOT_PATH", "mmap")
    with pytest.raises(ValueError, match="CKPTD_HOT_PATH must be auto, pread or register, not 'mmap'"):
        path_for("/dev/shm/x")


def test_without_huge_pages_no_flat_is_taken_and_cpu_flats_never_are(monkeypatch) -> None:  # noqa: ANN001
    seg, spans = _segment(SIZES[:3])
    flats = _flats(seg, spans)
    flats[1].device = None  # a CPU destination (an optimizer's step counter): always through HotRead
    up = Registers([])
    args = (lambda name: f"/dev/shm/{name}", lambda name: seg, lambda dev: up, _check)
    monkeypatch.setenv("CKPTD_HOT_PATH", "pread")
    assert read_registered(flats, *args) is flats and up.ranges == []
    monkeypatch.setenv("CKPTD_HOT_PATH", "register")
    assert read_registered(flats, *args) == [flats[1]] and up.ranges
    assert torch.equal(flats[0].dst, seg[spans[0][0] : spans[0][1]]) and not flats[1].dst.any()


@pytest.mark.parametrize("large", [False, True])
def test_a_closed_readers_ranges_are_unregistered_before_their_mapping_goes_and_large_ones_off_the_restores_path(
    monkeypatch, large: bool
) -> None:  # noqa: ANN001
    import threading

    from ckptd.client import cuda

    done = threading.Event()
    log: list[tuple[str, Any, str]] = []

    class Map:
        def __len__(self) -> int:
            return 4096

        def close(self) -> None:
            log.append(("unmap", None, threading.current_thread().name))
            done.set()

    monkeypatch.setattr(cuda, "unpin", lambda ptr: log.append(("unregister", ptr, threading.current_thread().name)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: log.append(("device", d, threading.current_thread().name)))
    registered = {0x1000: True, 0x2000: False, 0x3000: True}  # (the refused one is not unregistered)
    cuda.let_go(registered, [Map()], 4096 if large else 1 << 30)
    assert registered == {} and done.wait(10)
    here = threading.current_thread().name
    want = [("unregister", 0x1000), ("unregister", 0x3000), ("unmap", None)]
    assert [e[:2] for e in log if e[0] != "device"] == want
    if large:  # on a thread of its own, made current on the caller's GPU first
        assert log[0] == ("device", 3, "ckptd-unmap") and all(e[2] == "ckptd-unmap" for e in log)
    else:
        assert all(e[2] == here for e in log)
