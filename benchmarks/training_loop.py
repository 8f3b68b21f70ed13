"""Training-loop overhead per checkpoint, ckptd against dcp.async_save, in one run on one state.

    .venv/bin/python benchmarks/training_loop.py [--params 22e6] [--steps 36] [--every 6] [--rounds 6]

A loop of forward + backward + AdamW step whose compute takes longer than copying the state; a
checkpoint every ``every`` steps. Overhead per checkpoint = (loop time with checkpoints - loop time
without) / number of checkpoints. Every mode, ckptd's and DCP's alike, runs once in each of ``--rounds`` rounds,
against a baseline loop (no checkpoints) run at the start of that round, in an order that rotates each round,
after an untimed round of them all; the median over rounds is reported, the rounds in brackets. Modes: ckptd
default mode (``overlap="auto"``: on this CPU-only state it copies before returning, as blocking does), ckptd
blocking, ckptd default mode with a memory tier (one snapshot in ``--persist-every`` persisted, the others held in
the daemon's shared memory only: the daemon's persisting competes with training for the CPU less often), ckptd
default mode with ``overlap="always"`` (the optimizer's tensors copied by a background thread behind the next step:
what the default mode did on CPU before), and dcp.async_save in thread and process mode (one save in flight, as
users run it; each DCP mode gets one untimed save first, which for process mode spawns its checkpoint process).
Every mode's checkpoints are durable, and DCP's directories removed, before the next mode runs.

It also compares with a quiet step the steps that overlap the trainer's background copy (from ``snapshot()``
until the copy ends) and, separately, the steps while the checkpoint is persisted (ckptd: from the commit until
the step is durable, the daemon's own cost to training; DCP: from ``async_save``'s return until its future
resolves, its writer thread or process). The quiet step, the denominator of every such ratio, is one pooled
figure: the median step time of all timed rounds' baseline loops. Prints a table; writes
``bench-out/training_loop.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import DaemonProcess, fds_to, loop_parser, loop_state, machine_info, stop_dcp_checkpoint_process, write_json  # noqa: E402

import ckptd  # noqa: E402

OVERLAP_MODE = "ckptd default, overlap=always"
PERSIST_TARGET = 1.10  # step while persisting / quiet step


class Run(NamedTuple):
    loop_s: float
    base_s: float  # its round's baseline loop
    windows: list[list[float]]  # each checkpoint's (call, copy done, durable)
    spans: list[tuple[float, float]]  # each step's (start, end)
    calls: list[float]  # each checkpoint call's time
    allocs_waited: int | None  # ckptd: the daemon's allocations that waited meanwhile


def run_loop(model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, steps: int, every: int,
             ckpt: Callable[[int], Any] | None) -> tuple[float, list[tuple[float, float]]]:  # fmt: skip
    """Total loop time and each step's (start, end)."""
    spans = []
    t_start = time.perf_counter()
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optim.step()
        if ckpt is not None and i % every == 0:
            ckpt(i)
        spans.append((t0, time.perf_counter()))
    return time.perf_counter() - t_start, spans


def measure(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    x: torch.Tensor,
    args: argparse.Namespace,
    c: Any,
    blocking: bool,
    first: int,
    memory_only: bool,
) -> Run:
    """One loop with ckptd checkpoints (steps from ``first + 1``): its time, each checkpoint's window (snapshot()
    called, copy committed, durable), each step's span, each snapshot() call's time and how many of the daemon's
    allocations waited (for memory or a segment being made) meanwhile. ``memory_only``: no wait (it would
    persist the step)."""
    waited = c.status()["allocs_waited"]
    windows: list[list[float]] = []
    calls: list[float] = []  # each snapshot() call's own time
    waiters = []

    def ckpt(i: int) -> None:
        t0 = time.perf_counter()
        h = c.snapshot(model, optim, step=first + len(windows) + 1, blocking=blocking)
        calls.append(time.perf_counter() - t0)
        w = [t0, float("inf"), float("inf")]
        windows.append(w)

        def mark() -> None:
            h.wait_copied()
            w[1] = time.perf_counter()
            if memory_only:  # the copy's end is the end
                w[2] = w[1]
                return
            h.wait()
            w[2] = time.perf_counter()

        th = threading.Thread(target=mark)
        th.start()
        waiters.append(th)

    total, spans = run_loop(model, optim, x, args.steps, args.every, ckpt)
    for th in waiters:
        th.join()
    c.wait()
    return Run(total, 0.0, windows, spans, calls, c.status()["allocs_waited"] - waited)


