"""Shard files written with direct I/O (``ckptd.storage.direct``): the bytes on disk are the bytes given, on a real
ext4 (a loop device), when the disk fills with writes in flight, and when a file system refuses direct writes."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from ckptd.storage import direct
from ckptd.storage.direct import ALIGN, StreamWriter

ext4 = pytest.mark.parametrize("small_disk", ["ext4"], indirect=True)


def _stream(path: str, data: bytes, block: int, in_flight: int = 2) -> bool:
    """Write ``data`` through a StreamWriter; whether it wrote direct."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with StreamWriter(fd, block, len(data), in_flight) as w:
            for pos in range(0, len(data), block):
                with memoryview(w.block()) as buf:
                    piece = data[pos : pos + block]
                    buf[: len(piece)] = piece
                w.submit(len(piece))
            w.finish()
            return w.direct
    finally:
        os.close(fd)


@ext4
@pytest.mark.parametrize("size", [ALIGN, 5 * 65536, 5 * 65536 + 123, 3 * 65536 - 1])
def test_a_file_written_direct_is_exactly_the_bytes_given(small_disk: str, size: int) -> None:
    """Blocks of 64 KiB, two writes in flight; a short last block is written padded and cut back."""
    data = os.urandom(size)
    path = os.path.join(small_disk, "f")
    assert _stream(path, data, 65536) is True
    with open(path, "rb") as f:
        assert f.read() == data


def test_a_block_that_is_not_aligned_is_written_through_the_page_cache(tmp_path) -> None:  # noqa: ANN001
    data = os.urandom(10_000)
    assert _stream(str(tmp_path / "f"), data, 1000) is False
    assert (tmp_path / "f").read_bytes() == data


@ext4
def test_the_disk_filling_with_writes_in_flight_raises_enospc(small_disk: str) -> None:
    """8 MiB onto a 4 MiB ext4, four writes in flight: the error reaches the caller, whichever write met it."""
    with pytest.raises(OSError) as err:
        _stream(os.path.join(small_disk, "f"), os.urandom(8 << 20), 256 << 10, in_flight=4)
    assert err.value.errno == errno.ENOSPC


