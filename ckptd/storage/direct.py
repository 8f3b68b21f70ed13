"""Writing a new file front to back from blocks the caller fills, with direct I/O where the file system takes it.

A shard written through the page cache costs the node a second copy of every byte (into the cache), then the
kernel's reclaim of those pages, CPU time the trainer's step pays for on a small node. Written with ``O_DIRECT``
from page-aligned buffers, two writes in flight, a 1.06 GB persist took 0.39–1.10 s where a plain buffered write +
fsync of the same bytes took 0.51–2.92 s (``benchmarks/persist_restore.py`` on the 2-core development VM, docs/performance.md
"Persist and restore"). The file's pages are then not in the page cache: a restore from disk right after a persist
reads the disk (a restore from the daemon's memory reads no disk either way).

Where ``O_DIRECT`` cannot be set, or a direct write is refused (``EINVAL``: a file system or a device with a larger
alignment), the file is written through the page cache, as before: the bytes on disk are the same either way.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

ALIGN = 4096  # offsets, lengths and buffers of direct writes: a multiple of every common logical block size
IN_FLIGHT = 2  # writes queued at the device at once (one at a time left the disk idle between them)
MAX_INTERRUPTED = 100  # fallocate calls a signal may cut short before the file is written without its blocks reserved


def reserve(fd: int, nbytes: int) -> None:
    """Allocate the first ``nbytes`` of the file behind ``fd`` before writing them (Linux ``fallocate``; never glibc's
    ``posix_fallocate`` fallback, which writes a byte per block): a disk too full fails here (``OSError`` ENOSPC), before
    the write has filled it for the node's other users. A file system without ``fallocate`` is written as it comes."""
    import ctypes

    if nbytes <= 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
    except (OSError, AttributeError):
        return
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    size = -(-nbytes // ALIGN) * ALIGN  # with the padding of a direct last block (cut back by StreamWriter.finish)
    interrupted = 0
    while fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR and interrupted < MAX_INTERRUPTED:  # a signal (tmpfs checks for one): ctypes calls are not retried
            interrupted += 1
            continue
        if err == errno.EINTR:  # tmpfs gives back what it had allocated each time: signals this often would never let it end
            return
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # not supported here (EINVAL: some FUSE file systems)
            return
        raise OSError(err, os.strerror(err))


def _set_direct(fd: int, on: bool) -> bool:
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except (OSError, AttributeError):
        return False
    return on


class StreamWriter:
    """Writes the file behind ``fd`` (new, empty, opened for writing) from offset 0: :meth:`block` hands out a
    buffer of ``block`` bytes to fill, :meth:`submit` queues its first ``n`` bytes at the file's end (only the last
    block may be short), :meth:`finish` waits for every write and sets the file's length. Use as a context manager:
    leaving it waits for the writes in flight before their buffers are unmapped. Errors (``ENOSPC``...) are raised
    as ``OSError`` by :meth:`block`, :meth:`submit` or :meth:`finish`. ``direct`` tells whether the writes bypass
    the page cache; a ``block`` that is not a multiple of :data:`ALIGN` is written through it.
    """

    def __init__(self, fd: int, block: int, total: int, in_flight: int = IN_FLIGHT, direct: bool = True) -> None:
        self._fd, self._block, self._end, self._short = fd, block, 0, False
        blocks = max(1, -(-total // block))
        self.direct = direct and block % ALIGN == 0 and total >= ALIGN and _set_direct(fd, True)
        self._in_flight = max(1, min(in_flight, blocks - 1)) if blocks > 1 else 0
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # not shared memory: the node's /dev/shm is the trainers'
        self._bufs = [mmap.mmap(-1, block, flags=private) for _ in range(min(blocks, self._in_flight + 1))]
        self._next = 0
        self._pending: deque[Future[None]] = deque()
        self._pool = ThreadPoolExecutor(self._in_flight, thread_name_prefix="ckptd-write") if self._in_flight else None

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def block(self) -> mmap.mmap:
        """A buffer to fill next, whose write has finished (:meth:`submit` keeps fewer writes in flight than there
        are buffers). Fill it through a ``memoryview`` released before :meth:`close` (a ``with`` block)."""
        buf = self._bufs[self._next % len(self._bufs)]
        self._next += 1
        return buf

    def submit(self, n: int) -> None:
        """Write the first ``n`` bytes of the buffer :meth:`block` handed out last, at the file's end."""
        if self._short:
            raise ValueError("a short block was already written: only the last block may be short")
        buf, pos = self._bufs[(self._next - 1) % len(self._bufs)], self._end
        self._end += n
        self._short = n < self._block
        future = None
        if self._pool is not None:
            try:
                future = self._pool.submit(self._write, buf, n, pos)
            except RuntimeError:  # no thread could be started (a pids limit): from here on, written on this one
                self._no_threads()
        if future is None:
            self._write(buf, n, pos)
        else:
            self._pending.append(future)
        while len(self._pending) > self._in_flight:  # at most _in_flight: the next buffer round-robin is free
            self._pending.popleft().result()

    def _no_threads(self) -> None:
        """The pool could not start a thread, but it queued the write first and a thread it has may still take it:
        wait for every write in flight and stop the pool (queued writes cancelled, a started one finished) before
        this thread writes the block again and refills any buffer."""
        assert self._pool is not None
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._in_flight = None, 0

    def finish(self) -> None:
        """Wait for every write, then give the file its length (a direct write of a short last block is padded)."""
        while self._pending:
            self._pending.popleft().result()
        os.ftruncate(self._fd, self._end)

    def close(self) -> None:
        """Wait for the writes in flight (their errors dropped: :meth:`finish` reports them), release the buffers."""
        while self._pending:
            try:
                self._pending.popleft().result()
            except Exception:  # reported by finish(); here only that no write still reads a buffer matters
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for b in self._bufs:
            try:
                b.close()
            except BufferError:  # a view of it is still held (an error's traceback): unmapped when that one goes
                pass
        self._bufs = []

    def _write(self, block: mmap.mmap, n: int, pos: int) -> None:
        if self.direct and n % ALIGN:  # the last block: padded to the alignment (within the block), cut back by finish()
            padded = -(-n // ALIGN) * ALIGN
            block[n:padded] = bytes(padded - n)
            n = padded
        done = 0
        with memoryview(block) as whole, whole[:n] as buf:  # released here, also when a write fails
            while done < n:
                was_direct = self.direct  # per attempt: the other writer thread may switch the file meanwhile
                try:
                    wrote = os.pwrite(self._fd, buf[done:], pos + done)
                    if wrote == 0:  # no progress and no error (a misbehaving FUSE file system): fail, never spin
                        raise OSError(errno.EIO, f"a write of {n - done} bytes at offset {pos + done} wrote nothing")
                    done += wrote
                except OSError as e:
                    if e.errno != errno.EINVAL or not was_direct:
                        raise
                    self.direct = _set_direct(self._fd, False)  # refused direct: the same bytes through the page cache
