"""A hot restore's flat chunks, read from the daemon's segments by several threads with ``pread``.

A *flat* chunk is a saved chunk that fills a contiguous part of its destination whole, in the saved dtype
(every chunk of a restart in the same layout): its bytes are the destination's bytes. Threads take runs of
them (chunks adjacent in a segment, up to :data:`SLOT_BYTES` together, or one larger chunk in
``SLOT_BYTES`` parts) and:

* into a CPU destination, ``pread`` the chunk straight into the destination's memory: one copy, no mapping;
* into a GPU destination, ``pread`` into one of the thread's two page-locked slots and enqueue the copy
  into the destination on the restore's side stream; a slot is read into again once the copy from it
  has ended (an event).

Either way a chunk is read :data:`PIECE_BYTES` at a time and each piece is hashed (XXH3) right after it is read,
while it is still in the core's caches, not after the whole chunk or slot is read (then every byte came from memory
once more). Not smaller: each piece takes the GIL back twice, and with 16 threads 1 MiB pieces cost a 6 GB restore
90 ms more than 4 MiB ones on an H200 host (``docs/bench/gpu/restore_paths_h200.log``).

Why not map the segments, page-lock the mapping (``cudaHostRegister``) and copy from it, as before:
on an H100 host the registration of 6 GB took 0.3-0.5 s on one thread (the driver serializes it: more
threads gained nothing), building the page tables 0.45-0.6 s and unmapping 0.1-0.15 s, all for one
copy of 0.11 s; reading the same bytes with ``pread`` needs no page tables, and page-locked slots of a
few MiB cost milliseconds. The threads release the GIL in ``pread``, XXH3 and the copy.

A checksum mismatch raises :class:`FormatError` once every thread has stopped (the destination may then
hold the bad bytes; a hot restore goes back to the disk's copy on it); threads stop taking runs after
the first error. Memory held: two slots per thread, only for GPU destinations. Each thread makes the side
stream its current one once, and a destination is handed to the stream once: per read, only the read,
the hash, the copy and an event take the GIL back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FormatError
from ..format import digester

SLOT_BYTES = 8 << 20  # one pread into a page-locked slot; chunks adjacent in a segment are read together up to this
WORKERS = 16  # reading threads at most (on an H100 host, 16 read 6 GB faster than 8 or 12)
GAP_BYTES = 4096  # chunks are read together across alignment padding up to this many bytes
PIECE_BYTES = 4 << 20  # read and hashed at a time (H200 host, 6 GB on 16 threads: 1 MiB 341 ms, 4 MiB 248-261, 8 MiB 248-260)


def thread_share() -> int:
    """Reading threads for this rank: :data:`WORKERS` at most, and the cores it may run on shared among the ranks of
    its node (torchrun's ``LOCAL_WORLD_SIZE``), which restart and restore together. A rank bound to cores of its own
    (an affinity narrower than the machine) has its share already. Each thread holds two page-locked slots."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if cpus >= (os.cpu_count() or cpus) and local.isdigit() and int(local) > 1:
        cpus //= int(local)
    return max(1, min(WORKERS, cpus))


@dataclass
class Flat:
    """Saved chunk ``c`` (a manifest chunk entry) of tensor ``key``, whose bytes are all of ``dst``'s (``uint8``,
    contiguous), on GPU ``device`` (None: on the CPU)."""

    key: str
    c: dict[str, Any]
    dst: torch.Tensor
    device: torch.device | None


@dataclass
class Run:
    """Bytes ``[start, end)`` of segment ``name``, holding every byte of ``flats``; ``device``: theirs (None: CPU)."""

    name: str
    start: int
    end: int
    device: torch.device | None
    flats: list[Flat] = field(default_factory=list)


def plan(flats: list[Flat], slot: int = SLOT_BYTES) -> list[Run]:
    """Group ``flats`` into runs (one read, or one large chunk read part by part), largest first."""
    order = sorted(flats, key=lambda f: (str(f.device), f.c["file"], f.c["byte_range"][0]))
    runs: list[Run] = []
    for f in order:
        b, e = f.c["byte_range"]
        r = runs[-1] if runs else None
        same = r is not None and r.name == f.c["file"] and r.device == f.device
        if same and tuple(r.flats[-1].c["byte_range"]) == (b, e):  # type: ignore[union-attr]
            r.flats.append(f)  # type: ignore[union-attr]  # (the same chunk again, into another destination)
        elif same and r.end <= b <= r.end + GAP_BYTES and e - r.start <= slot:  # type: ignore[union-attr]
            r.end = e  # type: ignore[union-attr]
            r.flats.append(f)  # type: ignore[union-attr]
        else:
            runs.append(Run(f.c["file"], b, e, f.device, [f]))
    runs.sort(key=lambda r: r.end - r.start, reverse=True)  # the longest first: no thread is left with one at the end
    return runs


def pread_into(fd: int, into: torch.Tensor, offset: int, seen: Callable[[int, memoryview], None] | None = None) -> int:
    """Read into the CPU ``uint8`` tensor ``into`` from ``offset``; the bytes read (fewer only at the file's end).
    ``seen(pos, piece)`` is handed each piece read (``pos``: its place in ``into``), :data:`PIECE_BYTES` at a time,
    while the piece is still in the core's cache: hashing the whole of ``into`` after the read took every byte from
    memory once more (1 GB on two threads here: 0.124-0.156 s piece by piece, 0.152-0.188 s read whole, then hashed;
    ``benchmarks/copy_hash.py``)."""
    view = memoryview(into.numpy())
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got : got + PIECE_BYTES] if seen is not None else view[got:]], offset + got)
        if n == 0:
            break
        if seen is not None:
            seen(got, view[got : got + n])
        got += n
    return got