def test_a_file_system_that_refuses_direct_writes_gets_the_same_bytes_buffered(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A device of larger alignment answers a direct write ``EINVAL``: the writer clears ``O_DIRECT`` and writes on.
    (No such device can be made here: the refusal is a double.)"""
    real = os.pwrite

    def pwrite(fd: int, buf: memoryview, pos: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, buf, pos)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    data = os.urandom(5 * ALIGN + 17)
    assert _stream(str(tmp_path / "f"), data, 2 * ALIGN) is False
    assert (tmp_path / "f").read_bytes() == data


def test_both_writes_in_flight_refused_direct_are_both_written_buffered(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Two writes sent direct, both refused: both are written again buffered (the second to fail used to see the file
    already switched by the first and give up, "Invalid argument"). The refusal is a double, slow enough to overlap."""
    import time

    real = os.pwrite

    def pwrite(fd: int, buf: memoryview, pos: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            time.sleep(0.05)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, buf, pos)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    data = os.urandom(4 * ALIGN)
    assert _stream(str(tmp_path / "f"), data, ALIGN) is False
    assert (tmp_path / "f").read_bytes() == data


def test_no_thread_to_write_with_writes_on_the_callers(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A pids limit: the pool's second thread cannot start. The pool had queued that block's write before it tried,
    and its first thread took it later, from a buffer refilled meanwhile (wrong bytes in a shard called durable).
    The writer now stops the pool and writes every later block on the calling thread."""
    import threading

    real_start, started = threading.Thread.start, []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("ckptd-write"):
            started.append(self.name)
            if len(started) > 1:
                raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    data = os.urandom(9 * ALIGN + 9)  # ten blocks through three buffers: each refilled several times
    _stream(str(tmp_path / "f"), data, ALIGN)
    assert len(started) == 2 and (tmp_path / "f").read_bytes() == data


def test_a_shard_write_that_fails_otherwise_than_by_the_disk_leaves_no_partial_file(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Any error while writing a shard removes what was written of it (only OSError was cleaned up before)."""
    import torch
    from _shards import shard_bytes

    from ckptd.storage import local

    def submit(self: StreamWriter, n: int) -> None:
        raise MemoryError("no memory for the block")

    buf = shard_bytes([("model/w", torch.ones(64, 64), (64, 64), (0, 0))])
    monkeypatch.setattr(StreamWriter, "submit", submit)
    with pytest.raises(MemoryError):
        local.write_shard(str(tmp_path), local.ShardWrite("j", 1, 0, 1, memoryview(buf), len(buf), {}))
    assert os.listdir(tmp_path / "j" / "step-1.tmp") == []


def test_a_write_that_makes_no_progress_fails_instead_of_spinning(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A file system whose pwrite returns 0 without an error (a buggy FUSE one): the persist thread looped forever, its
    step never durable and never failed. It fails now, as a disk error does."""
    monkeypatch.setattr(direct.os, "pwrite", lambda fd, buf, pos: 0)
    with pytest.raises(OSError, match="wrote nothing") as info:
        _stream(str(tmp_path / "f"), os.urandom(3 * ALIGN), ALIGN)
    assert info.value.errno == errno.EIO


def test_fallocate_cut_short_by_signals_over_and_over_gives_up_reserving(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """tmpfs returns EINTR when a signal is pending and gives back what it allocated: a retry loop could run for as long
    as signals keep coming. After a bounded number of tries the file is written without its blocks reserved."""
    import ctypes

    calls = []

    class Libc:
        def __init__(self) -> None:
            self.fallocate = self

        def __call__(self, *args: object) -> int:
            calls.append(args)
            return -1

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Libc())
    monkeypatch.setattr(ctypes, "get_errno", lambda: errno.EINTR)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        direct.reserve(fd, 10 * ALIGN)
    finally:
        os.close(fd)
    assert len(calls) == direct.MAX_INTERRUPTED + 1


def test_only_the_last_block_may_be_short(tmp_path) -> None:  # noqa: ANN001
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with StreamWriter(fd, ALIGN, 4 * ALIGN) as w:
            w.block()
            w.submit(10)
            w.block()
            with pytest.raises(ValueError, match="only the last block may be short"):
                w.submit(ALIGN)
    finally:
        os.close(fd)


def _cached_fraction(path: str) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` over a read-only mapping; nothing is read)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if libc.mincore(base, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(base, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / len(vec)


@ext4
@pytest.mark.parametrize("flag", ["--direct-io", "--no-direct-io"])
def test_the_daemon_persists_past_the_page_cache_unless_told_not_to(small_disk: str, make_daemon, flag: str) -> None:  # noqa: ANN001
    """A persisted shard's pages are not left in the page cache (the node's memory is the trainer's), unless
    ``--no-direct-io`` (a file system where direct writes are slow) asks for the old way."""
    import torch
    from _models import make, train_step

    from ckptd.layout import shard_name

    daemon = make_daemon(flag, start=False)
    daemon.root = small_disk
    daemon.start()
    model, optim = make()
    model.register_buffer("bulk", torch.randn(256 << 10))  # 1 MiB: the shard spans many pages
    train_step(model, optim, 0)
    with daemon.client("j") as c:
        path = c.snapshot(model, optim, step=1).wait(30)
    cached = _cached_fraction(os.path.join(path, shard_name(0)))
    assert cached < 0.1 if flag == "--direct-io" else cached > 0.9


@ext4
def test_a_shard_too_large_for_the_disk_fails_before_a_byte_is_written(small_disk: str, monkeypatch) -> None:  # noqa: ANN001
    """The persist used to write until the disk was full (for every other user of it too), then fail; its blocks are
    allocated first now, and the allocation fails."""
    import torch
    from _shards import shard_bytes

    from ckptd.errors import CheckpointError
    from ckptd.storage import local

    written: list[int] = []
    real = StreamWriter.submit
    monkeypatch.setattr(StreamWriter, "submit", lambda self, n: (written.append(n), real(self, n)))
    buf = shard_bytes([("model/w", torch.ones(2048, 1024), (2048, 1024), (0, 0))])  # 8 MiB onto a 4 MiB disk
    with pytest.raises(CheckpointError, match="No space left on device"):
        local.write_shard(small_disk, local.ShardWrite("j", 1, 0, 1, memoryview(buf), len(buf), {}))
    assert written == [] and os.listdir(os.path.join(small_disk, "j", "step-1.tmp")) == []
    st = os.statvfs(small_disk)
    assert st.f_bavail * st.f_frsize > 2 << 20  # what the failed allocation took is free again
