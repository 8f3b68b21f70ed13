"""GPU mode: device-to-host bandwidth of ckptd's snapshot against a plain pinned-memory copy.

    .venv/bin/python benchmarks/gpu_copy.py [--gb 1.0] [--reps 5]

Needs CUDA (exits 0 with a message without it). The state: float32 tensors of 64 MiB on the GPU
plus AdamW-sized companions; the reference: copying the same tensors into one pinned host buffer
with non_blocking=True on a side stream. Prints a table; writes ``bench-out/gpu_copy.json``.
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
from _harness import DaemonProcess, views_into, write_json  # noqa: E402

import ckptd  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="parameters in GB (the state is 3x with AdamW)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default="bench-out/gpu_copy.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_copy: no CUDA device here; nothing to measure")
        return 0
    n = max(1, int(args.gb * 1e9 / (64 << 20)))
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16 << 20, device="cuda")) for _ in range(n)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for q in model:
        q.grad = torch.randn_like(q)
    optim.step()
    tensors = list(model) + [v for st in optim.state.values() for v in st.values() if v.is_cuda]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dsts = views_into(pinned, tensors)
    stream = torch.cuda.Stream()

    def reference() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for d, s in zip(dsts, tensors):
                d.copy_(s, non_blocking=True)
        stream.synchronize()
        return time.perf_counter() - t0

    work = tempfile.mkdtemp(prefix="ckgpu")
    daemon = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
    rows: dict[str, list[float]] = {"pinned": [], "blocking": [], "default": []}
    try:
        daemon.wait_ready()
        with ckptd.Client(endpoint=daemon.endpoint, job="gpu") as c:
            c.prepare(model, optim)
            c.snapshot(model, optim, step=0, blocking=True).wait()
            reference()
            for i in range(args.reps):
                rows["pinned"].append(reference())
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                c.snapshot(model, optim, step=2 * i + 1, blocking=True).wait_copied()
                rows["blocking"].append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = c.snapshot(model, optim, step=2 * i + 2)
                rows["default"].append(time.perf_counter() - t0)
                h.wait()
            c.wait()
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"## ckptd GPU copy benchmark ({torch.cuda.get_device_name()})\n")
    print(f"- {nbytes / 1e9:.2f} GB of state on the GPU in {len(tensors)} tensors; {args.reps} reps, median\n")
    print("| measurement | median (s) | GB/s |\n|---|---:|---:|")
    print(f"| pinned host buffer, side stream (reference) | {med['pinned']:.4f} | {nbytes / med['pinned'] / 1e9:.1f} |")
    print(f"| ckptd snapshot(blocking=True): bytes in shared memory | {med['blocking']:.4f} | {nbytes / med['blocking'] / 1e9:.1f} |")
    print(f"| ckptd snapshot() default: until it returns | {med['default']:.4f} | |")
    write_json(args.json, {"bytes": nbytes, "samples": rows, "median": med, "device": torch.cuda.get_device_name()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