def measure_dcp(model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, args: argparse.Namespace, work: str,
                kw: dict[str, Any]) -> Run:  # fmt: skip
    """One loop with ``dcp.async_save`` checkpoints, one in flight (a save first waits for the previous future): each
    checkpoint's window (the call, its return: the state staged, the future resolved: durable), as :func:`measure`.
    Every save is durable and its directory removed when this returns."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    loop_dir = tempfile.mkdtemp(prefix="dcp-", dir=work)
    futs: list[Any] = []
    windows: list[list[float]] = []
    calls: list[float] = []

    def ckpt(i: int) -> None:
        if futs:
            futs[-1].result()  # one in flight at a time, as users run it
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, optim)
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(loop_dir, str(i)), **kw)
        w = [t0, time.perf_counter(), float("inf")]
        calls.append(w[1] - t0)
        windows.append(w)
        fut.add_done_callback(lambda _f, w=w: w.__setitem__(2, time.perf_counter()))
        futs.append(fut)

    try:
        total, spans = run_loop(model, optim, x, args.steps, args.every, ckpt)
        for f in futs:
            f.result()
    finally:
        shutil.rmtree(loop_dir, ignore_errors=True)
    return Run(total, 0.0, windows, spans, calls, None)


def dcp_warm_up(model: torch.nn.Module, optim: torch.optim.Optimizer, work: str, kw: dict[str, Any]) -> None:
    """One untimed save, waited for (process mode: it spawns the checkpoint process, whose request log goes to a file)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    d = tempfile.mkdtemp(prefix="dcp-warm-", dir=work)
    try:
        with fds_to(os.path.join(work, "dcp-process.log")) if kw else contextlib.nullcontext():
            msd, osd = get_state_dict(model, optim)
            dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=d, **kw).result()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def round_order(r: int, n_modes: int) -> list[int]:
    """The order of the modes in round ``r``: ckptd default (0) and blocking (1), which differ only by what precedes
    them, run side by side, the first of them alternating from round to round; that pair and every other mode (2, 3,
    ...) rotate. In a run at a fixed rotation of the four ckptd modes (2026-11-24), default, which then always came
    after overlap=always or first, cost +0.031 s per checkpoint more than blocking (median of the rounds'
    differences), on the same code path."""
    pair = [0, 1] if r % 2 == 0 else [1, 0]
    units = [pair, *([k] for k in range(2, n_modes))]
    k = r % len(units)
    return [n for unit in units[k:] + units[:k] for n in unit]


def summarize(runs: list[Run], n_ckpt: int, quiet_step: float) -> dict[str, Any]:
    """A mode's rounds: the median overhead per checkpoint (each loop against its round's baseline) and the median
    step times while the trainer copies / while the checkpoint is persisted, pooled over rounds, each also as a
    ratio to ``quiet_step`` (the baselines' pooled median step)."""

    def overlaps(s: float, e: float, a: float, b: float) -> bool:
        return s < b and e > a

    copying, persisting = [], []
    for _, _, windows, spans, _, _ in runs:
        # the step that calls the checkpoint is the checkpoint's own overhead, in neither set
        later = [(s, e) for s, e in spans if not any(s <= w[0] <= e for w in windows)]
        copying += [e - s for s, e in later if any(overlaps(s, e, w[0], w[1]) for w in windows)]
        persisting += [e - s for s, e in later if any(overlaps(s, e, w[1], w[2]) for w in windows)
                       and not any(overlaps(s, e, w[0], w[1]) for w in windows)]  # fmt: skip
    overheads = [(r.loop_s - r.base_s) / n_ckpt for r in runs]
    calls = [t for r in runs for t in r.calls]
    waited = [r.allocs_waited for r in runs if r.allocs_waited is not None]
    out: dict[str, Any] = {
        "loop_s": statistics.median(r.loop_s for r in runs),
        "call_s": {"median": statistics.median(calls), "max": max(calls)},
        "allocs_waited": sum(waited) if waited else None,
        "overhead_per_ckpt_s": statistics.median(overheads),
        "overheads_s": overheads,
        "steps_counted": {"copying": len(copying), "persisting": len(persisting)},
    }
    for key, steps in (("copying", copying), ("persisting", persisting)):
        out[f"step_while_{key}_s"] = statistics.median(steps) if steps else None
        out[f"step_while_{key}_over_quiet"] = statistics.median(steps) / quiet_step if steps else None
    return out


