"""GPU restore's host-side building blocks, timed one by one on a shared-memory segment of ``--gb``: what a
hot restore's time is made of, and which way of page-locking, hashing and copying is fastest on this machine.

    python benchmarks/restore_paths.py [--gb 6] [--range-mb 256] [--json out.json]

Needs CUDA (exits 0 with a message without it). The segment is written by this process, then closed and
mapped again, as a restarted trainer maps the daemon's segment. Measured, each on a fresh mapping:

* ``mmap``: with ``MAP_POPULATE`` (the page tables built up front) and without;
* ``cudaHostRegister`` of the whole mapping at once (after a populated and after a plain mmap), and of
  ``--range-mb`` ranges one after the other and from 2, 4 and 8 threads; ``cudaHostUnregister``; ``munmap``;
* host-to-device copies from the registered mapping into one device buffer: whole, in ranges, and one
  copy across the boundary of two separately registered ranges (does CUDA take it at full speed?);
* XXH3-64 of the whole segment in chunks of ``--range-mb``, from 1, 4, 8 and 16 threads;
* a bounce path: one page-locked buffer per thread, ``memcpy`` from the mapping into it;
* page-locked slots made three ways: ``cudaHostAlloc``; anonymous memory registered; and what ckptd makes now
  (:mod:`ckptd.client.pinned`: one block per thread on its thread, on huge pages where the kernel gives them);
* ckptd's own path (``ckptd.client.hotread.HotRead``): ``pread`` from the segment into two page-locked slots per
  thread, XXH3 as it is read, a copy on a side stream into the device buffer, for ``--chunk-mb`` chunks, several
  thread counts, slot and piece sizes, with and without checksums (slots made inside each timing); some
  configurations are run twice, first and last;
* ckptd's registered path (``ckptd.client.hotreg``), in ranges of 64, 256 and 1024 MiB, before and after the others.

``--only hotread`` measures the last three alone; ``--only ckptd`` ckptd's two paths alone.

Prints a table; writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptd.client import cuda as ckptd_cuda  # noqa: E402
from ckptd.client import hotread  # noqa: E402
from ckptd.client.hotread import PIECE_BYTES, Flat, HotRead  # noqa: E402
from ckptd.client.hotread import pread_into as hotread_pread  # noqa: E402
from ckptd.client.hotreg import RegisteredRead  # noqa: E402
from ckptd.client.pinned import page_locked  # noqa: E402
from ckptd.format import digest  # noqa: E402
from ckptd.shm import populate_write  # noqa: E402

RO_PORTABLE = 0x08 | 0x01


def t() -> float:
    return time.perf_counter()


def register(ptr: int, n: int, flags: int = RO_PORTABLE) -> float:
    t0 = t()
    err = torch.cuda.cudart().cudaHostRegister(ptr, n, flags)
    took = t() - t0
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister({n}) failed: {err}")
    return took


def unregister(ptr: int) -> float:
    t0 = t()
    torch.cuda.cudart().cudaHostUnregister(ptr)
    return t() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=6.0)
    p.add_argument("--range-mb", type=int, default=256)
    p.add_argument("--chunk-mb", type=int, default=24, help="chunk size for ckptd's own path")
    p.add_argument("--only", choices=["hotread", "ckptd"], default=None)
    p.add_argument("--json", default="bench-out/restore_paths.json")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # torch.frombuffer of a read-only mapping: only ever read
    if not torch.cuda.is_available():
        print("restore_paths: no CUDA device: nothing to measure")
        return 0
    rng = a.range_mb << 20
    n = int(a.gb * 1e9) // rng * rng
    path = f"/dev/shm/ckptd-restore-paths-{os.getpid()}"
    res: dict[str, Any] = {"gb": n / 1e9, "range_mb": a.range_mb, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def row(name: str, seconds: float, nbytes: int = n) -> None:
        res[name] = {"ms": seconds * 1e3, "gb_per_s": nbytes / seconds / 1e9 if seconds else None}
        print(f"| {name} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.1f} |", flush=True)

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n) as w:
            block = os.urandom(1 << 20) * 16
            for off in range(0, n, len(block)):
                w[off : off + len(block)] = block[: n - off]
        print(f"segment {n / 1e9:.2f} GB at {path}; ranges of {a.range_mb} MiB\n\n| what | ms | GB/s |\n|---|---:|---:|", flush=True)

        def fresh(populate: bool) -> tuple[mmap.mmap, torch.Tensor, int, float]:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            t0 = t()
            mm = mmap.mmap(fd, n, flags=flags, prot=mmap.PROT_READ)
            took = t() - t0
            ten = torch.frombuffer(mm, dtype=torch.uint8)
            return mm, ten, ten.data_ptr(), took

        def close(mm: mmap.mmap, ten: torch.Tensor) -> float:
            del ten
            t0 = t()
            mm.close()
            return t() - t0

        if a.only in ("hotread", "ckptd"):
            hotread_rows(fd, path, n, a.chunk_mb << 20, dev, row, ckptd_only=a.only == "ckptd")
            return _write(res, a.json)
        # 1. mmap, register whole, copy whole, unregister, munmap
        for populate in (True, False):
            mm, ten, ptr, took = fresh(populate)
            row(f"mmap {'MAP_POPULATE' if populate else 'plain'}", took)
            row(f"cudaHostRegister whole ({'populated' if populate else 'plain'} mmap)", register(ptr, n))
            for rep in range(2):
                torch.cuda.synchronize()
                t0 = t()
                dev.copy_(ten, non_blocking=True)
                torch.cuda.synchronize()
                row(f"H2D whole from registered, rep {rep}", t() - t0)
            row("cudaHostUnregister whole", unregister(ptr))
            try:
                row("munmap", close(mm, ten))
            except BufferError as e:
                print(f"munmap: {e}")

        # 2. ranges: sequential and threaded registration; copies in ranges; a copy across two registrations
        ranges = [(off, rng) for off in range(0, n, rng)]
        for threads in (1, 2, 4, 8):
            mm, ten, ptr, _ = fresh(False)
            t0 = t()
            if threads == 1:
                for off, size in ranges:
                    register(ptr + off, size)
            else:
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(lambda r, ptr=ptr: register(ptr + r[0], r[1]), ranges))
            row(f"cudaHostRegister in ranges, {threads} thread(s)", t() - t0)
            if threads == 4:
                torch.cuda.synchronize()
                t0 = t()
                for off, size in ranges:
                    dev[off : off + size].copy_(ten[off : off + size], non_blocking=True)
                torch.cuda.synchronize()
                row("H2D in ranges from registered ranges", t() - t0)
                mid = rng // 2
                t0 = t()
                try:
                    dev[mid : mid + rng].copy_(ten[mid : mid + rng], non_blocking=True)
                    torch.cuda.synchronize()
                    row("H2D of one range across two registrations", t() - t0, rng)
                    ok = torch.equal(dev[mid : mid + rng].cpu(), ten[mid : mid + rng])
                    res["across_two_registrations_correct"] = ok
                    print(f"across two registrations: bytes {'equal' if ok else 'DIFFER'}")
                except Exception as e:
                    res["across_two_registrations_error"] = f"{type(e).__name__}: {e}"
                    print(f"across two registrations: {type(e).__name__}: {e}")
            t0 = t()
            with ThreadPoolExecutor(max(1, threads)) as ex:
                list(ex.map(lambda r, ptr=ptr: unregister(ptr + r[0]), ranges))
            row(f"cudaHostUnregister in ranges, {threads} thread(s)", t() - t0)
            close(mm, ten)

        # 3. pipelined: register range k+1 (threads) while range k copies
        mm, ten, ptr, _ = fresh(False)
        torch.cuda.synchronize()
        t0 = t()
        with ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(register, ptr + off, size) for off, size in ranges]
            for (off, size), f in zip(ranges, futs):
                f.result()
                dev[off : off + size].copy_(ten[off : off + size], non_blocking=True)
        torch.cuda.synchronize()
        row("pipelined: register in ranges (4 threads) + copy each once registered", t() - t0)
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda r: unregister(ptr + r[0]), ranges))
        close(mm, ten)

        # 4. hashing
        mm, ten, ptr, _ = fresh(True)
        view = memoryview(mm)
        for threads in (1, 4, 8, 16):
            t0 = t()
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda r: digest(view[r[0] : r[0] + r[1]]), ranges))
            row(f"xxh3 of the segment, {threads} thread(s)", t() - t0)
        # 5. bounce: memcpy into page-locked buffers, one per thread
        for threads in (4, 8):
            t0 = t()
            bufs = [torch.empty(rng, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]
            row(f"page-locked buffers: {threads} x {a.range_mb} MiB allocated", t() - t0, threads * rng)
            t0 = t()
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda i, b=bufs, k=threads: [b[i].copy_(ten[o : o + rng]) for o, _ in ranges[i::k]], range(threads)))
            row(f"memcpy mapping -> page-locked, {threads} threads", t() - t0)
            bufs.clear()
        view.release()
        close(mm, ten)
        hotread_rows(fd, path, n, a.chunk_mb << 20, dev, row)
    finally:
        os.close(fd)
        os.unlink(path)
    return _write(res, a.json)


def _write(res: dict[str, Any], out: str) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


def hotread_rows(fd: int, path: str, n: int, chunk: int, dev: torch.Tensor, row: Any, ckptd_only: bool = False) -> None:
    """ckptd's hot path into the GPU, on the segment cut into ``chunk``-byte chunks, each into its part of ``dev``."""
    spans = [(off, min(off + chunk, n)) for off in range(0, n, chunk)]
    with ThreadPoolExecutor(16) as ex:
        sums = list(ex.map(lambda r: digest(memoryview(_pread(fd, r))), spans))
    name = os.path.basename(path)
    device = dev.device
    if not ckptd_only:
        building_blocks(fd, n, row)
    configs = [
        (16, 8, True, 1), (16, 8, True, 2), (16, 8, True, 4), (16, 8, True, 8),
        (8, 8, True, 4), (16, 16, True, 4), (16, 16, True, 16),
        (16, 8, False, 8), (16, 8, True, 1), (16, 8, True, 4),
    ]  # fmt: skip
    registered_rows(fd, path, n, spans, sums, dev, row)
    for workers, slot_mb, checked, piece_mb in configs:
        hotread.PIECE_BYTES = piece_mb << 20
        flats = [
            Flat(f"c{i}", {"file": name, "byte_range": [b, e], "xxh3_64": h if checked else None}, dev[b:e], device)
            for i, ((b, e), h) in enumerate(zip(spans, sums))
        ]
        up = ckptd_cuda.Uploads(device, {})
        dev.zero_()
        torch.cuda.synchronize()
        t0 = t()
        HotRead({name: fd}, lambda _: path, lambda _, up=up: up, workers=workers, slot=slot_mb << 20).read(flats)
        up.finish()  # waits for the copies, gives the slots back
        took = t() - t0
        what = f"{workers} threads, {slot_mb} MiB slots, {piece_mb} MiB pieces{'' if checked else ', no checksums'}"
        row(f"ckptd HotRead: pread -> page-locked slots -> H2D, {what}", took)
    hotread.PIECE_BYTES = PIECE_BYTES
    b, e = spans[len(spans) // 2]
    assert bytes(dev[b:e].cpu().numpy()) == _pread(fd, (b, e)), "HotRead copied wrong bytes"
    registered_rows(fd, path, n, spans, sums, dev, row)  # again, after the others: the machine as warm as for them


def building_blocks(fd: int, n: int, row: Any) -> None:
    """The pieces under ckptd's paths: ``pread`` alone, a parallel ``memcpy``, page-locked memory made three ways."""
    for threads, slot_mb in [(8, 8), (8, 32), (16, 32)]:  # the ceiling: pread alone into page-locked buffers
        bufs = [torch.empty(slot_mb << 20, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]
        t0 = t()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda i, b=bufs, k=threads, m=slot_mb << 20: _pread_share(fd, b[i], i, k, m, n), range(threads)))
        row(f"pread alone into page-locked buffers, {threads} threads, {slot_mb} MiB reads", t() - t0)
        bufs.clear()
    mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # plain: faulted in by the copies
    ten = torch.frombuffer(mm, dtype=torch.uint8)
    bufs = [torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    t0 = t()
    for i, o in enumerate(range(0, n, 64 << 20)):  # torch's own copy threads (intra-op), one call per 64 MiB
        bufs[i % 2][: min(64 << 20, n - o)].copy_(ten[o : o + (64 << 20)])
    row(f"memcpy from a plain mapping into page-locked buffers, torch copy_ ({torch.get_num_threads()} intra-op threads), 64 MiB", t() - t0)
    del ten, bufs
    mm.close()
    # slots for 8 threads, both ways: cudaHostAlloc, and anonymous memory registered
    t0 = t()
    pinned = [torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(8)]
    row("page-locked slots, 8 x 2 x 8 MiB: cudaHostAlloc (pin_memory)", t() - t0, 128 << 20)
    del pinned
    torch._C._host_emptyCache()
    t0 = t()
    anon = [mmap.mmap(-1, 16 << 20) for _ in range(8)]
    ptrs = [torch.frombuffer(m, dtype=torch.uint8).data_ptr() for m in anon]
    for ptr in ptrs:
        populate_write(ptr, 16 << 20)
        register(ptr, 16 << 20, 0x01)
    row("page-locked slots, 8 x 2 x 8 MiB: anonymous mappings faulted in and registered", t() - t0, 128 << 20)
    for ptr in ptrs:
        unregister(ptr)
    for m in anon:
        m.close()
    for threads in (8, 16):  # what HotRead's threads make now: each its own block, on huge pages where the kernel gives them
        made: list[Any] = []
        t0 = t()
        with ThreadPoolExecutor(threads) as ex:
            made = list(ex.map(lambda _: page_locked(16 << 20, lambda a, k: register(a, k, 0x01) >= 0, unregister), range(threads)))
        took = t() - t0
        kinds = sorted({how for _, _, how in made})
        t0 = t()
        for buf, release, _ in made:
            del buf
            release()
        row(f"page-locked slots, {threads} x 2 x 8 MiB, one block per thread on its thread: {'+'.join(kinds)}", took, threads << 24)
        row(f"  given back ({threads} blocks)", t() - t0, threads << 24)
        made.clear()


def registered_rows(fd: int, path: str, n: int, spans: list[tuple[int, int]], sums: list[str], dev: torch.Tensor, row: Any) -> None:
    """ckptd's registered path (``ckptd.client.hotreg``): the segment mapped read-only, registered range by range with
    each chunk's copy enqueued behind its range, checksums on 16 threads from the same pages; then given back."""
    name, device = os.path.basename(path), dev.device

    def check(key: str, c: dict[str, Any], raw: torch.Tensor) -> None:
        if digest(memoryview(raw.numpy())) != c["xxh3_64"]:
            raise RuntimeError(f"checksum mismatch in {key}")

    for range_mb in (64, 256, 1024):
        flats = [
            Flat(f"c{i}", {"file": name, "byte_range": [b, e], "xxh3_64": h}, dev[b:e], device)
            for i, ((b, e), h) in enumerate(zip(spans, sums))
        ]
        dev.zero_()
        torch.cuda.synchronize()
        registered: dict[int, bool] = {}
        up = ckptd_cuda.Uploads(device, registered)
        t0 = t()
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        view = torch.frombuffer(mm, dtype=torch.uint8)
        left = RegisteredRead(
            lambda _, v=view: v, lambda _, up=up: up, check, lambda _: path, workers=16, register_bytes=range_mb << 20
        ).read(flats)
        up.finish()
        took = t() - t0
        row(
            f"ckptd registered: map, register {range_mb} MiB ranges, copy behind, 16 checking threads{'' if not left else ' (REFUSED)'}",
            took,
        )
        ranges = len(registered)
        t0 = t()
        ckptd_cuda.unregister(registered)
        del view
        mm.close()
        row(f"  given back: {ranges} ranges unregistered, unmapped", t() - t0)
        b, e = spans[len(spans) // 3]
        assert bytes(dev[b:e].cpu().numpy()) == _pread(fd, (b, e)), "the registered path copied wrong bytes"


def _pread_share(fd: int, buf: torch.Tensor, i: int, k: int, m: int, n: int) -> None:
    """Thread ``i`` of ``k``: every ``k``-th ``m``-byte read of the segment's ``n`` bytes, into ``buf``."""
    for o in range(i * m, n, k * m):
        hotread_pread(fd, buf[: min(m, n - o)], o)


def _pread(fd: int, span: tuple[int, int]) -> bytes:
    return os.pread(fd, span[1] - span[0], span[0])


if __name__ == "__main__":
    raise SystemExit(main())
