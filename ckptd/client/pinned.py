"""Page-locked host memory that is quick to make and to give back: anonymous memory on transparent huge
pages, faulted in by the calling thread and registered with CUDA (``cudaHostRegister``).

Why not ``torch.empty(..., pin_memory=True)`` (``cudaHostAlloc``): on an H100 host it made page-locked memory
at 1.4-1.8 GB/s (74 ms per 128 MiB; ``docs/bench/gpu/restore_paths_hotread_3.log``), so a hot restore's
16 reading threads, two 8 MiB slots each, spent about 150 ms of a 320 ms read making their slots, and
giving them back took another 42 ms. The driver's cost is per page: registering memory on 2 MiB pages
ran at 55 GB/s on the same host (5.9 GB in 108 ms, ``restore_paths_hugepages.log``). Each reading thread
makes its own block, so the kernel zeroes the huge pages on every thread at once.

Where the kernel gives no transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` is
``never``), or the registration is refused, :func:`page_locked` falls back to ``pin_memory``.
"""

from __future__ import annotations

import logging
import mmap
from collections import Counter
from collections.abc import Callable

import torch

from ..shm import populate_write

log = logging.getLogger("ckptd.cuda")

HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and on arm64 with 4 KiB base pages
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
MADE: Counter[str] = Counter()  # blocks made in this process, by how ("huge" or "pinned"): what benchmarks report


def huge_pages() -> bool:
    """True where anonymous memory advised ``MADV_HUGEPAGE`` gets transparent huge pages (``[always]`` or
    ``[madvise]`` in :data:`THP_ENABLED`)."""
    try:
        with open(THP_ENABLED) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def page_locked(
    n: int, register: Callable[[int, int], bool], unregister: Callable[[int], None]
) -> tuple[torch.Tensor, Callable[[], None], str]:
    """``n`` bytes of page-locked host memory (a ``uint8`` tensor), the call that gives it back (once no
    copy reads it any more; the caller drops its views first) and how it was made: ``"huge"`` (anonymous
    memory on huge pages, ``register(address, size)``-ed, ``unregister(address)``-ed by the release) or
    ``"pinned"`` (``pin_memory``)."""
    if n > 0 and huge_pages() and hasattr(mmap, "MADV_HUGEPAGE"):
        made = _huge(n, register, unregister)
        if made is not None:
            MADE["huge"] += 1
            return made[0], made[1], "huge"
    MADE["pinned"] += 1
    return _pin_memory(n), _nothing, "pinned"


def _pin_memory(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


def _huge(
    n: int, register: Callable[[int, int], bool], unregister: Callable[[int], None]
) -> tuple[torch.Tensor, Callable[[], None]] | None:
    size = -(-n // HUGE_PAGE) * HUGE_PAGE
    try:
        mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        log.debug("no anonymous mapping for page-locked memory: %s", e)
        return None
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    off = -whole.data_ptr() % HUGE_PAGE  # the mapping is page-aligned; the block starts on a huge page
    addr = whole.data_ptr() + off
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, off, size)
    except OSError as e:
        log.debug("MADV_HUGEPAGE refused: %s", e)
    populate_write(addr, size)  # on this thread: every reading thread zeroes its own pages at once
    view = whole[off : off + n]
    del whole
    if not register(addr, size):
        return None  # (unmapped with its last view, here)
    held = [mm]  # mapped until released (unmapping registered memory would leave its pages locked), then with its last view

    def release() -> None:
        unregister(addr)
        held.clear()

    return view, release


def _nothing() -> None:
    """``pin_memory``'s memory goes back with its tensor (and the host allocator's cache, emptied by the caller)."""
