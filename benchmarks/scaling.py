"""Scaling: blocking-snapshot stall and time to durable over state size and ranks per daemon.

    .venv/bin/python benchmarks/scaling.py [--sizes 0.25,1,4] [--ranks 1,2,4] [--reps 3]

For each (state size, ranks): that many ranks on this node (gloo, FSDP2 ``fully_shard`` on a CPU
mesh, parameters created on the meta device so each rank allocates only its shard), one daemon.
Each rank reports its warm blocking-snapshot time and the floor (its shard copied, in one fused
``torch._foreach_copy_``, into a prefaulted /dev/shm buffer), a floor copy beside each snapshot, the pair's order
alternating from rep to rep (so neither always runs right after the previous snapshot's ``wait()``); the table
shows the slowest rank, and the highest of the ranks' median per-pair ratios. Prints a table; writes
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


def _sharded_state(world: int, params: float, rank: int) -> tuple[Any, Any, list[Any]]:
    """The FSDP2 model (parameters made on the meta device, then this rank's shard) and AdamW with its state, and the
    rank's local tensors."""
    import torch
    from _harness import Block, shape_for
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

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
    return model, optim, local


def _rank(rank: int, world: int, params: float, endpoint: str, tmp: str, reps: int, out: Any) -> None:
    import mmap

    import torch
    import torch.distributed as dist
    from _harness import alternate, views_into

    import ckptd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        model, optim, local = _sharded_state(world, params, rank)
        nbytes = sum(t.numel() * t.element_size() for t in local)
        fd = os.open(f"/dev/shm/ckptd-scaling-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, max(nbytes, 1))
        mm = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.unlink(f"/dev/shm/ckptd-scaling-{os.getpid()}")
        dsts = views_into(torch.frombuffer(mm, dtype=torch.uint8), local)

        def floor() -> float:
            dist.barrier()
            t0 = time.perf_counter()
            torch._foreach_copy_(dsts, local)
            return time.perf_counter() - t0

        floor()
        floors, stalls, durables = [], [], []
        with ckptd.Client(endpoint=endpoint, job=f"s{world}-{params:.0f}") as c:
            c.prepare(model, optim)
            c.snapshot(model, optim, step=0, blocking=True).wait()
            for i in range(reps):

                def snap(step: int = i + 1) -> tuple[float, float]:
                    dist.barrier()
                    t0 = time.perf_counter()
                    h = c.snapshot(model, optim, step=step, blocking=True)
                    stall = time.perf_counter() - t0
                    h.wait()
                    return stall, time.perf_counter() - t0

                # the pair's order alternates (the same on every rank): neither always follows the previous wait()
                f, (stall, durable) = alternate(i, floor, snap)
                floors.append(f)
                stalls.append(stall)
                durables.append(durable)
        os.close(fd)  # the mapping goes with the process
        paired = statistics.median(s / f for s, f in zip(stalls, floors))
        out.put((rank, statistics.median(floors), statistics.median(stalls), statistics.median(durables), nbytes, paired))
    finally:
        dist.destroy_process_group()


def _run_config(gb: float, world: int, reps: int, ctx: Any) -> dict[str, Any]:
    """``world`` ranks on a state of ``gb`` GB, one daemon of their own: the slowest rank's figures."""
    from _harness import DaemonProcess, gather

    params = gb * 1e9 / 12  # float32 parameter + two AdamW moments
    work = tempfile.mkdtemp(prefix="cksc")
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    q = ctx.Queue()
    procs = []
    try:
        daemon.wait_ready()
        procs = [ctx.Process(target=_rank, args=(r, world, params, daemon.endpoint, work, reps, q)) for r in range(world)]
        for pr in procs:
            pr.start()
        got = gather(q, procs, 900, lambda: f"{gb} GB x {world} ranks")
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {
        "gb": gb,
        "ranks": world,
        "floor_s": max(g[1] for g in got),
        "stall_s": max(g[2] for g in got),
        "durable_s": max(g[3] for g in got),
        "bytes": sum(g[4] for g in got),
        "paired_x_floor": max(g[5] for g in got),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.25,1,4", help="state sizes in GB (parameters + AdamW state)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="bench-out/scaling.json")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = []
    for gb in [float(x) for x in args.sizes.split(",")]:
        for world in [int(x) for x in args.ranks.split(",")]:
            row = _run_config(gb, world, args.reps, ctx)
            results.append(row)
            print(
                f"{gb} GB x {world} ranks: stall {row['stall_s']:.3f} s, floor {row['floor_s']:.3f} s, durable {row['durable_s']:.2f} s",
                file=sys.stderr,
            )
    _report(args, results)
    return 0


def _report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    import torch
    from _harness import machine_info, write_json

    info = machine_info()
    print("## ckptd scaling benchmark\n")
    print(
        f"- FSDP2 over gloo on one node, one daemon; torch {torch.__version__}, nproc {info.get('nproc')};"
        f" {args.reps} reps, median, slowest rank"
    )
    print(
        "- x floor: the slowest rank's median blocking snapshot / the slowest rank's median floor copy; paired x floor: per"
        " rank, the median of its per-rep ratios (snapshot / the floor copy beside it, the pair's order alternating), the"
        " highest over the ranks\n"
    )
    print(
        "| state (GB) | ranks | floor (s) | blocking snapshot (s) | x floor | paired x floor | to durable (s) |"
        "\n|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in results:
        ratio = r["stall_s"] / r["floor_s"]
        print(
            f"| {r['bytes'] / 1e9:.2f} | {r['ranks']} | {r['floor_s']:.3f} | {r['stall_s']:.3f} | {ratio:.2f}"
            f" | {r['paired_x_floor']:.2f} | {r['durable_s']:.2f} |"
        )
    write_json(args.json, {"results": results, "x_floor_is": "slowest rank's stall / slowest rank's floor", "machine": info})


if __name__ == "__main__":
    raise SystemExit(main())
