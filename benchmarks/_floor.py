"""The stall benchmark's floor: every state tensor copied, in one fused ``torch._foreach_copy_``, into a prefaulted,
persistently mapped /dev/shm buffer (the least a blocking staging copy can cost), and the disk's sequential write +
fsync of the same bytes. Used by ``stall.py``."""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Results, timer  # noqa: E402

WRITE_BLOCK = 16 << 20


def log(msg: str) -> None:
    print(f"[stall {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ShmBuffer:
    """A /dev/shm file, fully allocated (``posix_fallocate``) and mapped once with ``MAP_POPULATE``."""

    def __init__(self, size: int) -> None:
        self.path = os.path.join("/dev/shm", f"ckptd-bench-floor-{os.getpid()}")
        self.size = size
        self._mm: mmap.mmap | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    def view(self) -> memoryview:
        assert self._mm is not None
        return memoryview(self._mm)

    def close(self) -> None:
        self.tensor = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes at exit
                self._mm.close()
            self._mm = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def pack(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int, torch.Tensor]], int]:
    """Back-to-back byte ranges, larger element sizes first (every tensor aligned to its element size)."""
    plan, pos = [], 0
    for t in sorted(tensors, key=lambda t: -t.element_size()):
        n = t.numel() * t.element_size()
        plan.append((pos, pos + n, t))
        pos += n
    return plan, pos


def write_fsync(path: str, view: memoryview, nbytes: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        while pos < nbytes:
            pos += os.write(fd, view[pos : min(nbytes, pos + WRITE_BLOCK)])
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- measurements


class Floor:
    """The floor copy: every tensor into one prefaulted, persistently mapped /dev/shm buffer, in one fused
    ``torch._foreach_copy_`` (the call ckptd copies with)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.plan, self.nbytes = pack(tensors)
        self.buf = ShmBuffer(self.nbytes)
        assert self.buf.tensor is not None
        self.dsts = [self.buf.tensor[b:e].view(t.dtype).view(t.shape) for b, e, t in self.plan]
        self.srcs = [t for _, _, t in self.plan]
        self.sample()  # warm-up: every later copy finds the pages mapped and the caches as they will be

    def sample(self) -> float:
        with timer() as t:
            torch._foreach_copy_(self.dsts, self.srcs)
        return t[0]

    def close(self) -> None:
        self.dsts = []  # the views hold the mapping
        self.buf.close()


def measure_floor(res: Results, floor: Floor, workdir: str, reps: int, slow_reps: int) -> None:
    row = res.row("floor", "floor: fused copy (torch._foreach_copy_) into prefaulted /dev/shm (warm mapping)")
    row.samples.extend(floor.sample() for _ in range(reps))
    row.note = f"{floor.nbytes / row.median / 1e9:.1f} GB/s" if row.median else ""
    log(f"floor: {row.median:.4f} s")
    res.row("floor_paired", "floor, paired: one copy beside each warm blocking snapshot (order alternating)")  # filled by measure_blocking
    # the disk the checkpoints go to: one sequential write + fsync of the same bytes
    drow = res.row("disk", "disk: sequential write + fsync of the state bytes")
    path = os.path.join(workdir, "disk-probe.bin")
    view = floor.buf.view()
    try:
        for _ in range(slow_reps):
            with timer() as t:
                write_fsync(path, view, floor.nbytes)
            drow.samples.append(t[0])
            os.unlink(path)
    finally:
        view.release()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    drow.note = f"{floor.nbytes / drow.median / 1e9:.2f} GB/s" if drow.median else ""
    log(f"disk write+fsync: {drow.median:.3f} s")
