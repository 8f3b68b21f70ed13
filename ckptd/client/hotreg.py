"""A hot restore into a GPU straight from the daemon's segments, where they sit on huge pages.

Each segment is mapped read-only and page-locked with ``cudaHostRegister`` range by range
(:data:`REGISTER_BYTES` at a time, in order, on the calling thread); the copies out of each range are enqueued on
the GPU's side stream right after it is registered, so they run behind the next registrations. A chunk across two
ranges is copied in two parts: CUDA refuses one copy from two registrations.
Meanwhile threads (:func:`.hotread.thread_share`) verify every chunk's checksum (XXH3) from the same pages; the
read returns, or raises the first mismatch as :class:`FormatError`, once every check has ended. The bytes cross
host memory twice (hashed, copied by DMA), not three times as through :mod:`.hotread`'s slots (read into a
slot, hashed there, copied out), and no page-locked memory is made.

Why only on huge pages: registering costs per page. On an H100 host, 5.9 GB registered in 108 ms on 2 MiB
pages and 485 ms on 4 KiB pages (``docs/bench/gpu/restore_paths_hugepages.log``, ``restore_paths.log``): on
4 KiB pages reading into page-locked slots is faster. :func:`path_for` picks by the file system holding the
segment (a tmpfs mounted ``huge=within_size`` or ``huge=always``, or the kernel's ``shmem_enabled`` set to
``force``); ``CKPTD_HOT_PATH`` (``pread`` or ``register``) sets it instead.

The checksum is taken from the segment's pages, and the DMA reads those pages again: the read trusts that no one
writes a committed step's segment meanwhile (the daemon pins it for the restore and hands its slot to no
snapshot; only its own user can write it). The copies may still run when :meth:`RegisteredRead.read` returns:
the reader's ``close`` waits for them, then unregisters every range (``Uploads.register_range`` records them)
and unmaps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..errors import FormatError
from .hotread import Flat, thread_share

log = logging.getLogger("ckptd.restore")

REGISTER_BYTES = 256 << 20  # one cudaHostRegister (a multiple of the page); the copies from it are enqueued right after it
PAGE = 4096
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
MOUNTS = "/proc/self/mounts"
PATHS = ("pread", "register")


def path_for(segment: str) -> str:
    """How a hot restore copies a GPU's chunks out of ``segment`` (a file): ``"register"`` where it sits on huge
    pages, else ``"pread"`` (:mod:`.hotread`); ``CKPTD_HOT_PATH`` (``auto``, ``pread`` or ``register``) overrides."""
    forced = os.environ.get("CKPTD_HOT_PATH", "auto")
    if forced in PATHS:
        return forced
    if forced != "auto":
        raise ValueError(f"CKPTD_HOT_PATH must be auto, pread or register, not {forced!r}")
    return "register" if huge_backed(segment) else "pread"


def huge_backed(path: str) -> bool:
    """True where the tmpfs holding ``path`` gives its files transparent huge pages."""
    try:
        with open(SHMEM_ENABLED) as f:
            shmem = f.read()
    except OSError:
        return False  # (no shmem huge pages in this kernel)
    if "[deny]" in shmem or "[force]" in shmem:
        return "[force]" in shmem
    mount = mount_of(os.path.realpath(os.path.dirname(path)))
    if mount is None or mount[0] != "tmpfs":
        return False
    return any(o in ("huge=always", "huge=within_size") for o in mount[1].split(","))


def mount_of(directory: str) -> tuple[str, str] | None:
    """(type, options) of the mount holding ``directory``: the longest mount point above it."""
    best: tuple[int, str, str] | None = None
    try:
        with open(MOUNTS) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 4:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = directory == point or directory.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) >= best[0]):
                    best = (len(point), fields[2], fields[3])
    except OSError:
        return None
    return None if best is None else (best[1], best[2])


class RegisteredRead:
    """Copies :class:`Flat` chunks into their GPUs from the registered pages of their segments. ``mapped(name)``: the
    segment mapped read-only (a ``uint8`` tensor the reader unmaps); ``upload(device)``: that GPU's ``Uploads``;
    ``check(key, c, raw)``: raises :class:`FormatError` on a checksum mismatch; ``where(name)``: names it in errors."""

    def __init__(
        self,
        mapped: Callable[[str], torch.Tensor],
        upload: Callable[[torch.device], Any],
        check: Callable[[str, dict[str, Any], torch.Tensor], None],
        where: Callable[[str], str],
        *,
        workers: int | None = None,
        register_bytes: int = REGISTER_BYTES,
    ) -> None:
        self.mapped, self.upload, self.check, self.where = mapped, upload, check, where
        self.workers = max(1, thread_share() if workers is None else workers)
        self.register_bytes = register_bytes

    def read(self, flats: list[Flat]) -> list[Flat]:
        """Copy every flat of ``flats`` (all on GPUs) and verify it; return those left uncopied because a registration
        was refused (for :class:`.hotread.HotRead`). Raises the first checksum mismatch, else the first other error."""
        segments: dict[str, list[Flat]] = {}
        for f in flats:
            segments.setdefault(f.c["file"], []).append(f)
        views = {name: self._view(name, group) for name, group in segments.items()}
        for dev in {f.device for f in flats}:
            self.upload(dev).after_current()  # destinations made just before (zeros_like) are written after
        unique = {(f.c["file"], *f.c["byte_range"]): f for f in flats if f.c["xxh3_64"] is not None}
        order = sorted(unique.values(), key=lambda f: f.c["byte_range"][0] - f.c["byte_range"][1])  # the largest first
        left: list[Flat] = []
        failed: BaseException | None = None
        with ThreadPoolExecutor(min(self.workers, max(1, len(order))), thread_name_prefix="ckptd-verify") as pool:
            checks = [pool.submit(self._verify, f, views[f.c["file"]]) for f in order]
            try:
                for name, group in segments.items():
                    left += self._copy_segment(views[name], group)
            except BaseException as e:  # (Ctrl-C too: the pool's exit still waits for the checks reading the mapping)
                failed = e
                for c in checks if not isinstance(e, Exception) else ():  # an interrupt: no check not yet started
                    c.cancel()
        for c in checks:  # a mismatch first, even before a copy's failure: it sends a hot restore to the disk's copy
            e = None if c.cancelled() else c.exception()
            if e is not None:
                raise e from failed
        if failed is not None:
            raise failed
        return left

    def _view(self, name: str, group: list[Flat]) -> torch.Tensor:
        view = self.mapped(name)
        end = max(f.c["byte_range"][1] for f in group)
        if end > view.numel():
            raise FormatError(f"{self.where(name)} ends inside bytes {view.numel()}-{end}: truncated")
        return view

    def _verify(self, f: Flat, view: torch.Tensor) -> None:
        b, e = f.c["byte_range"]
        self.check(f.key, f.c, view[b:e])

    def _copy_segment(self, view: torch.Tensor, group: list[Flat]) -> list[Flat]:
        """Register ``view`` range by range (:func:`ranges`) and enqueue the copies of each range's parts of chunks right
        after it; the flats not wholly copied (a range was refused: the rest of the segment is left to the caller)."""
        base = view.data_ptr()
        up0 = self.upload(group[0].device)  # registrations are portable: page-locked for every GPU of the process
        cuts = ranges(group, view.numel(), self.register_bytes)
        for k, (start, end, parts) in enumerate(cuts):
            if not up0.register_range(base + start, end - start):
                left = list({id(f): f for _, _, later in cuts[k:] for f, _, _ in later}.values())
                log.info("a hot restore reads %d chunk(s) through page-locked slots: registering the segment was refused", len(left))
                return left
            for f, b, e in parts:
                up = self.upload(f.device)
                up.keep(f.dst)
                first = f.c["byte_range"][0]
                with torch.cuda.stream(up.stream):
                    f.dst[b - first : e - first].copy_(view[b:e], non_blocking=True)
        return []


def ranges(group: list[Flat], size: int, register_bytes: int) -> list[tuple[int, int, list[tuple[Flat, int, int]]]]:
    """The registrations of one segment, in order: ``(start, end, parts)``, the segment cut every ``register_bytes``
    (page-aligned; ``end`` at most ``size``; only the cuts that hold a chunk's bytes). A chunk across a cut is copied in
    parts ``(flat, b, e)``, one per registration: CUDA refuses one copy from two ("invalid argument")."""
    cuts: dict[int, list[tuple[Flat, int, int]]] = {}
    for f in group:
        b, e = f.c["byte_range"]
        for k in range(b // register_bytes, -(-e // register_bytes)):
            cuts.setdefault(k, []).append((f, max(b, k * register_bytes), min(e, (k + 1) * register_bytes)))
    out = []
    for k in sorted(cuts):
        start = k * register_bytes
        stop = max(e for _, _, e in cuts[k])
        out.append((start, min(size, -(-stop // PAGE) * PAGE), cuts[k]))
    return out


def read_registered(
    flats: list[Flat],
    where: Callable[[str], str],
    mapped: Callable[[str], torch.Tensor],
    upload: Callable[[torch.device], Any],
    check: Callable[[str, dict[str, Any], torch.Tensor], None],
) -> list[Flat]:
    """Copy the flats bound for a GPU whose segment :func:`path_for` says to register; return the others."""
    by_path = {name: path_for(where(name)) for name in {f.c["file"] for f in flats}}
    direct = [f for f in flats if f.device is not None and by_path[f.c["file"]] == "register"]
    if not direct:
        return flats
    rest = [f for f in flats if f.device is None or by_path[f.c["file"]] != "register"]
    return rest + RegisteredRead(mapped, upload, check, where).read(direct)
