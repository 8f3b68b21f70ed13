"""``dcp.async_save`` / ``dcp.save`` through ``ckptd.dcp.Writer`` against the same calls to a directory, in one run.

    .venv/bin/python benchmarks/dcp_writer.py [--params 22e6] [--steps 36] [--every 6] [--rounds 3]

The training loop of ``training_loop.py`` (forward + backward + AdamW, a checkpoint every ``every`` steps) with
the state dict DCP users save (``get_state_dict``), in four modes run interleaved in ``--rounds`` rounds after an
untimed warm-up, each round against a baseline loop of its own:

- ``dcp.async_save -> directory``: DCP's default ``FileSystemWriter`` in its default thread mode (its default
  stager copies the state into CPU memory first); one save in flight at a time, as torchtitan runs it (the
  next save waits for the previous future).
- ``dcp.async_save -> ckptd.dcp.Writer``: the same call with ``storage_writer=ckptd.dcp.Writer(job)``.
- ``dcp.save -> directory`` and ``dcp.save -> ckptd.dcp.Writer``: the blocking call.

The four modes' order rotates from round to round, and after each Writer loop the next mode waits until the daemon
has persisted that loop's steps (``status``: the job's newest durable step, none in flight), so that the daemon's
writes do not run into the next mode's loop; the seconds it went on persisting after the loop are reported.
Overhead per checkpoint = (loop time with checkpoints - the round's loop without) / checkpoints, median over
rounds (the rounds in brackets). Also the median time from the call until the save's future resolved
(directory: files written and fsynced; Writer: the daemon holds every byte and the step is complete in its
memory — it reaches the disk after). Prints a table; writes ``bench-out/dcp_writer.json``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import DaemonProcess, loop_parser, loop_state, machine_info, write_json  # noqa: E402
from training_loop import run_loop  # noqa: E402

import ckptd.dcp  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def saver(mode: str, model: torch.nn.Module, optim: torch.optim.Optimizer, work: str, endpoint: str, resolved: list[float]) -> Callable:
    """The checkpoint call of ``mode``; appends to ``resolved`` each save's call-to-future time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    futs: list[tuple[float, Any]] = []
    to_ckptd = mode.endswith("Writer")

    def settle() -> None:
        if futs:
            _, f = futs.pop()
            f.result()

    def ckpt(step: int) -> None:
        settle()  # one save in flight at a time
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        target: dict[str, Any] = (
            {"storage_writer": ckptd.dcp.Writer(JOB, endpoint=endpoint), "checkpoint_id": step}
            if to_ckptd
            else {"checkpoint_id": f"{work}/dir-{step}"}
        )
        t0 = time.perf_counter()
        if mode.startswith("dcp.async_save"):
            fut = dcp.async_save(state, **target)
            fut.add_done_callback(lambda _, t0=t0: resolved.append(time.perf_counter() - t0))  # when it resolved, not when asked
            futs.append((t0, fut))
        else:
            dcp.save(state, **target)
            resolved.append(time.perf_counter() - t0)

    ckpt.settle = settle  # type: ignore[attr-defined]
    return ckpt


MODES = ("dcp.async_save -> directory", "dcp.async_save -> ckptd.dcp.Writer", "dcp.save -> directory", "dcp.save -> ckptd.dcp.Writer")
JOB = "bench"


def wait_persisted(c: ckptd.Client, step: int, timeout: float = 600.0) -> float:
    """Wait until the daemon has persisted the Writer's job through ``step`` (``status``: the job's newest durable
    step is ``step`` and none is in flight), so that its writes do not run into the next mode's loop; seconds waited."""
    t0 = time.perf_counter()
    while True:
        job = (c.status().get("jobs") or {}).get(JOB, {})
        if job.get("latest") == step and not job.get("in_flight"):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"step {step} of job {JOB} not persisted after {timeout:.0f} s: {job}")
        time.sleep(0.02)


def run_mode(mode: str, args: Any, state: tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor], work: str, c: ckptd.Client,
             resolved: list[float], steps: list[int]) -> tuple[float, float | None]:  # fmt: skip
    """One loop of ``mode``; its time, and for a Writer mode the seconds the daemon went on persisting after it. Every
    save is durable, and the directory saves removed, when this returns."""
    model, optim, x = state
    ck = saver(mode, model, optim, work, c.endpoint, resolved)

    def call(i: int) -> None:
        steps[0] += 1
        ck(steps[0])

    total, _ = run_loop(model, optim, x, args.steps, args.every, call)
    ck.settle()  # type: ignore[attr-defined]
    tail = wait_persisted(c, steps[0]) if mode.endswith("Writer") else None
    for name in os.listdir(work):  # the directory saves of this loop, gone before the next mode runs
        if name.startswith("dir-"):
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    return total, tail


