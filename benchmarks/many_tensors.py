"""Many small tensors: per-tensor overhead of ckptd's snapshot against a plain copy of the same tensors.

    .venv/bin/python benchmarks/many_tensors.py [--layers 1250] [--reps 7]

A stack of ``layers`` Linear(32, 32) layers with AdamW state: 4 tensors per layer, 10,000 by
default (16 MB). The floor is a Python loop of ``copy_`` of every state tensor into one prefaulted
buffer, measured in the same run. Then the last step is restored from disk (page cache warm) into a
second model and optimizer, beside torch's own ``Module.load_state_dict`` of the same model's state
(part of every restore: ckptd hands the loaded state to ``set_state_dict``). Prints a markdown table;
writes ``bench-out/many_tensors.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import DaemonProcess, machine_info, views_into, write_json  # noqa: E402

import ckptd  # noqa: E402


def build(layers: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 32)).sum().backward()
    optim.step()
    return model, optim


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
        t0 = time.perf_counter()
        for d, s in zip(dsts, tensors):
            d.copy_(s)
        return time.perf_counter() - t0

    work = tempfile.mkdtemp(prefix="ckmt")
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    rows: dict[str, list[float]] = {
        "floor": [], "blocking_first": [], "blocking": [], "default": [], "capture": [], "fingerprint": [], "restore": [], "torch_load": [],
    }  # fmt: skip
    from ckptd.client.capture import StateCapture, _fingerprint

    for _ in range(args.reps):  # the two halves of a snapshot's state capture, alone
        t0 = time.perf_counter()
        StateCapture().capture(model, optim)
        rows["capture"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _fingerprint(model, optim)
        rows["fingerprint"].append(time.perf_counter() - t0)
    try:
        daemon.wait_ready()
        with ckptd.Client(endpoint=daemon.endpoint, job="many") as c:
            t0 = time.perf_counter()
            c.snapshot(model, optim, step=0, blocking=True).wait()
            rows["blocking_first"].append(time.perf_counter() - t0)
            floor()
            for i in range(args.reps):
                rows["floor"].append(floor())
                t0 = time.perf_counter()
                h = c.snapshot(model, optim, step=2 * i + 1, blocking=True)
                rows["blocking"].append(time.perf_counter() - t0)
                h.wait()
                t0 = time.perf_counter()
                h = c.snapshot(model, optim, step=2 * i + 2)
                rows["default"].append(time.perf_counter() - t0)
                path = h.wait()
        m2, o2 = build(args.layers, seed=1)
        ckptd.restore(m2, o2, path=path)  # warms the page cache and the restore path
        state = model.state_dict()
        for _ in range(args.reps):
            t0 = time.perf_counter()
            ckptd.restore(m2, o2, path=path)
            rows["restore"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m2.load_state_dict(state)
            rows["torch_load"].append(time.perf_counter() - t0)
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    info = machine_info()
    print("## ckptd many-tensors benchmark\n")
    print(
        f"- {len(tensors)} tensors, {nbytes / 1e6:.1f} MB; torch {torch.__version__}, nproc {info.get('nproc')}; {args.reps} reps, median\n"
    )
    print("| measurement | median (s) | x floor | per tensor (us) |\n|---|---:|---:|---:|")
    names = {
        "floor": "floor: copy_ loop of the same tensors into a prefaulted buffer",
        "blocking_first": "ckptd snapshot(blocking=True), first (full capture, allocation)",
        "blocking": "ckptd snapshot(blocking=True), warm",
        "default": "ckptd snapshot() default, warm: until it returns",
        "capture": "part: a full state capture (get_state_dict + flatten), first snapshot only",
        "fingerprint": "part: the capture cache's fingerprint check, every snapshot",
        "restore": "ckptd.restore of the last step from disk (page cache warm), into a second model + AdamW",
        "torch_load": "part of it: torch's Module.load_state_dict of the same model state",
    }
    for k, name in names.items():
        print(f"| {name} | {med[k]:.4f} | {med[k] / med['floor']:.2f} | {med[k] / len(tensors) * 1e6:.2f} |")
    ratio = med["blocking"] / med["floor"]
    print(f"\n- blocking / floor = {ratio:.2f} (issue target <= 1.3): **{'PASS' if ratio <= 1.3 else 'MISS'}**")
    write_json(args.json, {"tensors": len(tensors), "bytes": nbytes, "samples": rows, "median": med, "machine": info})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