def run_rounds(
    modes: list[tuple[str, Callable[[int], Run]]], args: argparse.Namespace, model: torch.nn.Module, optim: torch.optim.Optimizer,
    x: torch.Tensor,
) -> tuple[dict[str, list[Run]], list[float], list[float]]:  # fmt: skip
    """Every mode once a round, after that round's baseline loop, in :func:`round_order`; round 0 untimed (a mode's
    first loops pay one-time costs: the first loop measured after the set-up, the default mode's, cost 0.45-0.69 s per
    checkpoint against 0.03-0.23 s in later rounds, three runs, 2026-11-24). Each mode's runs (with their round's
    baseline), the timed baselines' loop times, and their step times pooled."""
    runs: dict[str, list[Run]] = {m: [] for m, _ in modes}
    bases: list[float] = []
    base_steps: list[float] = []
    for r in range(args.rounds + 1):
        round_base, spans = run_loop(model, optim, x, args.steps, args.every, None)
        if r:
            bases.append(round_base)
            base_steps += [e - s for s, e in spans]
        for k, n in enumerate(round_order(r, len(modes))):  # step numbers rise through the run: a job's steps never go back
            mode, fn = modes[n]
            got = fn(100_000 * r + 10_000 * k)
            if r:
                runs[mode].append(got._replace(base_s=round_base))
    return runs, bases, base_steps


def dcp_modes(args: argparse.Namespace, model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor,
              work: str) -> list[tuple[str, Callable[[int], Run]]]:  # fmt: skip
    """dcp.async_save's modes, each after one untimed save. Process mode's checkpoint process joins a process group:
    a 1-rank gloo group, made here (ckptd runs no collective at world size 1, so its modes are unaffected)."""
    kws: list[tuple[str, dict[str, Any]]] = [("dcp.async_save thread", {})]
    if not args.skip_process:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=0, world_size=1)
        kws.append(("dcp.async_save process", {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}))
    modes = []
    for name, kw in kws:
        dcp_warm_up(model, optim, work, kw)
        modes.append((name, lambda first, kw=kw: measure_dcp(model, optim, x, args, work, kw)))
    return modes


def main(argv: list[str] | None = None) -> int:
    p = loop_parser(__doc__, "bench-out/training_loop.json")
    p.add_argument("--skip-process", action="store_true")
    p.add_argument("--persist-every", type=int, default=3, help="the memory-tier mode persists one snapshot in N")
    p.add_argument("--rounds", type=int, default=6, help="every mode runs this many times, each round against a baseline of its own")
    args = p.parse_args(argv)
    model, optim, x, nbytes = loop_state(args.params, args.batch)
    n_ckpt = args.steps // args.every
    work = tempfile.mkdtemp(prefix="cktl")
    memory_mode = f"ckptd default, memory tier (1 in {args.persist_every} persisted)"
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    try:
        daemon.wait_ready()
        run_loop(model, optim, x, 3, args.every, None)  # warm-up
        with (
            ckptd.Client(endpoint=daemon.endpoint, job="loop") as c0,
            ckptd.Client(endpoint=daemon.endpoint, job="loop-memory", persist_every=args.persist_every) as c1,
            ckptd.Client(endpoint=daemon.endpoint, job="loop-overlap", overlap="always") as c2,
        ):
            for c in (c0, c1, c2):
                c.prepare(model, optim)
            specs = [("ckptd default", False, c0, False), ("ckptd blocking", True, c0, False), (memory_mode, False, c1, True),
                     (OVERLAP_MODE, False, c2, False)]  # fmt: skip
            modes = [(m, lambda first, b=b, c=c, mem=mem: measure(model, optim, x, args, c, b, first, mem)) for m, b, c, mem in specs]
            modes += dcp_modes(args, model, optim, x, work)
            runs, bases, base_steps = run_rounds(modes, args, model, optim, x)
    finally:
        stop_dcp_checkpoint_process()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    quiet = statistics.median(base_steps)
    results: dict[str, Any] = {"no checkpoints": {"loop_s": statistics.median(bases), "runs_s": bases, "quiet_step_s": quiet}}
    results.update({m: summarize(got, n_ckpt, quiet) for m, got in runs.items()})
    paired = [(d.loop_s - b.loop_s) / n_ckpt for d, b in zip(runs["ckptd default"], runs["ckptd blocking"])]
    report(args, results, paired, nbytes, len(base_steps), memory_mode)
    return 0