def main(argv: list[str] | None = None) -> int:
    p = loop_parser(__doc__, "bench-out/dcp_writer.json")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    model, optim, x, nbytes = loop_state(args.params, args.batch)
    n_ckpt = args.steps // args.every
    work = tempfile.mkdtemp(prefix="cktw")
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    overheads: dict[str, list[float]] = {m: [] for m in MODES}
    resolved: dict[str, list[float]] = {m: [] for m in MODES}
    tails: dict[str, list[float]] = {m: [] for m in MODES if m.endswith("Writer")}
    bases: list[float] = []
    steps = [0]
    try:
        daemon.wait_ready()
        with ckptd.Client(endpoint=daemon.endpoint, job=f"{JOB}-status") as c:  # status only: the Writer has its own
            run_loop(model, optim, x, 3, args.every, None)  # warm-up
            for r in range(-1, args.rounds):  # round -1: untimed, every mode's one-time costs
                base, _ = run_loop(model, optim, x, args.steps, args.every, None)
                k = r % len(MODES)  # the order rotates from round to round
                for mode in MODES[k:] + MODES[:k]:
                    total, tail = run_mode(mode, args, (model, optim, x), work, c, resolved[mode] if r >= 0 else [], steps)
                    if r >= 0:
                        overheads[mode].append((total - base) / n_ckpt)
                        if tail is not None:
                            tails[mode].append(tail)
                if r >= 0:
                    bases.append(base)
            status = c.status()
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, overheads, resolved, tails, bases, status, nbytes)
    return 0


def report(args: Any, overheads: dict[str, list[float]], resolved: dict[str, list[float]], tails: dict[str, list[float]],
           bases: list[float], status: dict[str, Any], nbytes: int) -> None:  # fmt: skip
    info = machine_info()
    n_ckpt = args.steps // args.every
    results = {
        m: {"overhead_per_ckpt_s": statistics.median(ov), "overheads_s": ov, "resolved_s": statistics.median(resolved[m]),
            "persisting_after_loop_s": tails.get(m)}
        for m, ov in overheads.items()
    }  # fmt: skip
    print("## ckptd.dcp.Writer against DCP's directory writer\n")
    print(
        f"- state {nbytes / 1e9:.3f} GB ({args.params / 1e6:.0f} M params + AdamW), batch {args.batch}, {args.steps} steps,"
        f" a checkpoint every {args.every} ({n_ckpt} per loop), {args.rounds} rounds, the modes' order rotating each round;"
        f" quiet loop {statistics.median(bases):.2f} s; torch {torch.__version__}, nproc {info.get('nproc')};"
        f" daemon errors {status.get('errors')}"
    )
    print(
        "- overhead: each loop against its round's baseline loop; after each Writer loop the next mode waits until the"
        " daemon has persisted the loop's steps (the seconds it went on in the last column)\n"
    )
    print(
        "| save | overhead per checkpoint (s): median (rounds) | call -> future resolved (s, median) | daemon persisting after"
        " the loop (s, median) |\n|---|---:|---:|---:|"
    )
    for m, res in results.items():
        rounds = " ".join(f"{v:.3f}" for v in res["overheads_s"])
        tail = f"{statistics.median(res['persisting_after_loop_s']):.3f}" if res["persisting_after_loop_s"] else ""
        print(f"| {m} | {res['overhead_per_ckpt_s']:.3f} ({rounds}) | {res['resolved_s']:.3f} | {tail} |")
    print()
    for kind in ("dcp.async_save", "dcp.save"):
        w, dflt = results[f"{kind} -> ckptd.dcp.Writer"], results[f"{kind} -> directory"]
        ratio = w["overhead_per_ckpt_s"] / dflt["overhead_per_ckpt_s"] if dflt["overhead_per_ckpt_s"] > 0 else float("nan")
        print(f"- {kind}: Writer overhead / directory overhead (medians over rounds) = {ratio:.2f}")
    write_json(args.json, {"results": results, "bytes": nbytes, "machine": info, "args": vars(args), "baselines_s": bases})


if __name__ == "__main__":
    raise SystemExit(main())
