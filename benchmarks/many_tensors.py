"""Many small tensors: per-tensor overhead of ckptd's snapshot against a plain copy of the same tensors.

    .venv/bin/python benchmarks/many_tensors.py [--layers 1250] [--reps 7]

A stack of ``layers`` Linear(32, 32) layers with AdamW state: 4 tensors per layer, 10,000 by
default (16 MB). The floor is one fused ``torch._foreach_copy_`` (the call ckptd copies with) of every state
tensor into views of one prefaulted buffer, measured in the same run; a Python loop of ``copy_`` into the same
views is shown beside it. The job's first blocking snapshot (full state capture, slot allocation) is timed until
it returns, as the warm rows are, and separately until it is durable. Then ``prepare()``, so the warm rows find
the slots made; each warm blocking snapshot is paired with a floor copy, the pair's order alternating from rep to
rep (neither always runs right after the previous snapshot's ``wait()``). Then the last step is restored from disk
(page cache warm) into a second model and optimizer, beside torch's own ``Module.load_state_dict`` of the same
model's state (part of every restore: ckptd hands the loaded state to ``set_state_dict``). Prints a markdown table
("x floor": each median / the fused floor's median) and the criterion (median of the per-pair ratios warm
blocking / fused floor); writes ``bench-out/many_tensors.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import DaemonProcess, alternate, machine_info, views_into, write_json  # noqa: E402

import ckptd  # noqa: E402

TARGET = 1.3  # the issue's: warm blocking snapshot <= 1.3 x the fused floor
NAMES = {
    "floor": "floor: one fused torch._foreach_copy_ of the same tensors into a prefaulted buffer",
    "floor_loop": "for information: a Python loop of copy_ into the same buffer",
    "blocking_first": "ckptd snapshot(blocking=True), first (full capture, slot allocation): until it returns",
    "blocking_first_durable": "the same first snapshot: call -> h.wait() (includes persisting)",
    "blocking": "ckptd snapshot(blocking=True), warm (after prepare()): until it returns",
    "default": "ckptd snapshot() default, warm: until it returns",
    "capture": "part: a full state capture (get_state_dict + flatten), first snapshot only",
    "fingerprint": "part: the capture cache's fingerprint check, every snapshot",
    "restore": "ckptd.restore of the last step from disk (page cache warm), into a second model + AdamW",
    "torch_load": "part of it: torch's Module.load_state_dict of the same model state",
}


def build(layers: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 32)).sum().backward()
    optim.step()
    return model, optim


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_capture(rows: dict[str, list[float]], model: torch.nn.Module, optim: torch.optim.Optimizer, reps: int) -> None:
    """The two halves of a snapshot's state capture, alone."""
    from ckptd.client.capture import StateCapture, _fingerprint

    for _ in range(reps):
        rows["capture"].append(timed(lambda: StateCapture().capture(model, optim)))
        rows["fingerprint"].append(timed(lambda: _fingerprint(model, optim)))


def measure_snapshots(
    rows: dict[str, list[float]],
    c: ckptd.Client,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    floor: Callable[[], float],
    reps: int,
) -> tuple[str, list[float]]:
    """The first snapshot, then ``reps`` warm blocking snapshots paired with floor copies, and warm default
    snapshots; the last step's directory and the per-pair ratios."""
    t0 = time.perf_counter()
    h = c.snapshot(model, optim, step=0, blocking=True)
    rows["blocking_first"].append(time.perf_counter() - t0)
    path = h.wait()
    rows["blocking_first_durable"].append(time.perf_counter() - t0)
    c.prepare(model, optim)  # else the job's second snapshot makes a second slot: a cold sample in the warm row
    floor()
    ratios = []
    for i in range(reps):

        def blocking(step: int = 2 * i + 1) -> float:
            t0 = time.perf_counter()
            h = c.snapshot(model, optim, step=step, blocking=True)
            dt = time.perf_counter() - t0
            h.wait()
            return dt

        f, b = alternate(i, floor, blocking)
        rows["floor"].append(f)
        rows["blocking"].append(b)
        ratios.append(b / f)
        t0 = time.perf_counter()
        h = c.snapshot(model, optim, step=2 * i + 2)
        rows["default"].append(time.perf_counter() - t0)
        path = h.wait()
    return path, ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=1250)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default="bench-out/many_tensors.json")
    args = p.parse_args(argv)
    model, optim = build(args.layers, seed=0)
    tensors = [t for t in model.state_dict().values()] + [v for st in optim.state.values() for v in st.values()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)  # prefaulted
    dsts = views_into(buf, tensors)

    def floor() -> float:
        return timed(lambda: torch._foreach_copy_(dsts, tensors))

    def floor_loop() -> None:
        for d, s in zip(dsts, tensors):
            d.copy_(s)

    work = tempfile.mkdtemp(prefix="ckmt")
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    rows: dict[str, list[float]] = {k: [] for k in NAMES}
    measure_capture(rows, model, optim, args.reps)
    floor_loop()
    rows["floor_loop"] = [timed(floor_loop) for _ in range(args.reps)]
    try:
        daemon.wait_ready()
        with ckptd.Client(endpoint=daemon.endpoint, job="many") as c:
            path, ratios = measure_snapshots(rows, c, model, optim, floor, args.reps)
        m2, o2 = build(args.layers, seed=1)
        ckptd.restore(m2, o2, path=path)  # warms the page cache and the restore path
        state = model.state_dict()
        for _ in range(args.reps):
            rows["restore"].append(timed(lambda: ckptd.restore(m2, o2, path=path)))
            rows["torch_load"].append(timed(lambda: m2.load_state_dict(state)))
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, rows, ratios, len(tensors), nbytes)
    return 0


def report(args: argparse.Namespace, rows: dict[str, list[float]], ratios: list[float], ntensors: int, nbytes: int) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    info = machine_info()
    print("## ckptd many-tensors benchmark\n")
    print(f"- {ntensors} tensors, {nbytes / 1e6:.1f} MB; torch {torch.__version__}, nproc {info.get('nproc')}; {args.reps} reps, median")
    print("- x floor: each median / the median of the fused floor (first row)\n")
    print("| measurement | median (s) | x floor | per tensor (us) |\n|---|---:|---:|---:|")
    for k, name in NAMES.items():
        print(f"| {name} | {med[k]:.4f} | {med[k] / med['floor']:.2f} | {med[k] / ntensors * 1e6:.2f} |")
    paired = statistics.median(ratios)
    print(
        f"\n- warm blocking snapshot / fused floor, median of the {len(ratios)} per-pair ratios = {paired:.2f}"
        f" (issue target <= {TARGET}): **{'PASS' if paired <= TARGET else 'MISS'}**"
    )
    print(f"- for information: warm blocking / fused floor, unpaired medians = {med['blocking'] / med['floor']:.2f};"
          f" warm blocking / copy_ loop = {med['blocking'] / med['floor_loop']:.2f}")  # fmt: skip
    write_json(
        args.json,
        {"tensors": ntensors, "bytes": nbytes, "samples": rows, "median": med, "paired_ratios": ratios, "paired_ratio_median": paired,
         "ratios_are_against": "floor: one fused torch._foreach_copy_ into a prefaulted buffer", "target": TARGET, "machine": info},
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
