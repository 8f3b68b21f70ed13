"""A job that spans nodes: its steps completed in the memory of its daemons (``--peer-listen``, ``--replicas 1``, no
bucket) against the same steps completed through a bucket (moto's S3 server on loopback), same state, same ranks, one
run; then a restore of the newest step on every rank, from each.

    .venv/bin/python benchmarks/mesh.py [--gb 0.25] [--reps 3]

Two ranks (gloo, FSDP2 ``fully_shard`` on a CPU mesh) as two "nodes" of one rank each, every node with two daemons:
one of a pair that holds the job's steps in each other's memory, one of a pair that shares a bucket. Per save, on the
slowest rank: **resume**, the seconds until the (blocking) snapshot returned; **complete**, until the step is complete
across the nodes (the memory pair: ``wait`` with ``persist=False``, every rank's fragment merged on its daemon; the
bucket pair: ``wait()``, its manifest in the bucket). The modes alternate, rep by rep. **restore**: every rank restores
the newest step through its node's daemon, from disk (``hot=False``: the step is pulled from the daemons' replica
stores, or downloaded from the bucket, verified, then read). Prints a table; writes ``bench-out/mesh.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

MODES = ("memory of the job's daemons", "bucket (moto S3)")
NODES = 2


def _rank(rank: int, args: argparse.Namespace, endpoints: dict[str, list[str]], tmp: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from scaling import _sharded_state

    import ckptd
    from ckptd.client.rpc import Channel

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per "node", as torchrun would say
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=NODES)
    try:
        model, optim, _ = _sharded_state(NODES, args.gb * 1e9 / 12, rank)
        clients = {m: ckptd.Client(endpoint=endpoints[m][rank], job=f"bench{i}") for i, m in enumerate(MODES)}
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        restores: dict[str, float] = {}

        def save(mode: str, step: int) -> tuple[float, float]:
            c = clients[mode]
            t0 = time.perf_counter()
            h = c.snapshot(model, optim, step=step, blocking=True)
            resume = time.perf_counter() - t0
            if mode == MODES[0]:
                with Channel(endpoints[mode][rank], 600) as rpc:
                    state = rpc.call("wait", job=c.job, step=step, timeout=600, persist=False)["state"]
                if state != "memory":
                    raise RuntimeError(f"step {step} did not complete across the daemons: {state}")
            else:
                h.wait(600)
            return resume, time.perf_counter() - t0

        step, last = 0, {m: 0 for m in MODES}
        for mode in MODES:  # warm: segments made, the ring named, the bucket's first upload done
            save(mode, step)
        for rep in range(args.reps):
            for mode in MODES[rep % 2 :] + MODES[: rep % 2]:
                step += 1
                dist.barrier()
                times[mode].append(save(mode, step))
                last[mode] = step
                dist.barrier()
        for mode in MODES:
            dist.barrier()
            t0 = time.perf_counter()
            clients[mode].restore(model, optim, hot=False)
            restores[mode] = time.perf_counter() - t0
            if clients[mode].last_restore["step"] != last[mode]:
                raise RuntimeError(f"{mode}: restored {clients[mode].last_restore}, not step {last[mode]}")
        for c in clients.values():
            c.close()
        nbytes = sum(t.numel() * t.element_size() for t in [p.to_local() for p in model.parameters()])
        out.put((rank, times, restores, nbytes))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _harness import DaemonProcess, gather
    from replication import s3_bucket
    from s3server import MotoServer

    from ckptd.peerkey import keygen

    work = tempfile.mkdtemp(prefix="ckmesh")
    moto = MotoServer(pathlib.Path(work) / "moto.log")
    daemons: list[DaemonProcess] = []
    ctx = mp.get_context("spawn")
    q, procs = ctx.Queue(), []
    try:
        key = os.path.join(work, "cluster.key")
        keygen(key)
        bucket = s3_bucket(moto, work)
        endpoints: dict[str, list[str]] = {m: [] for m in MODES}
        for i in range(NODES):
            for m, extra in zip(MODES, (["--peer-listen", f"tcp://127.0.0.1:{_free_port()}", "--peer-key", key, "--replicas", "1"],
                                        ["--config", bucket, "--keep", "1"])):  # fmt: skip
                name = f"{'mem' if m == MODES[0] else 's3'}{i}"
                d = DaemonProcess(os.path.join(work, name), f"ipc://{work}/{name}.sock", os.path.join(work, f"{name}.log"), extra)
                daemons.append(d)
                endpoints[m].append(d.endpoint)
        for d in daemons:
            d.wait_ready()
        procs = [ctx.Process(target=_rank, args=(r, args, endpoints, work, q)) for r in range(NODES)]
        for p in procs:
            p.start()
        got = gather(q, procs, 3600, lambda: "\n".join(d.log_tail() for d in daemons))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for d in daemons:
            d.stop()
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = {}
    for mode in MODES:
        per_rep = [[g[1][mode][i] for g in got] for i in range(args.reps)]  # each rep: every rank's (resume, complete)
        rows[mode] = {
            "resume_s": statistics.median(max(r for r, _ in rep) for rep in per_rep),
            "complete_s": statistics.median(max(c for _, c in rep) for rep in per_rep),
            "restore_s": max(g[2][mode] for g in got),
        }
    raw = {mode: {str(g[0]): {"saves": g[1][mode], "restore_s": g[2][mode]} for g in got} for mode in MODES}
    return {"rows": rows, "raw": raw, "param_bytes": sum(g[3] for g in got), "reps": args.reps, "gb": args.gb}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=0.25, help="state size in GB (parameters + AdamW state), over all ranks")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="bench-out/mesh.json")
    args = p.parse_args(argv)
    res = run(args)
    _report(args, res)
    return 0


def _report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    import torch
    from _harness import machine_info, write_json

    info = machine_info()
    print("## A job that spans nodes: steps in its daemons' memory against steps through a bucket\n")
    print(
        f"- {NODES} nodes x 1 rank, FSDP2 over gloo, {args.gb} GB of state (parameters + AdamW); torch {torch.__version__},"
        f" nproc {info.get('nproc')}; {args.reps} reps per mode, modes alternating, median of the slowest rank"
    )
    print("- resume: until the blocking snapshot returned; complete: until the step is complete across the nodes;")
    print("  restore: the newest step on every rank (from disk: pulled from the daemons, or downloaded), the slowest rank\n")
    print("| where the step completes | resume (s) | complete (s) | restore (s) |\n|---|---:|---:|---:|")
    for mode, row in res["rows"].items():
        print(f"| {mode} | {row['resume_s']:.3f} | {row['complete_s']:.3f} | {row['restore_s']:.3f} |")
    write_json(args.json, {**res, "machine": info})


if __name__ == "__main__":
    raise SystemExit(main())
