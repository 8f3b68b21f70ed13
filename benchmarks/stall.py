"""Stall benchmark: how long a checkpoint holds up the training thread, ckptd against torch's savers.

One process, one model + AdamW state (default: 88M float32 parameters, about 1.06 GB of state),
every measurement on that same state in one run:

* floor (:mod:`_floor`): every tensor copied, in one fused ``torch._foreach_copy_`` (the call ckptd copies with),
  into a prefaulted, persistently mapped /dev/shm buffer (the least a blocking staging copy can cost): alone, and
  once more beside each warm blocking ckptd snapshot, the pair's order alternating from rep to rep so that neither
  always runs right after the previous snapshot's ``wait()`` (the per-pair ratio holds up when other processes
  share the CPUs and memory bus);
* ckptd ``snapshot(blocking=True)``: the job's first call separately (it allocates the slot), then warm calls
  after ``prepare()`` (without it the job's second snapshot would make a second slot: a cold sample in the warm
  row; the row's note says how many slots the timed loop made), default ``snapshot()`` (on this CPU-only state
  ``overlap="auto"`` copies before returning, as blocking does; on GPU state it returns before the copy, which
  finishes in a background thread), and time to durable (call until ``handle.wait()`` returns);
* (:mod:`_savers`) ``torch.save`` + fsync, ``dcp.save``, and ``dcp.async_save`` in thread mode and, with a 1-rank
  gloo group, process mode (default stager, and a persistent shared-memory stager).

Every ckptd step is made durable, and every saver's output removed, before the next measurement.
Prints a markdown table (median seconds and, "x floor", the ratio to the floor measured alone) and the
acceptance ratios, each naming what it is against: the warm blocking snapshot <= 1.1 x the paired floor (median
of the per-pair ratios), and <= 0.7 x the lowest warm stall among this run's ``dcp.async_save`` rows (thread,
process, process with the shared-memory stager; the row used is named). Writes everything as JSON (``--json``).
The exit status is 0 when a target is missed (this is a report) and nonzero only on errors.

Usage: ``.venv/bin/python benchmarks/stall.py [--params 88e6 | --size-gb 1.06] [--reps 5] [--json PATH]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _floor import Floor, log, measure_floor  # noqa: E402
from _harness import DaemonProcess, Results, alternate, build_state, dir_bytes, machine_info, shape_for, state_tensors, write_json  # noqa: E402
from _savers import measure_async_process, measure_async_save, measure_dcp_save, measure_torch_save  # noqa: E402

import ckptd  # noqa: E402

BLOCKING_FLOOR_TARGET = 1.1  # the issue's: warm blocking snapshot <= 1.1 x the floor (median of the paired ratios)
VS_ASYNC_SAVE_TARGET = 0.7  # the issue's: warm blocking snapshot <= 0.7 x the best dcp.async_save warm stall of the run
DCP_ASYNC_KEYS = ("dcp_async_thread", "dcp_async_process", "dcp_async_process_shm")


class Snapper:
    """A client's snapshots of one model + optimizer, numbered 1, 2, ...: each timed from the call."""

    def __init__(self, client: ckptd.Client, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.client, self.model, self.optim = client, model, optim
        self.step = 0

    def call(self, blocking: bool) -> tuple[ckptd.SnapshotHandle, float]:
        self.step += 1
        t0 = time.perf_counter()
        return self.client.snapshot(self.model, self.optim, step=self.step, blocking=blocking), t0

    def blocking(self) -> tuple[float, float]:
        """One blocking snapshot: (call -> return, call -> durable)."""
        h, t0 = self.call(True)
        t1 = time.perf_counter()
        h.wait()
        return t1 - t0, time.perf_counter() - t0


def slot_count(client: ckptd.Client) -> int:
    return sum((client.status().get("slots") or {}).values())


def measure_first(res: Results, sn: Snapper, endpoint: str, info: dict[str, Any]) -> None:
    """The job's first snapshot (no prepare(): it makes the slot), and a first snapshot after prepare() in a job of its own."""
    h, t0 = sn.call(True)
    first = time.perf_counter() - t0
    path = h.wait()
    first_row = res.row("ckptd_first", "ckptd snapshot(blocking=True), first (allocation): until it returns")
    first_row.samples.append(first)
    first_row.note = f"durable after {time.perf_counter() - t0:.2f} s"
    info["checkpoint_bytes_on_disk"] = dir_bytes(path)
    log(f"ckptd first snapshot: {first:.3f} s, durable at {path}")
    with ckptd.Client(endpoint=endpoint, job="bench-prepared") as prepared:
        t0 = time.perf_counter()
        prepared.prepare(sn.model, sn.optim)
        prep_row = res.row("ckptd_prepare", "ckptd prepare() at start-up (one-time, outside the loop)")
        prep_row.samples.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        h = prepared.snapshot(sn.model, sn.optim, step=1, blocking=True)
        res.row("ckptd_first_prepared", "ckptd snapshot(blocking=True), first after prepare()").samples.append(time.perf_counter() - t0)
        h.wait()
    log(f"ckptd prepare: {prep_row.samples[0]:.3f} s, then first snapshot {res.rows['ckptd_first_prepared'].samples[0]:.3f} s")


def measure_blocking(res: Results, sn: Snapper, floor: Floor, reps: int, info: dict[str, Any]) -> None:
    """Warm blocking snapshots, each paired with a floor copy (the pair's order alternating): both see the same machine
    state, so their ratio holds up when other processes share the memory bus."""
    sn.client.prepare(sn.model, sn.optim)  # else the job's second snapshot makes a second slot: a cold sample in the warm row
    pool = slot_count(sn.client)
    blk = res.row("ckptd_blocking", "ckptd snapshot(blocking=True), warm: until it returns")
    blk_d = res.row("ckptd_blocking_durable", "ckptd snapshot(blocking=True): call -> h.wait() (durable)")
    paired = res.row("floor_paired", "floor, paired: one copy beside each warm blocking snapshot (order alternating)")
    for i in range(reps):
        f, (ret, dur) = alternate(i, floor.sample, sn.blocking)
        paired.samples.append(f)
        blk.samples.append(ret)
        blk_d.samples.append(dur)
    grew = slot_count(sn.client) - pool
    blk.note = f"after prepare(): {pool} slot(s), " + (
        f"{grew} made during the timed loop" if grew > 0 else "none made during the timed loop"
    )
    info["pool_slots"] = {"before_loop": pool, "made_during_loop": max(0, grew)}
    info["paired_ratios"] = [b / f for b, f in zip(blk.samples, paired.samples)]
    log(f"ckptd blocking: {blk.median:.4f} s (durable {blk_d.median:.3f} s), paired floor {paired.median:.4f} s; pool grew by {grew}")


def measure_default(res: Results, sn: Snapper, reps: int) -> None:
    dflt = res.row("ckptd_default", "ckptd snapshot() default (overlap=auto), warm: until it returns")
    copied = res.row("ckptd_default_copied", "ckptd snapshot() default: call -> copy committed")
    durable = res.row("ckptd_durable", "ckptd time to durable: snapshot() call -> h.wait()")
    for _ in range(reps):
        h, t0 = sn.call(False)
        t1 = time.perf_counter()
        h.wait_copied()
        t2 = time.perf_counter()
        h.wait()
        t3 = time.perf_counter()
        dflt.samples.append(t1 - t0)
        copied.samples.append(t2 - t0)
        durable.samples.append(t3 - t0)
    copied.note = "bounds optimizer.step() wait"
    log(f"ckptd default: {dflt.median:.4f} s (copied {copied.median:.3f} s, durable {durable.median:.3f} s)")


def profile_blocking(sn: Snapper) -> str:
    """cProfile of one warm blocking snapshot (after one more untimed, so it is like the measured ones)."""
    sn.blocking()
    pr = cProfile.Profile()
    pr.enable()
    h, _ = sn.call(True)
    pr.disable()
    h.wait()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def measure_ckptd(
    res: Results, model: torch.nn.Module, optim: torch.optim.Optimizer, floor: Floor, workdir: str, reps: int, profile: bool
) -> dict[str, Any]:
    root = os.path.join(workdir, "ckptd-root")
    endpoint = f"ipc://{os.path.join(workdir, 'sock', 'ckptd.sock')}"
    info: dict[str, Any] = {"root": root, "endpoint": endpoint}
    daemon = DaemonProcess(root, endpoint, os.path.join(workdir, "ckptd.log"))
    client: ckptd.Client | None = None
    ok = False
    try:
        daemon.wait_ready()
        client = ckptd.Client(endpoint=endpoint, job="bench")
        sn = Snapper(client, model, optim)
        measure_first(res, sn, endpoint, info)
        measure_blocking(res, sn, floor, reps, info)
        measure_default(res, sn, reps)
        if profile:
            info["profile"] = profile_blocking(sn)
        info["status"] = {k: v for k, v in client.status().items() if k in ("persisted_bytes", "persist_seconds", "steps_committed")}
        ok = True
    finally:
        if client is not None:
            client.close()
        rc = daemon.stop()
        if not ok:
            print(f"ckptd daemon log (tail):\n{daemon.log_tail()}", file=sys.stderr)
        info["daemon_exit"] = rc
    if rc != 0:
        raise RuntimeError(f"ckptd serve exited with status {rc}:\n{daemon.log_tail()}")
    return info


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--params", type=float, default=88e6, help="model parameters (float32; state = 12 B/param with AdamW). Default 88e6")
    size.add_argument("--size-gb", type=float, default=None, help="state size in GB (10^9 B) instead of --params, e.g. 1.06")
    p.add_argument("--reps", type=int, default=5, help="repetitions of the fast measurements (default 5)")
    p.add_argument("--slow-reps", type=int, default=3, help="repetitions of torch.save, dcp.save, process mode, disk (default 3)")
    p.add_argument("--json", default="bench-out/stall.json", help="where to write the results (default bench-out/stall.json)")
    p.add_argument("--workdir", default=None, help="parent of the temp dir for checkpoints (default: the system temp dir)")
    p.add_argument("--skip-process", action="store_true", help="skip dcp.async_save process mode")
    p.add_argument("--profile", action="store_true", help="cProfile one warm blocking ckptd snapshot and print the top entries")
    a = p.parse_args(argv)
    if a.size_gb is not None:
        a.params = a.size_gb * 1e9 / 12
    if a.reps < 1 or a.slow_reps < 1:
        p.error("--reps and --slow-reps must be >= 1")
    return a


def verdict(ratio: float | None, target: float) -> str:
    return "n/a" if ratio is None else "PASS" if ratio <= target else "FAIL"


def best_async(res: Results) -> str | None:
    """The key of the dcp.async_save row with the lowest warm stall (median) in this run, or ``None``."""
    keys = [k for k in DCP_ASYNC_KEYS if res.median(k) is not None]
    return min(keys, key=lambda k: res.median(k) or 0.0, default=None)


def criteria(res: Results, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The acceptance ratios, each saying what it is against. The paired ratio is the floor criterion: each warm
    blocking snapshot against a floor copy taken beside it (order alternating), so both see the same machine; the
    unpaired medians' ratio compares rows measured at different moments and is shown for information."""
    pairs = extra.get("ckptd", {}).get("paired_ratios") or []
    r_paired = statistics.median(pairs) if pairs else None
    best = best_async(res)
    r_async = res.ratio("ckptd_blocking", best) if best else None
    against = f"{res.rows[best].name} (the lowest warm stall of the dcp.async_save rows)" if best else "no dcp.async_save row measured"
    return [
        {
            "name": "ckptd warm blocking snapshot / paired floor copy (median of the per-pair ratios)",
            "against": "floor_paired",
            "ratio": r_paired,
            "target": f"<= {BLOCKING_FLOOR_TARGET}",
            "verdict": verdict(r_paired, BLOCKING_FLOOR_TARGET),
        },
        {
            "name": f"ckptd warm blocking snapshot (median) / {against}",
            "against": best,
            "ratio": r_async,
            "target": f"<= {VS_ASYNC_SAVE_TARGET}",
            "verdict": verdict(r_async, VS_ASYNC_SAVE_TARGET),
        },
        {
            "name": "(for information) ckptd warm blocking snapshot / floor, unpaired medians",
            "against": "floor",
            "ratio": res.ratio("ckptd_blocking", "floor"),
            "target": "-",
            "verdict": "info",
        },
    ]


def report(res: Results, crit: list[dict[str, Any]], mach: dict[str, Any], state: dict[str, Any], args: argparse.Namespace) -> str:
    ram = f"{mach['ram_bytes'] / 2**30:.1f} GiB" if mach["ram_bytes"] else "unknown"
    load_start, load_end = mach["loadavg_start"], mach["loadavg_end"]
    nbytes = state["bytes"]
    lines = [
        "## ckptd stall benchmark",
        "",
        f"- machine: nproc {mach['nproc']}, RAM {ram}, CPU {mach['cpu_model']}, kernel {mach['kernel']}",
        f"- python {mach['python']}, torch {mach['torch']} ({mach['torch_threads']} intra-op threads)",
        f"- state: {state['params'] / 1e6:.2f} M float32 params ({state['layers']} x Block(d={state['d_model']})) + AdamW state = "
        f"{nbytes / 1e9:.3f} GB ({nbytes / 2**30:.3f} GiB) in {state['tensors']} tensors",
        f"- reps: {args.reps} (fast rows), {args.slow_reps} (torch.save, dcp.save, process mode, disk); median shown; "
        f"total run {state['elapsed_s']:.0f} s",
        f"- load average (1/5/15 min) at start {'/'.join(f'{x:.2f}' for x in load_start)}, "
        f"at end {'/'.join(f'{x:.2f}' for x in load_end)}" + ("  (other processes were busy: expect noise)" if load_start[0] > 0.5 else ""),
        "- x floor: each row's median / the median of the first row (the floor copy measured alone)",
        "",
        res.markdown("floor"),
        "",
    ]
    for c in crit:
        ratio = "n/a" if c["ratio"] is None else f"{c['ratio']:.2f}"
        target = "" if c["verdict"] == "info" else f" (target {c['target']}): **{c['verdict']}**"
        lines.append(f"- {c['name']} = {ratio}{target}")
    return "\n".join(lines)


def measure_all(
    args: argparse.Namespace, model: torch.nn.Module, optim: torch.optim.Optimizer, tensors: list[torch.Tensor]
) -> tuple[Results, dict[str, Any]]:
    """Every measurement, in order, on the one state: the rows and the extra information."""
    workdir = tempfile.mkdtemp(prefix="ckptd-stall-", dir=args.workdir)
    res = Results()
    extra: dict[str, Any] = {}
    floor: Floor | None = None
    try:
        floor = Floor(tensors)
        measure_floor(res, floor, workdir, args.reps, args.slow_reps)
        extra["ckptd"] = measure_ckptd(res, model, optim, floor, workdir, args.reps, args.profile)
        floor.close()
        measure_torch_save(res, model, optim, workdir, args.slow_reps)
        measure_dcp_save(res, model, optim, workdir, args.slow_reps)
        measure_async_save(res, model, optim, workdir, args.reps, "dcp_async_thread", "thread")
        if not args.skip_process:
            extra["process_mode_error"] = measure_async_process(res, model, optim, workdir, args.slow_reps)
    finally:
        if floor is not None:
            floor.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return res, extra


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    t_start = time.perf_counter()
    mach = machine_info()
    mach["loadavg_start"] = os.getloadavg()
    layers, d = shape_for(args.params)
    log(f"building {layers} x Block(d={d}) + AdamW")
    model, optim = build_state(args.params)
    tensors = state_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    nparams = sum(p.numel() for p in model.parameters())
    res, extra = measure_all(args, model, optim, tensors)
    mach["loadavg_end"] = os.getloadavg()
    state = {"bytes": nbytes, "tensors": len(tensors), "params": nparams, "layers": layers, "d_model": d}
    state["elapsed_s"] = elapsed = time.perf_counter() - t_start
    crit = criteria(res, extra)
    print(report(res, crit, mach, state, args))
    if args.profile and "profile" in extra.get("ckptd", {}):
        print("\n### cProfile of one warm blocking ckptd snapshot\n\n```\n" + extra["ckptd"]["profile"].strip() + "\n```")
    out = {
        "benchmark": "stall",
        "machine": mach,
        "config": {"params": nparams, "layers": layers, "d_model": d, "reps": args.reps, "slow_reps": args.slow_reps},
        "state": {"bytes": nbytes, "tensors": len(tensors), "params": nparams},
        "rows": res.to_json("floor"),
        "ratio_to_floor_is_against": "floor",
        "criteria": crit,
        "extra": extra,
        "elapsed_s": elapsed,
        "unix_time": time.time(),
    }
    write_json(args.json, out)
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
