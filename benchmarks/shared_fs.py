"""A multi-node step to a shared directory: ckptd (two node daemons, ``--remote-path``) against DCP's
``FileSystemWriter`` on the same directory, ``dcp.save`` and ``dcp.async_save``, same state, same ranks, one run.

    .venv/bin/python benchmarks/shared_fs.py [--gb 0.5] [--reps 3] [--fs sshfs|dir]

Four ranks (gloo, FSDP2 ``fully_shard`` on a CPU mesh) as two "nodes" of two ranks; ``--fs sshfs`` (the default where
it can run) gives each node its own sshfs mount of one directory exported by an sshd on loopback (a real network file
system, ``tests/sshfs.py``), ``--fs dir`` one local directory. Per save, on the slowest rank: **resume**, the seconds
until the save call returned and training may go on (ckptd: a blocking snapshot, the copy into shared memory done);
**durable**, the seconds until the step is complete in the shared directory (ckptd: ``wait()``, its manifest written
there; DCP: ``save`` returned, or ``async_save``'s future done, its ``.metadata`` written). The modes alternate,
rep by rep. Prints a table; writes ``bench-out/shared_fs.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

MODES = ("ckptd", "dcp.save", "dcp.async_save")
NODES, PER_NODE = 2, 2


def _rank(rank: int, args: argparse.Namespace, endpoints: list[str], mounts: list[str], tmp: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from scaling import _sharded_state
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckptd

    world = NODES * PER_NODE
    node = rank // PER_NODE
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)  # what torchrun sets on each node
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        model, optim, _ = _sharded_state(world, args.gb * 1e9 / 12, rank)
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        with ckptd.Client(endpoint=endpoints[node], job="bench") as c:
            c.prepare(model, optim)
            c.snapshot(model, optim, step=0, blocking=True).wait(600)  # warm: segments made, first persist done

            def ckptd_save(step: int) -> tuple[float, float]:
                t0 = time.perf_counter()
                h = c.snapshot(model, optim, step=step, blocking=True)
                resume = time.perf_counter() - t0
                h.wait(600)
                return resume, time.perf_counter() - t0

            def dcp_save(step: int, asynchronous: bool) -> tuple[float, float]:
                path = os.path.join(mounts[node], "dcp", f"step-{step}")
                t0 = time.perf_counter()
                msd, osd = get_state_dict(model, optim)
                if asynchronous:
                    fut = dcp.async_save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path))
                    resume = time.perf_counter() - t0
                    fut.result(timeout=600)
                else:
                    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path))
                    resume = time.perf_counter() - t0
                return resume, time.perf_counter() - t0

            savers = {"ckptd": ckptd_save, "dcp.save": lambda s: dcp_save(s, False), "dcp.async_save": lambda s: dcp_save(s, True)}
            step = 0
            for rep in range(args.reps):
                order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]  # each mode first once in three reps
                for mode in order:
                    step += 1
                    dist.barrier()
                    resume, durable = savers[mode](step)
                    dist.barrier()  # durable everywhere before the next save (DCP's metadata is rank 0's)
                    times[mode].append((resume, durable))
        nbytes = sum(t.numel() * t.element_size() for t in [p.to_local() for p in model.parameters()])
        out.put((rank, times, nbytes))
    finally:
        dist.destroy_process_group()


def _mounts(kind: str, work: str) -> tuple[list[str], str, Any]:
    """(each node's view of the shared directory, the directory itself, what to stop afterwards)."""
    if kind == "dir":
        shared = os.path.join(work, "shared")
        os.makedirs(shared)
        return [shared] * (NODES + 1), shared, None
    from pathlib import Path

    from sshfs import SshfsServer, missing

    why = missing()
    if why is not None:
        raise SystemExit(f"--fs sshfs: {why}; run with --fs dir")
    server = SshfsServer(Path(work) / "fs")
    (Path(work) / "fs").mkdir()
    server.start()
    return [str(server.mount(f"node{i}")) for i in range(NODES)], str(server.export), server


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _harness import DaemonProcess, gather

    work = tempfile.mkdtemp(prefix="cksf")
    mounts, shared, server = _mounts(args.fs, work)
    daemons = [
        DaemonProcess(
            os.path.join(work, f"root{i}"), f"ipc://{work}/d{i}.sock", os.path.join(work, f"d{i}.log"),
            ["--remote-path", mounts[i], "--keep", "1"],
        )
        for i in range(NODES)
    ]  # fmt: skip
    ctx = mp.get_context("spawn")
    q, procs = ctx.Queue(), []
    try:
        for d in daemons:
            d.wait_ready()
        endpoints = [d.endpoint for d in daemons]
        procs = [ctx.Process(target=_rank, args=(r, args, endpoints, mounts, work, q)) for r in range(NODES * PER_NODE)]
        for p in procs:
            p.start()
        got = gather(q, procs, 3600, lambda: "\n".join(d.log_tail() for d in daemons))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for d in daemons:
            d.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = {}
    for mode in MODES:
        per_rep = [[g[1][mode][i] for g in got] for i in range(args.reps)]  # each rep: every rank's (resume, durable)
        rows[mode] = {
            "resume_s": statistics.median(max(r for r, _ in rep) for rep in per_rep),
            "durable_s": statistics.median(max(d for _, d in rep) for rep in per_rep),
        }
    raw = {mode: {str(g[0]): g[1][mode] for g in got} for mode in MODES}  # mode -> rank -> [(resume, durable)] per rep
    return {"rows": rows, "raw": raw, "param_bytes": sum(g[2] for g in got), "fs": args.fs, "reps": args.reps, "gb": args.gb}


def main(argv: list[str] | None = None) -> int:
    from sshfs import missing

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=0.5, help="state size in GB (parameters + AdamW state), over all ranks")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fs", choices=("sshfs", "dir"), default="sshfs" if missing() is None else "dir")
    p.add_argument("--json", default="bench-out/shared_fs.json")
    args = p.parse_args(argv)
    res = run(args)
    _report(args, res)
    return 0


def _report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    import torch
    from _harness import machine_info, write_json

    info = machine_info()
    where = "each node its own sshfs mount of one export (loopback sshd)" if args.fs == "sshfs" else "one local directory"
    print("## A multi-node step to a shared directory: ckptd against DCP's FileSystemWriter\n")
    print(
        f"- {NODES} nodes x {PER_NODE} ranks, FSDP2 over gloo, {args.gb} GB of state (parameters + AdamW); shared"
        f" directory: {where}; torch {torch.__version__}, nproc {info.get('nproc')}; {args.reps} reps per mode, modes"
        " alternating, median of the slowest rank"
    )
    print("- resume: until the save call returned; durable: until the step is complete in the shared directory\n")
    print("| mode | resume (s) | durable (s) | resume vs dcp.save |\n|---|---:|---:|---:|")
    base = res["rows"]["dcp.save"]["resume_s"]
    for mode, row in res["rows"].items():
        print(f"| {mode} | {row['resume_s']:.3f} | {row['durable_s']:.2f} | {row['resume_s'] / base:.2f}x |")
    write_json(args.json, {**res, "machine": info})


if __name__ == "__main__":
    raise SystemExit(main())
