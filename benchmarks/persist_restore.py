"""Persist bandwidth and restore time, ckptd against a plain write and dcp.load, in one run.

    .venv/bin/python benchmarks/persist_restore.py [--params 88e6] [--reps 4]

Persist: time from a blocking snapshot's return (the commit) to durability, against a plain
sequential write + fsync of the same number of bytes to the same directory. Restore: ckptd.restore
into a fresh model and AdamW, against dcp.load of the same state saved by dcp.save (both through
get_state_dict / set_state_dict, both with the files in the page cache). Prints a table; writes
``bench-out/persist_restore.json``.
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
from _harness import DaemonProcess, build_state, machine_info, write_json  # noqa: E402

import ckptd  # noqa: E402


def plain_write(path: str, data: bytes) -> float:
    """Sequential write + fsync of ``data`` (the very bytes of a ckptd shard, so the storage sees the same)."""
    view = memoryview(data)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        while pos < len(view):
            pos += os.write(fd, view[pos : pos + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=88e6)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--json", default="bench-out/persist_restore.json")
    args = p.parse_args(argv)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = build_state(args.params)
    work = tempfile.mkdtemp(prefix="ckpr", dir=os.environ.get("CKPTD_BENCH_DIR"))
    rows: dict[str, list[float]] = {"plain": [], "persist": [], "restore_ckptd": [], "restore_dcp": []}
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    try:
        daemon.wait_ready()
        with ckptd.Client(endpoint=daemon.endpoint, job="pr") as c:
            c.prepare(model, optim)
            path = c.snapshot(model, optim, step=0, blocking=True).wait()
            shard_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
            with open(os.path.join(path, "rank-00000.safetensors"), "rb") as f:
                data = f.read()
            for i in range(args.reps):
                # alternate which goes first: the first write after a quiet spell is the slow one here
                if i % 2 == 0:
                    rows["plain"].append(plain_write(os.path.join(work, "plain.bin"), data))
                h = c.snapshot(model, optim, step=i + 1, blocking=True)
                t0 = time.perf_counter()
                path = h.wait()
                rows["persist"].append(time.perf_counter() - t0)
                if i % 2 == 1:
                    rows["plain"].append(plain_write(os.path.join(work, "plain.bin"), data))
        del data
        dcp_dir = os.path.join(work, "dcp")
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        for _ in range(args.reps):
            m2, o2 = build_state(args.params, seed=1)
            t0 = time.perf_counter()
            ckptd.restore(m2, o2, path=path)
            rows["restore_ckptd"].append(time.perf_counter() - t0)
            del m2, o2
            m3, o3 = build_state(args.params, seed=2)
            t0 = time.perf_counter()
            msd, osd = get_state_dict(m3, o3)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=dcp_dir)
            set_state_dict(m3, o3, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            rows["restore_dcp"].append(time.perf_counter() - t0)
            del m3, o3, sd, msd, osd
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    info = machine_info()
    print("## ckptd persist and restore benchmark\n")
    print(f"- state {shard_bytes / 1e9:.3f} GB on disk; torch {torch.__version__}, nproc {info.get('nproc')}; {args.reps} reps, median\n")
    print("| measurement | median (s) | GB/s | samples (s) |\n|---|---:|---:|---|")
    names = {
        "plain": "plain sequential write + fsync of the same bytes (a copy of the shard)",
        "persist": "ckptd persist: commit -> durable (write, fsync, manifest, rename)",
        "restore_ckptd": "ckptd.restore into a fresh model + AdamW (page cache warm)",
        "restore_dcp": "dcp.load of the same state saved by dcp.save (page cache warm)",
    }
    for k, name in names.items():
        print(f"| {name} | {med[k]:.3f} | {shard_bytes / med[k] / 1e9:.2f} | {' '.join(f'{x:.3f}' for x in rows[k])} |")
    print(f"\n- persist bandwidth / plain write bandwidth = {med['plain'] / med['persist']:.2f} (target >= 0.8)")
    print(f"- ckptd restore / dcp.load = {med['restore_ckptd'] / med['restore_dcp']:.2f} (target <= 1.0)")
    write_json(args.json, {"bytes": shard_bytes, "samples": rows, "median": med, "machine": info})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