def report(args: argparse.Namespace, results: dict[str, Any], paired: list[float], nbytes: int, pooled: int, memory_mode: str) -> None:
    info = machine_info()
    n_ckpt = args.steps // args.every
    base = results["no checkpoints"]
    quiet = base["quiet_step_s"]
    print("## ckptd training-loop benchmark\n")
    print(
        f"- state {nbytes / 1e9:.3f} GB ({args.params / 1e6:.0f} M params + AdamW), batch {args.batch}, {args.steps} steps,"
        f" a checkpoint every {args.every} ({n_ckpt} checkpoints); {args.rounds} timed rounds, every mode once a round against"
        f" that round's baseline loop (baselines {min(base['runs_s']):.2f}-{max(base['runs_s']):.2f} s: the noise floor of the"
        f" overheads); torch {torch.__version__}, nproc {info.get('nproc')}"
    )
    print(
        f"- quiet step: {quiet:.3f} s, the median step of the timed baselines ({pooled} steps pooled): the denominator of"
        " both step ratios, for every mode\n"
    )
    print(
        "| saver | loop (s, median) | overhead per checkpoint (s): median (rounds) | step during the background copy / quiet step"
        " | step while persisting (ckptd: the daemon; DCP: its writer) / quiet step | checkpoint call, median / max (s)"
        " | allocations that waited |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for mode, r in results.items():
        if mode == "no checkpoints":
            print(f"| {mode} (median of the round baselines) | {r['loop_s']:.2f} | | | | | |")
            continue
        ratios = [f"{r[f'step_while_{k}_over_quiet']:.2f} ({r['steps_counted'][k]} steps)" if r[f"step_while_{k}_s"] else ""
                  for k in ("copying", "persisting")]  # fmt: skip
        cell = f"{r['overhead_per_ckpt_s']:.3f} ({' '.join(f'{v:.3f}' for v in r['overheads_s'])})"
        call = f"{r['call_s']['median']:.3f} / {r['call_s']['max']:.3f}"
        waited = "" if r["allocs_waited"] is None else r["allocs_waited"]
        print(f"| {mode} | {r['loop_s']:.2f} | {cell} | {ratios[0]} | {ratios[1]} | {call} | {waited} |")
    print_ratios(results, paired, memory_mode)
    write_json(
        args.json,
        {"results": results, "default_minus_blocking_s": paired, "quiet_step_is": "median step of the timed round baselines, pooled",
         "bytes": nbytes, "machine": info, "args": vars(args)},
    )  # fmt: skip


def print_ratios(results: dict[str, Any], paired: list[float], memory_mode: str) -> None:
    ov = {m: r["overhead_per_ckpt_s"] for m, r in results.items() if "overhead_per_ckpt_s" in r}
    dcp = {m: v for m, v in ov.items() if m.startswith("dcp")}
    best = min(dcp, key=lambda m: dcp[m], default=None)
    block = ov["ckptd blocking"]
    print(f"\n- ckptd default overhead / ckptd blocking overhead = {ov['ckptd default'] / block:.2f} (medians over rounds)")
    print(
        f"- ckptd default - ckptd blocking, paired in each round: median {statistics.median(paired):+.3f} s per checkpoint"
        f" ({' '.join(f'{v:+.3f}' for v in paired)}) (target <= 0: default <= blocking, measured side by side)"
    )
    print(
        f"- {OVERLAP_MODE} overhead / ckptd blocking overhead = {ov[OVERLAP_MODE] / block:.2f}"
        " (the background copy on CPU state, which the default mode's overlap=auto does not use)"
    )
    if best is not None and dcp[best] > 0:
        print(f"- ckptd default overhead / {best} overhead (the lower of the DCP modes) = {ov['ckptd default'] / dcp[best]:.2f}")
        print(f"- {memory_mode} overhead / {best} overhead = {ov[memory_mode] / dcp[best]:.2f} (target <= 0.5)")
    for mode in ("ckptd default", "ckptd blocking", *dcp):
        ratio = results[mode]["step_while_persisting_over_quiet"]
        if ratio is not None:
            target = f" (target <= {PERSIST_TARGET:.2f})" if mode.startswith("ckptd") else " (for comparison)"
            print(f"- {mode}: step while persisting / quiet step (the pooled baseline median) = {ratio:.2f}{target}")


if __name__ == "__main__":
    raise SystemExit(main())
