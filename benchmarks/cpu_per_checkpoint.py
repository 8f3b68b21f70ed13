"""CPU seconds per checkpoint: what one checkpoint costs the trainer's process and the daemon, counted in CPU
time rather than wall time.

    .venv/bin/python benchmarks/cpu_per_checkpoint.py [--params 5.5e6] [--checkpoints 12] [--rounds 3]

What it is for: a wall-clock overhead per checkpoint (training_loop.py) is the difference of two loop times of a few
seconds each, so on a shared 2-core machine its rounds scatter by tens of milliseconds; the CPU time the two processes
spend on a checkpoint is what that overhead is made of (on 2 cores the daemon's persisting competes with training),
and it moves far less with the load. ``before_after.py`` runs this script from the working tree against each
checkout's ``ckptd`` (it uses the public API only), so a change to either process's work shows up here first.

No training: one state (the training-loop model and AdamW state of ``--params``), snapshotted ``--checkpoints`` times
in a row per mode and round, after one untimed snapshot. For each checkpoint, from just before ``snapshot()`` to the
moment it is done (durable on disk; for the memory tier, held in the daemon's memory), the trainer process's and the
daemon process's CPU time (user + system, every thread; psutil), and the wall time; then the daemon is let settle
(``Client.wait()``) and its leftover CPU is added to that checkpoint. Modes: ``blocking`` (``blocking=True``),
``default`` (the default mode), ``memory`` (a job with ``persist_every`` far away: memory-only steps, done once
sealed into the daemon's memory, which a ``wait`` that does not ask for durability tells). The daemon's
idle CPU (per second, over ``--idle`` seconds with nothing to do) is measured once per round; the reference row (no
ckptd code) is the trainer's CPU time to copy the state into a preallocated buffer. Each CPU figure is the mean
over all checkpoints of all rounds (the kernel counts CPU time in clock ticks), the wall time their median. Prints a
table; writes ``bench-out/cpu_per_checkpoint.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import DaemonProcess, loop_state, machine_info, state_tensors, views_into, write_json  # noqa: E402

import ckptd  # noqa: E402
from ckptd.client.rpc import Channel  # noqa: E402

MODES = ("blocking", "default", "memory")
FAR = 1_000_000  # persist_every for the memory mode: no step persisted within a run (but its first)
JOB_MEMORY = "cpu-memory"


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc``, every thread."""
    t = proc.cpu_times()
    return t.user + t.system


def one_checkpoint(c: Any, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, mode: str,
                   me: psutil.Process, daemon: psutil.Process, rpc: Channel) -> dict[str, float]:  # fmt: skip
    """One checkpoint's trainer CPU, daemon CPU (its settling included) and wall time to done, in seconds."""
    c0, d0, t0 = cpu_s(me), cpu_s(daemon), time.perf_counter()
    h = c.snapshot(model, optim, step=step, blocking=mode == "blocking")
    if mode == "memory":
        h.wait_copied()
    else:
        h.wait()
    wall = time.perf_counter() - t0
    c1 = cpu_s(me)
    if mode == "memory":  # sealed into memory (a plain wait would persist it: a wait asks for durability)
        got = rpc.call("wait", job=JOB_MEMORY, step=step, timeout=60, persist=False)
        if got.get("state") != "memory":
            raise RuntimeError(f"step {step} of the memory-tier job is {got.get('state')}, not held in memory only")
    else:
        c.wait()  # the daemon's work on this step that runs after done (retention, bookkeeping)
    return {"trainer_cpu_s": c1 - c0, "daemon_cpu_s": cpu_s(daemon) - d0, "wall_s": wall}


def floor_cpu(model: torch.nn.Module, optim: torch.optim.Optimizer, reps: int) -> list[float]:
    """The trainer's CPU time to copy the state into one preallocated buffer, ``reps`` times."""
    src = state_tensors(model, optim)
    buf = torch.empty(sum(t.numel() * t.element_size() for t in src), dtype=torch.uint8)
    dst = views_into(buf, src)
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        for d, s in zip(dst, src):
            d.copy_(s)
        out.append(time.process_time() - t0)
    return out