class Spans:
    """The checksums of chunks at byte ranges ``[b, e)`` of one buffer, computed piece by piece as it is read
    (:func:`pread_into`'s ``seen``); a range listed twice (one chunk into two destinations) is hashed once."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self._spans = sorted(set(spans))
        self._hashers = {s: digester() for s in self._spans}
        self._first = 0  # the spans before it ended before the pieces seen so far (pieces come in order)

    def seen(self, pos: int, piece: memoryview) -> None:
        end, spans = pos + len(piece), self._spans
        while self._first < len(spans) and spans[self._first][1] <= pos:
            self._first += 1
        for i in range(self._first, len(spans)):
            b, e = spans[i]
            if b >= end:
                break
            if e > pos:  # (a span inside another one, of a forged manifest, may have ended already)
                self._hashers[(b, e)].update(piece[max(b, pos) - pos : min(e, end) - pos])

    def hexdigest(self, b: int, e: int) -> str:
        return str(self._hashers[(b, e)].hexdigest())


class _Slots:
    """One thread's two page-locked slots, used in turn, each refilled once the copies from it have ended."""

    def __init__(self, up: Any, slot: int) -> None:
        both = up.pinned(2 * slot)
        self.bufs = [both[:slot], both[slot:]]
        self.done: list[Any] = [None, None]
        self.turn = 0

    def next(self) -> tuple[int, torch.Tensor]:
        i = self.turn = 1 - self.turn
        if self.done[i] is not None:
            self.done[i].synchronize()
            self.done[i] = None
        return i, self.bufs[i]

    def fence(self, i: int, up: Any) -> None:
        """Slot ``i`` is read into again once the copies enqueued so far on ``up``'s stream (the GPU they went to) end."""
        self.done[i] = up.fence()

    def drain(self) -> None:
        for ev in self.done:
            if ev is not None:
                ev.synchronize()
        self.done = [None, None]


