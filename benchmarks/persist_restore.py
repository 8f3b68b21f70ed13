"""Persist bandwidth and restore time, ckptd against a plain write and dcp.load, in one run.

    .venv/bin/python benchmarks/persist_restore.py [--params 88e6] [--pairs 8] [--reps 4]

Persist: time from a blocking snapshot's return (the commit) to durability, against a plain
sequential write + fsync of the same bytes (a copy of the shard) to the same directory, in ``--pairs``
pairs whose order alternates from pair to pair. Some disks have two speeds (a fast mode, and a slow one after a
quiet spell or a long write), so the bandwidth ratio's verdict uses the minima (each at the disk's fastest); the
median of the per-pair ratios is shown beside it. Restore: ckptd.restore into a fresh model and AdamW, against
dcp.load of the same state saved by dcp.save (both through get_state_dict / set_state_dict), each with its files
evicted from the page cache and then in it, the order alternating (ckptd's daemon writes shards past the page
cache, dcp.save through it: without the eviction the first restore would compare a disk read with a cache read).
Prints a table; writes ``bench-out/persist_restore.json``. ``CKPTD_BENCH_DAEMON_ARGS`` adds
arguments to the daemon's command line (``--no-idle-priority``: its persist threads at normal priority).
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
from _harness import DaemonProcess, alternate, build_state, evict, machine_info, write_json  # noqa: E402

import ckptd  # noqa: E402

EXTRA_DAEMON_ARGS = [a for a in os.environ.get("CKPTD_BENCH_DAEMON_ARGS", "").split() if a]  # e.g. --no-idle-priority


def plain_write(path: str, data: bytes, unlink: bool = True) -> float:
    """Sequential write + fsync of ``data`` (the very bytes of a ckptd shard, so the storage sees the same); the
    file removed after unless ``unlink`` is false."""
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
    if unlink:
        os.unlink(path)
    return dt


def measure_persist(c: ckptd.Client, model: torch.nn.Module, optim: torch.optim.Optimizer, work: str, pairs: int,
                    rows: dict[str, list[float]], daemon_pid: int) -> tuple[str, int]:  # fmt: skip
    """``pairs`` pairs of (plain write, ckptd persist), the pair's order alternating (the first write after a quiet
    spell is the slow one on some disks), with the CPU time each took (the plain write: this process's; the persist:
    the daemon's, from the commit to durable); the last step's directory and the shard's size."""
    import psutil

    daemon = psutil.Process(daemon_pid)

    def daemon_cpu() -> float:
        t = daemon.cpu_times()
        return t.user + t.system

    def own_cpu() -> float:
        t = os.times()
        return t.user + t.system

    c.prepare(model, optim)
    path = c.snapshot(model, optim, step=0, blocking=True).wait()
    shard_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    with open(os.path.join(path, "rank-00000.safetensors"), "rb") as f:
        data = f.read()
    for i in range(pairs):

        def persist(step: int = i + 1) -> tuple[float, str]:
            h = c.snapshot(model, optim, step=step, blocking=True)
            t0, cpu0 = time.perf_counter(), daemon_cpu()
            done = h.wait()
            rows["persist_cpu"].append(daemon_cpu() - cpu0)
            return time.perf_counter() - t0, done

        def plain() -> float:
            cpu0 = own_cpu()
            took = plain_write(os.path.join(work, "plain.bin"), data, unlink=False)
            rows["plain_cpu"].append(own_cpu() - cpu0)
            os.unlink(os.path.join(work, "plain.bin"))  # outside both windows: the persist's steps are not removed either
            return took

        plain_s, (took, path) = alternate(i, plain, persist)
        rows["plain"].append(plain_s)
        rows["persist"].append(took)
    return path, shard_bytes


def measure_restore(model: torch.nn.Module, optim: torch.optim.Optimizer, params: float, path: str, work: str, reps: int,
                    rows: dict[str, list[float]]) -> None:  # fmt: skip
    """``reps`` rounds of: ckptd.restore and dcp.load with each one's files evicted from the page cache (what a restart
    on a node whose cache was reclaimed reads), then each again with its files in the cache (read just before)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dcp_dir = os.path.join(work, "dcp")
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)

    def with_ckptd() -> float:
        m2, o2 = build_state(params, seed=1)
        t0 = time.perf_counter()
        ckptd.restore(m2, o2, path=path)
        return time.perf_counter() - t0

    def with_dcp() -> float:
        m3, o3 = build_state(params, seed=2)
        t0 = time.perf_counter()
        msd, osd = get_state_dict(m3, o3)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=dcp_dir)
        set_state_dict(m3, o3, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return time.perf_counter() - t0

    for i in range(reps):
        for name, run, where in (("ckptd", with_ckptd, path), ("dcp", with_dcp, dcp_dir))[:: 1 if i % 2 == 0 else -1]:
            evict(where)
            rows[f"restore_{name}_evicted"].append(run())
            rows[f"restore_{name}"].append(run())  # its files were just read: in the page cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=88e6)
    p.add_argument("--pairs", type=int, default=8, help="(plain write, persist) pairs, the order alternating (default 8)")
    p.add_argument("--reps", type=int, default=4, help="restore repetitions (default 4)")
    p.add_argument("--json", default="bench-out/persist_restore.json")
    args = p.parse_args(argv)
    model, optim = build_state(args.params)
    work = tempfile.mkdtemp(prefix="ckpr", dir=os.environ.get("CKPTD_BENCH_DIR"))
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "plain",
            "persist",
            "restore_ckptd",
            "restore_dcp",
            "restore_ckptd_evicted",
            "restore_dcp_evicted",
            "plain_cpu",
            "persist_cpu",
        )
    }
    # --keep above the steps written: no retention pass deletes a step inside a persist's CPU window
    keep = ["--keep", str(args.pairs + 2)]
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"), keep + EXTRA_DAEMON_ARGS)
    try:
        daemon.wait_ready()
        with ckptd.Client(endpoint=daemon.endpoint, job="pr") as c:
            path, shard_bytes = measure_persist(c, model, optim, work, args.pairs, rows, daemon.proc.pid)
        measure_restore(model, optim, args.params, path, work, args.reps, rows)
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, rows, shard_bytes)
    return 0


def report(args: argparse.Namespace, rows: dict[str, list[float]], shard_bytes: int) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    info = machine_info()
    pair_ratios = [pl / pe for pl, pe in zip(rows["plain"], rows["persist"])]  # bandwidth ratio: time plain / time persist
    by_pair = statistics.median(pair_ratios)
    by_min = min(rows["plain"]) / min(rows["persist"])
    print("## ckptd persist and restore benchmark\n")
    print(
        f"- state {shard_bytes / 1e9:.3f} GB on disk; torch {torch.__version__}, nproc {info.get('nproc')};"
        f" {args.pairs} (plain write, persist) pairs, order alternating; {args.reps} restore reps; median\n"
    )
    print("| measurement | median (s) | min (s) | GB/s (median) | samples (s) |\n|---|---:|---:|---:|---|")
    names = {
        "plain": "plain sequential write + fsync of the same bytes (a copy of the shard)",
        "persist": "ckptd persist: commit -> durable (write, fsync, manifest, rename)",
        "restore_ckptd": "ckptd.restore into a fresh model + AdamW (files in the page cache)",
        "restore_dcp": "dcp.load of the same state saved by dcp.save (files in the page cache)",
        "restore_ckptd_evicted": "ckptd.restore, files evicted from the page cache",
        "restore_dcp_evicted": "dcp.load, files evicted from the page cache",
    }
    names |= {"plain_cpu": "CPU time of the plain write (this process)", "persist_cpu": "CPU time of the persist (the daemon)"}
    for k, name in names.items():
        rate = "" if k.endswith("_cpu") else f"{shard_bytes / med[k] / 1e9:.2f}"  # a CPU time is no bandwidth
        print(f"| {name} | {med[k]:.3f} | {min(rows[k]):.3f} | {rate} | {' '.join(f'{x:.3f}' for x in rows[k])} |")
    print(
        f"\n- persist bandwidth / plain write bandwidth, from the minima (each at the disk's fastest) = {by_min:.2f}"
        f" (target >= 0.8, the verdict: **{'PASS' if by_min >= 0.8 else 'MISS'}**)"
    )
    print(f"- for information: the same, median of the {len(pair_ratios)} per-pair ratios = {by_pair:.2f}")
    gb = shard_bytes / 1e9
    print(f"- CPU seconds per GB written (medians): plain write {med['plain_cpu'] / gb:.2f}, persist {med['persist_cpu'] / gb:.2f}")
    print(
        f"- ckptd restore / dcp.load, files in the page cache (medians) = {med['restore_ckptd'] / med['restore_dcp']:.2f} (target <= 1.0)"
    )
    print(f"- the same, files evicted (medians) = {med['restore_ckptd_evicted'] / med['restore_dcp_evicted']:.2f}")
    write_json(
        args.json,
        {"bytes": shard_bytes, "samples": rows, "median": med, "machine": info, "persist_over_plain_bandwidth":
         {"from_minima": by_min, "median_of_pairs": by_pair, "of_medians": med["plain"] / med["persist"], "pairs": pair_ratios,
          "verdict_uses": "from_minima"}},
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
