"""Read saved chunks from shard files on a thread, ahead of the thread that verifies and copies them.

A restore from disk used to read a chunk, then hash it, then copy it, then read the next: the disk
idled while the CPU worked and the reverse. :class:`ReadAhead` knows the exact chunks a restore will
take, in order (:meth:`.reader.CheckpointReader.read_many` plans them first), groups chunks that lie
next to each other in one file into *runs* of up to :data:`RUN_BYTES` (one ``pread`` for many small
tensors), and reads run ``i + 1`` into one buffer while the caller works on run ``i`` in the other
(for a GPU destination: page-locked buffers, refilled once the DMA from them has ended). Only the
chunks taken are read (a restore at another world size reads parts of several files); memory held:
two buffers of the largest run (``RUN_BYTES``, or the largest chunk read ahead: at most ``CHUNK_MAX``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FormatError

RUN_BYTES = 16 << 20  # chunks adjacent in a file are read together, up to this many bytes per read
CHUNK_MAX = 256 << 20  # a chunk larger than this is not read ahead (two buffers of it would cost too much memory)
GAP_BYTES = 4096  # ... across alignment padding up to this many bytes


@dataclass
class Run:
    """One read: bytes ``[start, end)`` of file ``name``, holding the next ``count`` chunks taken."""

    name: str
    start: int
    end: int
    count: int


def plan_runs(chunks: list[dict[str, Any]]) -> list[Run]:
    """Group ``chunks`` (manifest chunk entries, in the order they will be taken; one may repeat) into runs."""
    runs: list[Run] = []
    for c in chunks:
        b, e = c["byte_range"]
        r = runs[-1] if runs else None
        if r is not None and r.name == c["file"] and r.start <= b and e <= r.end:
            r.count += 1  # within the run already (the same chunk taken again)
        elif r is not None and r.name == c["file"] and r.end <= b <= r.end + GAP_BYTES and e - r.start <= RUN_BYTES:
            r.end, r.count = e, r.count + 1
        else:
            runs.append(Run(c["file"], b, e, 1))
    return runs


def _pageable(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


class ReadAhead:
    """Hands out the raw bytes of the planned chunks in order (:meth:`take`), read one run ahead on a
    thread. ``pread(name, into, offset)`` reads into a ``uint8`` tensor and returns the bytes read; it
    must be safe to call off the caller's thread (file descriptors opened beforehand).

    ``alloc(n)`` makes the two buffers, on the caller's thread (page-locked ones for a GPU destination);
    ``init()`` runs first on the thread (it sets the thread's GPU).
    ``fence()``, if given, is called when the caller is done with a run's buffer and returns something
    whose ``synchronize()`` the thread waits for before refilling it (a CUDA event after the copies
    still reading it). Use as a context manager: leaving it stops and joins the thread, whatever happened."""

    def __init__(
        self,
        chunks: list[dict[str, Any]],
        pread: Callable[[str, torch.Tensor, int], int],
        where: Callable[[str], str],
        *,
        alloc: Callable[[int], torch.Tensor] = _pageable,
        fence: Callable[[], Any] | None = None,
        init: Callable[[], None] | None = None,
    ) -> None:
        self._runs = plan_runs(chunks)
        self._pread, self._where, self._fence, self._init = pread, where, fence, init
        size = max((r.end - r.start for r in self._runs), default=0)
        self._free: queue.SimpleQueue[tuple[torch.Tensor, Any]] = queue.SimpleQueue()
        for _ in range(2):
            self._free.put((alloc(size), None))
        self._filled: queue.SimpleQueue[tuple[Run, torch.Tensor] | BaseException | None] = queue.SimpleQueue()
        self._stop = False
        self._run: Run | None = None  # the run being taken from, its buffer, and how many of its chunks are left
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._left = 0
        self._thread = threading.Thread(target=self._work, name="ckptd-readahead", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        if self._init is not None:  # the thread's GPU: a fence waited for elsewhere would make a context on GPU 0
            try:
                self._init()
            except BaseException as e:
                self._filled.put(e)
                return
        for run in self._runs:
            buf, done = self._free.get()  # waits until the caller is done with the run before last
            if self._stop:
                return
            n = run.end - run.start
            try:
                if done is not None:
                    done.synchronize()  # copies still reading this buffer (a GPU's DMA) have ended
                if self._pread(run.name, buf[:n], run.start) != n:
                    raise FormatError(f"{self._where(run.name)} ends inside bytes {run.start}-{run.end}: truncated")
            except BaseException as e:  # handed to the caller, who raises it
                self._filled.put(e)
                return
            self._filled.put((run, buf))
        self._filled.put(None)

    def take(self, c: dict[str, Any]) -> torch.Tensor:
        """The raw (unverified) bytes of the next planned chunk, which must be ``c``: a view valid until the
        next call (which may hand its buffer back to the thread)."""
        if self._left == 0:
            if self._run is not None:  # the thread may refill it now (after the fence, if any)
                self._free.put((self._buf, self._fence() if self._fence is not None else None))
            got = self._filled.get()
            if got is None:
                raise RuntimeError("more chunks taken than were planned")
            if isinstance(got, BaseException):
                raise got
            (self._run, self._buf), self._left = got, got[0].count
        run = self._run
        assert run is not None
        b, e = c["byte_range"]
        if c["file"] != run.name or not (run.start <= b and e <= run.end):
            raise RuntimeError(f"chunk {c['file']} {b}-{e} taken out of the planned order")
        self._left -= 1
        return self._buf[b - run.start : e - run.start]

    def close(self) -> None:
        self._stop = True
        for _ in range(2):  # wakes the thread if it waits for a buffer
            self._free.put((torch.empty(0, dtype=torch.uint8), None))
        self._thread.join()
        # let go of the buffers now (page-locked ones go back before the reader gives the host cache back),
        # even while a traceback still holds this object
        self._buf = torch.empty(0, dtype=torch.uint8)
        for q in (self._free, self._filled):
            while not q.empty():
                q.get_nowait()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
