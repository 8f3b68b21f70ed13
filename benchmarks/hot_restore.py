"""Hot restore: a restarted trainer's restore from the daemon's shared memory against restore from disk.

    .venv/bin/python benchmarks/hot_restore.py [--params 88e6] [--reps 3]

One trainer snapshots a transformer-like stack + AdamW and exits; a fresh model then restores the
same step three ways, interleaved: from the daemon's memory (``restore()``, the default when the
daemon still holds the step), from disk with the shard files just evicted from the page cache
(``posix_fadvise(DONTNEED)``, what a restart after the cache was reclaimed sees), and from disk with
the files in the page cache. Each restore verifies every chunk's checksum. The disk's floor is measured
in the same rounds: the shard files, evicted, read whole in 16 MiB ``preadv`` calls into one buffer (no
hashing, no copy). Prints a table; writes ``bench-out/hot_restore.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import DaemonProcess, build_state, evict, machine_info, write_json  # noqa: E402

import ckptd  # noqa: E402


def read_files(step_dir: str, block: int = 16 << 20) -> int:
    """Read every shard file of a step whole, sequentially, into one reused buffer: the disk's floor for a
    restore. Returns the bytes read."""
    buf = memoryview(bytearray(block))
    total = 0
    for name in sorted(os.listdir(step_dir)):
        if not name.endswith(".safetensors"):
            continue
        fd = os.open(os.path.join(step_dir, name), os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [buf], offset):
                offset += n
            total += offset
        finally:
            os.close(fd)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=88e6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="bench-out/hot_restore.json")
    args = p.parse_args(argv)
    model, optim = build_state(args.params)
    work = tempfile.mkdtemp(prefix="ckhr", dir=os.environ.get("CKPTD_BENCH_DIR"))
    rows: dict[str, list[float]] = {"memory": [], "disk_cold": [], "disk_warm": [], "disk_floor": []}
    sources: dict[str, set[str]] = {k: set() for k in rows}
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    try:
        daemon.wait_ready()
        with ckptd.Client(endpoint=daemon.endpoint, job="hr") as c:
            path = c.snapshot(model, optim, step=1, blocking=True).wait()
        nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        del model, optim  # the trainer is gone; a new one restores
        m2, o2 = build_state(args.params, seed=1)
        with ckptd.Client(endpoint=daemon.endpoint, job="hr") as c:
            for _ in range(args.reps):
                for kind in rows:
                    hot = kind == "memory"
                    if kind in ("disk_cold", "disk_floor"):
                        evict(path)
                    t0 = time.perf_counter()
                    if kind == "disk_floor":
                        read_files(path)
                    else:
                        c.restore(m2, o2, hot=hot)
                        sources[kind].add(c.last_restore["source"])
                    rows[kind].append(time.perf_counter() - t0)
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    assert sources == {"memory": {"memory"}, "disk_cold": {"disk"}, "disk_warm": {"disk"}, "disk_floor": set()}, sources
    med = {k: statistics.median(v) for k, v in rows.items()}
    info = machine_info()
    print("## ckptd hot restore benchmark\n")
    print(f"- state {nbytes / 1e9:.3f} GB; torch {torch.__version__}, nproc {info.get('nproc')}; {args.reps} reps, median\n")
    print("| restore | median (s) | GB/s | x memory | samples (s) |\n|---|---:|---:|---:|---|")
    names = {
        "memory": "from the daemon's shared memory (hot, the default)",
        "disk_cold": "from disk, shard files evicted from the page cache",
        "disk_warm": "from disk, shard files in the page cache",
        "disk_floor": "floor: the shard files, evicted, read sequentially (no hash, no copy)",
    }
    for k, name in names.items():
        samples = " ".join(f"{x:.3f}" for x in rows[k])
        print(f"| {name} | {med[k]:.3f} | {nbytes / med[k] / 1e9:.2f} | {med[k] / med['memory']:.2f} | {samples} |")
    print(f"\n- restore from evicted disk / disk floor = {med['disk_cold'] / med['disk_floor']:.2f}")
    write_json(args.json, {"bytes": nbytes, "samples": rows, "median": med, "machine": info})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
