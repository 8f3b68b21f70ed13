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
            {"storage_writer": ckptd.dcp.Writer("bench", endpoint=endpoint), "checkpoint_id": step}
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
    bases: list[float] = []
    step = 0
    try:
        daemon.wait_ready()
        run_loop(model, optim, x, 3, args.every, None)  # warm-up
        for r in range(-1, args.rounds):  # round -1: untimed, every mode's one-time costs
            base, _ = run_loop(model, optim, x, args.steps, args.every, None)
            for mode in MODES:
                ck = saver(mode, model, optim, work, daemon.endpoint, resolved[mode] if r >= 0 else [])

                def call(i: int, ck: Callable = ck) -> None:
                    nonlocal step
                    step += 1
                    ck(step)

                total, _ = run_loop(model, optim, x, args.steps, args.every, call)
                ck.settle()  # type: ignore[attr-defined]
                if r >= 0:
                    overheads[mode].append((total - base) / n_ckpt)
                for name in os.listdir(work):  # the directory saves of this loop, gone before the next mode runs
                    if name.startswith("dir-"):
                        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
            if r >= 0:
                bases.append(base)
        with ckptd.Client(endpoint=daemon.endpoint, job="bench") as c:
            status = c.status()
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    info = machine_info()
    results = {
        m: {"overhead_per_ckpt_s": statistics.median(ov), "overheads_s": ov, "resolved_s": statistics.median(resolved[m])}
        for m, ov in overheads.items()
    }
    print("## ckptd.dcp.Writer against DCP's directory writer\n")
    print(
        f"- state {nbytes / 1e9:.3f} GB ({args.params / 1e6:.0f} M params + AdamW), batch {args.batch}, {args.steps} steps,"
        f" a checkpoint every {args.every} ({n_ckpt} per loop), {args.rounds} rounds; quiet loop {statistics.median(bases):.2f} s;"
        f" torch {torch.__version__}, nproc {info.get('nproc')}; daemon errors {status.get('errors')}\n"
    )
    print("| save | overhead per checkpoint (s): median (rounds) | call -> future resolved (s, median) |\n|---|---:|---:|")
    for m, res in results.items():
        rounds = " ".join(f"{v:.3f}" for v in res["overheads_s"])
        print(f"| {m} | {res['overhead_per_ckpt_s']:.3f} ({rounds}) | {res['resolved_s']:.3f} |")
    for kind in ("dcp.async_save", "dcp.save"):
        w, dflt = results[f"{kind} -> ckptd.dcp.Writer"], results[f"{kind} -> directory"]
        print(f"\n- {kind}: Writer overhead / directory overhead = {w['overhead_per_ckpt_s'] / dflt['overhead_per_ckpt_s']:.2f}")
    write_json(args.json, {"results": results, "bytes": nbytes, "machine": info, "args": vars(args), "baselines_s": bases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
