"""Reading and hashing staged bytes: whole, then hashed, against piece by piece while each piece is in cache.

    .venv/bin/python benchmarks/copy_hash.py [--gb 1] [--reps 5] [--repo <old checkout>]

Two measurements, in one run:

* ``pread`` of a 1 GB ``/dev/shm`` file into memory in 64 MiB chunks on two threads (what a hot restore does into
  CPU tensors), each chunk hashed with XXH3 either after the whole chunk is read or 1 MiB at a time as it is read
  (what ``client/hotread.py`` does since b8df802): wall seconds, median of ``--reps``;
* a persist of a 1 GB staged shard from a ``/dev/shm`` segment (``storage.local.write_shard``: read, hash, written
  with direct I/O under ``bench-out/``): CPU seconds of the persisting process (every thread) and wall seconds, for
  this checkout and, with ``--repo``, another one: a process per checkout persists once untimed (a daemon persists
  warm), then ``--reps`` times; two rounds, the checkouts' order alternating; median of the ``2 x --reps``.

Prints a table; writes ``bench-out/copy_hash.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine_info, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 64 << 20
PIECE = 1 << 20


def _filled(path: str, nbytes: int, head: bytes = b"") -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, nbytes)
    os.pwrite(fd, head, 0)
    block = os.urandom(1 << 20)
    for off in range(len(head), nbytes, 1 << 20):
        os.pwrite(fd, block[: min(1 << 20, nbytes - off)], off)
    return fd


def read_hash(gb: float, reps: int) -> dict[str, list[float]]:
    import xxhash

    n = int(gb * (1 << 30)) // CHUNK * CHUNK
    path = f"/dev/shm/ckptd-bench-copyhash-{os.getpid()}"
    fd = _filled(path, n)
    dst = memoryview(bytearray(n))

    def work(offs: list[int], piece: int | None) -> None:
        for off in offs:
            if piece is None:
                os.preadv(fd, [dst[off : off + CHUNK]], off)
                xxhash.xxh3_64_hexdigest(dst[off : off + CHUNK])
                continue
            h = xxhash.xxh3_64()
            for p in range(off, off + CHUNK, piece):
                os.preadv(fd, [dst[p : p + piece]], p)
                h.update(dst[p : p + piece])
            h.hexdigest()

    def once(piece: int | None) -> float:
        offs = list(range(0, n, CHUNK))
        threads = [threading.Thread(target=work, args=(offs[i::2], piece)) for i in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    out: dict[str, list[float]] = {"whole": [], "pieces": []}
    try:
        once(None)  # warm-up: the destination's pages faulted in
        for _ in range(reps):
            out["whole"].append(once(None))
            out["pieces"].append(once(PIECE))
    finally:
        os.close(fd)
        os.unlink(path)
    return out


_PERSIST = r"""
import json, os, shutil, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import torch
from ckptd.format import build_layout
from ckptd.storage import local
n_t, each = 16, int(float(sys.argv[3]) * (1 << 30)) // 16 // 4
layout = build_layout([(f"model/w{i}", f"model/w{i}", torch.float32, (each,), (each,), (0,)) for i in range(n_t)])
total = len(layout.header) + n_t * each * 4
fd = os.open(sys.argv[2], os.O_RDONLY)
root = tempfile.mkdtemp(dir=sys.argv[4])
cpu, wall = [], []
if hasattr(local, "ShardWrite"):
    write = lambda i: local.write_shard(root, local.ShardWrite("j", i, 0, 1, fd, total, {}))
else:  # a checkout from before the record (issue 36)
    write = lambda i: local.write_shard(root, "j", i, 0, 1, fd, total, {})
for i in range(1 + int(sys.argv[5])):  # the first one untimed: a daemon persists warm
    t0, c0 = time.perf_counter(), time.process_time()
    write(i)
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - t0)
    shutil.rmtree(os.path.join(root, "j"))
print(json.dumps({"cpu": cpu[1:], "wall": wall[1:], "module": local.__file__}))
shutil.rmtree(root)
"""


def persist(gb: float, reps: int, repos: list[str]) -> dict[str, dict[str, list[float]]]:
    """A process per checkout (its own imports) persists once untimed, then ``reps`` times; two such rounds, the
    checkouts' order alternating."""
    import json

    import torch

    sys.path.insert(0, REPO)
    from ckptd.format import build_layout

    each = int(gb * (1 << 30)) // 16 // 4
    layout = build_layout([(f"model/w{i}", f"model/w{i}", torch.float32, (each,), (each,), (0,)) for i in range(16)])
    path = f"/dev/shm/ckptd-bench-copyhash-seg-{os.getpid()}"
    os.close(_filled(path, len(layout.header) + 16 * each * 4, layout.header))
    os.makedirs(os.path.join(REPO, "bench-out"), exist_ok=True)
    work = tempfile.mkdtemp(prefix="copyhash", dir=os.path.join(REPO, "bench-out"))
    out: dict[str, dict[str, list[float]]] = {r: {"cpu": [], "wall": []} for r in repos}
    try:
        for i in range(2):
            for repo in repos if i % 2 == 0 else repos[::-1]:
                cmd = [sys.executable, "-c", _PERSIST, repo, path, str(gb), work, str(reps)]
                res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                assert res["module"].startswith(os.path.abspath(repo)), res["module"]
                out[repo]["cpu"] += res["cpu"]
                out[repo]["wall"] += res["wall"]
    finally:
        os.unlink(path)
        shutil.rmtree(work, ignore_errors=True)
    return out


def _fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--repo", action="append", default=[], help="another checkout to time the persist of (repeatable)")
    p.add_argument("--json", default="bench-out/copy_hash.json")
    args = p.parse_args(argv)
    rh = read_hash(args.gb, args.reps)
    repos = [REPO, *[os.path.abspath(r) for r in args.repo]]
    ps = persist(args.gb, args.reps, repos)
    info = machine_info()
    print("## ckptd read-and-hash benchmark\n")
    print(f"- {args.gb} GB; nproc {info.get('nproc')}; {args.reps} reps, median\n")
    print("| measurement | median (s) | samples (s) |\n|---|---:|---|")
    for k, how in (("whole", "chunk read whole, then hashed"), ("pieces", "1 MiB read, then hashed")):
        print(f"| pread + XXH3, 64 MiB chunks on 2 threads: {how} | {statistics.median(rh[k]):.3f} | {_fmt(rh[k])} |")
    for repo in repos:
        name = "this checkout" if repo == REPO else repo
        for k in ("cpu", "wall"):
            print(f"| persist ({name}): {k} seconds | {statistics.median(ps[repo][k]):.3f} | {_fmt(ps[repo][k])} |")
    result: dict[str, Any] = {"read_hash": rh, "persist": ps, "machine": info, "gb": args.gb}
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
