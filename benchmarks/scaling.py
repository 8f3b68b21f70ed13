"""Scaling: blocking-snapshot stall and time to durable over state size and ranks per daemon.

    .venv/bin/python benchmarks/scaling.py [--sizes 0.25,1,4] [--ranks 1,2,4] [--reps 3]

For each (state size, ranks): that many ranks on this node (gloo, FSDP2 ``fully_shard`` on a CPU
mesh, parameters created on the meta device so each rank allocates only its shard), one daemon.
Each rank reports its warm blocking-snapshot time and the floor (its shard copied into a
prefaulted /dev/shm buffer); the table shows the slowest rank. Prints a table; writes
``bench-out/scaling.json``.
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


def _rank(rank: int, world: int, params: float, endpoint: str, tmp: str, reps: int, out: Any) -> None:
    import mmap

    import torch
    import torch.distributed as dist
    from _harness import Block, shape_for, views_into
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        layers, d = shape_for(params)
        with torch.device("meta"):
            model = torch.nn.Sequential(*[Block(d) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (world,))
        for blk in model:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optim.step()
        local = [p.to_local() for p in model.parameters()] + [
            getattr(v, "_local_tensor", v) for st in optim.state.values() for v in st.values()
        ]
        nbytes = sum(t.numel() * t.element_size() for t in local)
        fd = os.open(f"/dev/shm/ckptd-scaling-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, max(nbytes, 1))
        mm = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.unlink(f"/dev/shm/ckptd-scaling-{os.getpid()}")
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        dsts = views_into(buf, local)

        def floor() -> float:
            t0 = time.perf_counter()
            torch._foreach_copy_(dsts, local)
            return time.perf_counter() - t0

        floor()
        floors, stalls, durables = [], [], []
        with ckptd.Client(endpoint=endpoint, job=f"s{world}-{params:.0f}") as c:
            c.prepare(model, optim)
            c.snapshot(model, optim, step=0, blocking=True).wait()
            for i in range(reps):
                dist.barrier()
                floors.append(floor())
                dist.barrier()
                t0 = time.perf_counter()
                h = c.snapshot(model, optim, step=i + 1, blocking=True)
                stalls.append(time.perf_counter() - t0)
                h.wait()
                durables.append(time.perf_counter() - t0)
        os.close(fd)  # the mapping goes with the process
        out.put((rank, statistics.median(floors), statistics.median(stalls), statistics.median(durables), nbytes))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.25,1,4", help="state sizes in GB (parameters + AdamW state)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="bench-out/scaling.json")
    args = p.parse_args(argv)
    from _harness import DaemonProcess, machine_info, write_json

    sizes = [float(x) for x in args.sizes.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    results = []
    ctx = mp.get_context("spawn")
    for gb in sizes:
        params = gb * 1e9 / 12  # float32 parameter + two AdamW moments
        for world in ranks:
            work = tempfile.mkdtemp(prefix="cksc")
            daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
            q = ctx.Queue()
            procs = []
            try:
                daemon.wait_ready()
                procs = [ctx.Process(target=_rank, args=(r, world, params, daemon.endpoint, work, args.reps, q)) for r in range(world)]
                for pr in procs:
                    pr.start()
                got: list[Any] = []
                deadline = time.monotonic() + 900
                while len(got) < world:
                    if any(pr.exitcode not in (None, 0) for pr in procs) or time.monotonic() > deadline:
                        raise RuntimeError(f"{gb} GB x {world} ranks: a rank failed or timed out")
                    try:
                        got.append(q.get(timeout=1.0))
                    except Exception:  # queue.Empty
                        continue
                for pr in procs:
                    pr.join(60)
                    if pr.exitcode != 0:
                        raise RuntimeError(f"a rank exited with {pr.exitcode}")
            finally:
                for pr in procs:
                    if pr.is_alive():
                        pr.kill()
                daemon.stop()
                shutil.rmtree(work, ignore_errors=True)
            row = {
                "gb": gb,
                "ranks": world,
                "floor_s": max(g[1] for g in got),
                "stall_s": max(g[2] for g in got),
                "durable_s": max(g[3] for g in got),
                "bytes": sum(g[4] for g in got),
            }
            results.append(row)
            print(
                f"{gb} GB x {world} ranks: stall {row['stall_s']:.3f} s, floor {row['floor_s']:.3f} s, durable {row['durable_s']:.2f} s",
                file=sys.stderr,
            )
    import torch

    info = machine_info()
    print("## ckptd scaling benchmark\n")
    print(
        f"- FSDP2 over gloo on one node, one daemon; torch {torch.__version__}, nproc {info.get('nproc')};"
        f" {args.reps} reps, median, slowest rank\n"
    )
    print("| state (GB) | ranks | floor (s) | blocking snapshot (s) | x floor | to durable (s) |\n|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ratio = r["stall_s"] / r["floor_s"]
        print(f"| {r['bytes'] / 1e9:.2f} | {r['ranks']} | {r['floor_s']:.3f} | {r['stall_s']:.3f} | {ratio:.2f} | {r['durable_s']:.2f} |")
    write_json(args.json, {"results": results, "machine": info})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
