"""The GPU path, kept small and apart: page-locked staging slots and device-to-host copies on a
side stream, guarded by an event; and, for restores, host-to-device copies from page-locked memory
(:class:`Uploads`). Nothing here runs without CUDA.

Who calls what (trainer process): the client pins a slot's mapping (``pin``) the first time a
snapshot has CUDA tensors to copy into it and unpins it before unmapping (``unpin``); ``copy_async``
runs on the training thread inside ``snapshot()`` and only enqueues work; the returned event is
synchronized by the thread that commits (the background thread, or ``snapshot()`` itself when
blocking) before the daemon is told the bytes are there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("ckptd.cuda")

_side_streams: dict[int, Any] = {}
_warned = False
REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: page-locked for every GPU of the process
REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the restore's mappings are read-only


def available() -> bool:
    return torch.cuda.is_available()


def pin(ptr: int, size: int, flags: int = 0) -> bool:
    """Page-lock ``size`` bytes of mapped shared memory at ``ptr`` (``cudaHostRegister``) so device
    copies into or out of it run at full PCIe/NVLink speed and can be asynchronous. False if it cannot
    be (``flags``: :data:`REGISTER_READ_ONLY` for a read-only mapping)."""
    global _warned
    if not available() or size == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, flags)
        code = int(getattr(err, "value", err))
    except (RuntimeError, AttributeError, TypeError) as e:
        code, err = -1, e
    if code != 0:
        _clear_error()
        if not _warned:
            log.warning("cudaHostRegister of shared memory failed (%s): device copies go through pageable or bounce memory", err)
            _warned = True
        return False
    return True


def _clear_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration: torch checks it after its next
    kernel launch and would raise it there. Through the ``libcudart`` torch loaded; a no-op without one."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError) as e:
        log.debug("could not reset the CUDA runtime's last error: %s", e)


def unpin(ptr: int) -> None:
    try:
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        code = int(getattr(err, "value", err))
    except (RuntimeError, AttributeError, TypeError) as e:
        code, err = -1, e
    if code != 0:
        _clear_error()
        log.warning("cudaHostUnregister failed: %s", err)


def copy_async(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
    """Enqueue device-to-host copies of CUDA ``srcs`` into ``dsts`` on a side stream; return the event
    that marks their end. The side stream first waits for the work already queued on the current
    stream, so the copy sees the state as of this call."""
    device = srcs[0].device
    stream = _side_streams.get(device.index or 0)
    if stream is None:
        stream = _side_streams[device.index or 0] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for dst, src in zip(dsts, srcs):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


class Uploads:
    """Host-to-device copies of one restore onto one GPU: non-blocking, on a side stream that waits for
    the work queued on the current stream before each chunk (a destination made just before, such as a
    fresh optimizer state's ``zeros_like``, is filled first), from page-locked memory.

    Sources: a read-only mapping of a daemon segment is page-locked once per reader (``cudaHostRegister``,
    read-only and portable to every GPU; ``registered`` is the reader's, shared by its devices) the first
    time a copy reads it, and copied from in place; where that fails its bytes go through a page-locked
    scratch buffer. Disk reads land in two page-locked buffers used in turn: those of a restore's
    read-ahead thread (:meth:`pinned`, refilled after :meth:`fence`), else this scratch pair (a single
    :meth:`~.reader.CheckpointReader.read_into`); one is refilled only after its previous copy ended.
    :meth:`finish` waits for every copy and gives the scratch memory back; the reader's ``close`` calls
    it, then unregisters (:func:`unregister`), before anything is unmapped.
    """

    def __init__(self, device: torch.device, registered: dict[int, bool]) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._scratch = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self._busy: list[Any] = [None, None]  # the event after each scratch buffer's last copy
        self._turn = 0
        self._registered = registered  # mapping's base address -> page-locked by this reader
        self._made: list[Any] = []  # the release of each page-locked block made by pinned() (finish() calls them)
        self._lock = threading.Lock()  # pinned() is called by several reading threads at once

    def staging(self, n: int) -> torch.Tensor:
        """A page-locked buffer of ``n`` bytes no copy still reads (the other one of the pair)."""
        i = self._turn = 1 - self._turn
        if self._busy[i] is not None:
            self._busy[i].synchronize()
            self._busy[i] = None
        if self._scratch[i].numel() < n:
            self._scratch[i] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return self._scratch[i][:n]

    def pinned(self, n: int) -> torch.Tensor:
        """A page-locked buffer of ``n`` bytes for :class:`.readahead.ReadAhead` or a :class:`.hotread.HotRead` thread
        (fenced by :meth:`fence`), made on the calling thread (:func:`.pinned.page_locked`: on huge pages where it can)."""
        from .pinned import page_locked

        with torch.cuda.device(self.device):
            buf, release, _ = page_locked(n, lambda addr, size: pin(addr, size, REGISTER_PORTABLE), unpin)
        with self._lock:
            self._made.append(release)
        return buf

    def fence(self) -> Any:
        """An event after every copy enqueued so far: a read-ahead buffer is refilled once it has passed."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def register(self, view: torch.Tensor) -> bool:
        """Page-lock the whole read-only mapping ``view`` lies in, once per reader; False if the driver refused."""
        storage = view.untyped_storage()
        base = storage.data_ptr()
        if base not in self._registered:
            with torch.cuda.device(self.device):
                self._registered[base] = pin(base, storage.nbytes(), REGISTER_READ_ONLY | REGISTER_PORTABLE)
        return self._registered[base]

    def register_range(self, ptr: int, size: int) -> bool:
        """Page-lock ``size`` bytes of a read-only mapping at ``ptr`` (:mod:`.hotreg`, range by range); the reader
        unregisters it with the others once the copies have ended. False if the driver refused."""
        with torch.cuda.device(self.device):
            self._registered[ptr] = ok = pin(ptr, size, REGISTER_READ_ONLY | REGISTER_PORTABLE)
        return ok

    def host_source(self, view: torch.Tensor) -> torch.Tensor:
        """``view`` (of a read-only mapping) if its mapping is page-locked, else its bytes in a page-locked buffer."""
        if self.register(view):
            return view
        buf = self.staging(view.numel())
        buf.copy_(view)
        return buf

    def after_current(self) -> None:
        """Copies enqueued on the side stream from here on run after the work queued so far on the caller's current stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def bind(self) -> None:
        """Make this GPU and the side stream the calling thread's current ones: for :class:`.hotread.HotRead`'s
        own threads, which only copy; order the stream after the current one first (:meth:`after_current`)."""
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)

    @contextmanager
    def stream_for(self, raw: torch.Tensor) -> Iterator[None]:
        """Copies made inside run on the side stream, after the current stream's work; a scratch buffer
        ``raw`` lies in stays busy until they end. Destinations: :meth:`keep`."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
            ptr = raw.untyped_storage().data_ptr()
            for i, buf in enumerate(self._scratch):
                if buf.numel() and buf.untyped_storage().data_ptr() == ptr:
                    self._busy[i] = torch.cuda.Event()
                    self._busy[i].record(self.stream)

    def keep(self, dst: torch.Tensor) -> None:
        """``dst`` is written on the side stream: its memory is not reused before that copy ends."""
        dst.record_stream(self.stream)

    def finish(self) -> None:
        """Wait for every copy (the current stream orders after them) and give the page-locked scratch back."""
        try:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        finally:
            self._busy = [None, None]
            with self._lock:
                made, self._made = self._made, []
            for release in made:  # no copy reads them any more (or the stream failed: the process is past copying)
                release()
            grown = bool(made) or any(b.numel() for b in self._scratch)
            self._scratch = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
            empty = getattr(torch._C, "_host_emptyCache", None)
            if grown and empty is not None:
                empty()  # the caching host allocator would keep the scratch page-locked for the whole process


def let_go(registered: dict[int, bool], maps: list[Any], away: int) -> None:
    """Undo a closed reader's registrations (every copy from them has ended), then unmap its mappings ``maps``. Where
    these hold ``away`` bytes or more, both run on a thread of their own, made current on this thread's GPU first (a
    thread on no GPU would open a context on GPU 0): for 6 GB on 2 MiB pages, unregistering took 42-55 ms on an H200
    host (``docs/bench/gpu/restore_paths_huge_h200.log``), and unmapping 0.11-0.15 s on 4 KiB pages on an H100 host,
    which the restore need not wait for: nothing reads these pages any more."""
    held = dict(registered)
    registered.clear()
    if sum(len(mm) for mm in maps) >= away:
        device = torch.cuda.current_device() if any(held.values()) else None
        try:
            threading.Thread(target=_let_go, args=(held, maps, device), name="ckptd-unmap", daemon=True).start()
            return
        except RuntimeError as e:  # no thread to be had: here
            log.debug("unregistering and unmapping on this thread: %s", e)
    _let_go(held, maps, None)


def _let_go(held: dict[int, bool], maps: list[Any], device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)
    unregister(held)
    for mm in maps:
        mm.close()


def unregister(registered: dict[int, bool]) -> None:
    """Undo a reader's registrations (after every copy from them ended)."""
    for base, ok in registered.items():
        if ok:
            unpin(base)
    registered.clear()