class HotRead:
    """Reads :class:`Flat` chunks from the segments ``fds`` (name -> open descriptor, size-checked) with ``workers``
    threads (default: :func:`thread_share`). ``upload(device)`` gives a GPU's :class:`.cuda.Uploads` (its side
    stream, slots, fences). ``where(name)`` names a segment in errors."""

    def __init__(
        self,
        fds: dict[str, int],
        where: Callable[[str], str],
        upload: Callable[[torch.device], Any],
        *,
        workers: int | None = None,
        slot: int = SLOT_BYTES,
    ) -> None:
        self.fds, self.where, self.upload = fds, where, upload
        self.workers, self.slot = max(1, thread_share() if workers is None else workers), slot
        self._lock = threading.Lock()
        self._runs: Iterator[Run] = iter(())
        self._errors: list[BaseException] = []
        self._stop = False  # the caller was interrupted: threads take no more runs

    def read(self, flats: list[Flat]) -> None:
        """Fill every destination of ``flats``; raise the first checksum mismatch, else the first other error."""
        runs = plan(flats, self.slot)
        for dev in {r.device for r in runs if r.device is not None}:
            self.upload(dev).after_current()  # destinations made just before (zeros_like) are written after
        self._runs, self._errors = iter(runs), []
        # threads of their own (not this one too): each makes a GPU's side stream its current one, once
        started: list[threading.Thread] = []
        try:
            for i in range(min(self.workers, len(runs))):
                t = threading.Thread(target=self._work, name=f"ckptd-hotread-{i}", daemon=True)
                t.start()
                started.append(t)
            for t in started:
                t.join()
        except BaseException:  # Ctrl-C in a join, no thread to be had: no thread may read on once the caller closes the segments
            with self._lock:
                self._stop = True
            for t in started:
                _join(t)
            raise
        if self._errors:
            self._errors.sort(key=lambda e: not isinstance(e, FormatError))  # a mismatch sends a hot restore to the disk: first
            raise self._errors[0] from (self._errors[1] if len(self._errors) > 1 else None)

    def _next(self) -> Run | None:
        with self._lock:
            return None if self._errors or self._stop else next(self._runs, None)

    def _work(self) -> None:
        slots: _Slots | None = None
        bound: torch.device | None = None  # the GPU whose side stream is this thread's current one
        try:
            while (run := self._next()) is not None:
                if run.device is None:
                    self._to_host(run)
                    continue
                if run.device != bound:
                    self.upload(run.device).bind()
                    bound = run.device
                if slots is None:  # (from the first GPU's Uploads: page-locked memory serves every GPU)
                    slots = _Slots(self.upload(run.device), self.slot)
                self._to_device(run, slots, self.upload(run.device))
        except BaseException as e:  # handed to read(), which raises it
            with self._lock:
                self._errors.append(e)
        finally:
            if slots is not None:
                slots.drain()  # a slot is not given back while a copy still reads it

    def _read(self, run: Run, into: torch.Tensor, offset: int, seen: Callable[[int, memoryview], None] | None = None) -> None:
        if pread_into(self.fds[run.name], into, offset, seen) != into.numel():
            raise FormatError(f"{self.where(run.name)} ends inside bytes {offset}-{offset + into.numel()}: truncated")

    def _check(self, f: Flat, got: str | None) -> None:
        if f.c["xxh3_64"] is not None and got != f.c["xxh3_64"]:
            b, e = f.c["byte_range"]
            raise FormatError(f"checksum mismatch in {self.where(f.c['file'])} (tensor {f.key!r}, bytes {b}-{e}): the segment is corrupt")

    def _to_host(self, run: Run) -> None:
        for f in run.flats:  # straight into the destination, hashed as it is read
            h = digester() if f.c["xxh3_64"] is not None else None
            self._read(run, f.dst, f.c["byte_range"][0], _feeding(h))
            self._check(f, h.hexdigest() if h is not None else None)

    def _to_device(self, run: Run, slots: _Slots, up: Any) -> None:
        for f in run.flats:
            up.keep(f.dst)  # written on the side stream
        if run.end - run.start <= self.slot:  # one read: chunks next to each other, hashed as they are read
            i, buf = slots.next()
            raw = buf[: run.end - run.start]
            checked = [f for f in run.flats if f.c["xxh3_64"] is not None]
            spans = Spans([(f.c["byte_range"][0] - run.start, f.c["byte_range"][1] - run.start) for f in checked])
            self._read(run, raw, run.start, spans.seen if checked else None)
            for f in run.flats:
                b, e = f.c["byte_range"]
                self._copy(f.dst, raw[b - run.start : e - run.start])
                self._check(f, spans.hexdigest(b - run.start, e - run.start) if f.c["xxh3_64"] is not None else None)
            slots.fence(i, up)
            return
        b, e = run.start, run.end  # one chunk larger than a slot (perhaps into several destinations)
        h = digester() if run.flats[0].c["xxh3_64"] is not None else None
        for pos in range(b, e, self.slot):
            i, buf = slots.next()
            raw = buf[: min(self.slot, e - pos)]
            self._read(run, raw, pos, _feeding(h))
            for f in run.flats:
                self._copy(f.dst[pos - b : pos - b + raw.numel()], raw)
            slots.fence(i, up)
        for f in run.flats:
            self._check(f, h.hexdigest() if h is not None else None)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # on the thread's current stream: the side stream (bound)


def _feeding(hasher: Any) -> Callable[[int, memoryview], None] | None:
    """A :func:`pread_into` ``seen`` that hands every piece to ``hasher`` (None: nothing to hash, nothing seen)."""
    if hasher is None:
        return None
    return lambda _pos, piece: hasher.update(piece)


def _join(t: threading.Thread) -> None:
    """Join ``t`` even through further interrupts (it stops after the run it is reading)."""
    while t.is_alive():
        try:
            t.join()
        except BaseException:  # noqa: S110  (a second Ctrl-C: still wait, the thread reads memory the caller frees)
            continue