def idle_cpu(daemon: psutil.Process, seconds: float) -> float:
    """The daemon's CPU seconds per second with nothing to do."""
    d0, t0 = cpu_s(daemon), time.perf_counter()
    time.sleep(seconds)
    return (cpu_s(daemon) - d0) / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, optim, _, nbytes = loop_state(args.params, 48)
    me = psutil.Process()
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    idle: list[float] = []
    work = tempfile.mkdtemp(prefix="ckcpu")
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    try:
        daemon.wait_ready()
        dproc = psutil.Process(daemon.proc.pid)
        with (
            ckptd.Client(endpoint=daemon.endpoint, job="cpu") as disk,
            ckptd.Client(endpoint=daemon.endpoint, job=JOB_MEMORY, persist_every=FAR) as mem,
            Channel(daemon.endpoint, 60.0) as rpc,
        ):
            clients = {"blocking": disk, "default": disk, "memory": mem}
            steps = {id(disk): 0, id(mem): 0}  # each job's last step
            for rnd in range(args.rounds + 1):  # round 0: one untimed checkpoint per mode
                if rnd:
                    idle.append(idle_cpu(dproc, args.idle))
                order = MODES[rnd % len(MODES) :] + MODES[: rnd % len(MODES)]
                for mode in order:
                    c = clients[mode]
                    for _ in range(args.checkpoints if rnd else 1):
                        steps[id(c)] += 1
                        got = one_checkpoint(c, model, optim, steps[id(c)], mode, me, dproc, rpc)
                        if rnd:
                            samples[mode].append(got)
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"samples": samples, "idle_cpu_per_s": idle, "floor_cpu_s": floor_cpu(model, optim, args.checkpoints), "bytes": nbytes}


def summarize(got: dict[str, Any]) -> dict[str, Any]:
    """Per mode, the CPU figures' means (s: the kernel counts CPU time in clock ticks, 10 ms here, so a sum over many
    checkpoints divided by their number resolves what one checkpoint's reading cannot) and the wall time's median;
    the floor's median; the idle daemon's mean CPU per second."""
    per_mode = {}
    for mode, rows in got["samples"].items():
        per_mode[mode] = {k: statistics.fmean(s[k] for s in rows) for k in ("trainer_cpu_s", "daemon_cpu_s")}
        per_mode[mode]["wall_s"] = statistics.median(s["wall_s"] for s in rows)
    floor, idle = statistics.median(got["floor_cpu_s"]), statistics.fmean(got["idle_cpu_per_s"])
    return {"modes": per_mode, "floor_cpu_s": floor, "idle_cpu_per_s": idle}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=5.5e6, help="the training-loop state's parameters (default 5.5e6)")
    p.add_argument("--checkpoints", type=int, default=12, help="timed checkpoints per mode and round (default 12)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, the modes' order rotating (default 3)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds the idle daemon is watched each round (default 2)")
    p.add_argument("--json", default="bench-out/cpu_per_checkpoint.json")
    args = p.parse_args(argv)
    got = run(args)
    summary = summarize(got)
    print(f"## CPU per checkpoint: state {got['bytes'] / 1e6:.0f} MB, {args.rounds} rounds x {args.checkpoints} checkpoints per mode\n")
    print("| mode | trainer CPU, mean (ms) | daemon CPU, mean (ms) | wall to done, median (ms) |\n|---|---:|---:|---:|")
    for mode, m in summary["modes"].items():
        print(f"| {mode} | {m['trainer_cpu_s'] * 1e3:.1f} | {m['daemon_cpu_s'] * 1e3:.1f} | {m['wall_s'] * 1e3:.1f} |")
    print(f"\n- reference (no ckptd): the trainer's CPU to copy the state once: {summary['floor_cpu_s'] * 1e3:.1f} ms")
    print(f"- idle daemon: {summary['idle_cpu_per_s'] * 1e3:.1f} ms of CPU per second")
    write_json(args.json, {"args": vars(args), "machine": machine_info(), "bytes": got["bytes"], **summary, "raw": got})
    return 0


if __name__ == "__main__":
    sys.exit(main())
