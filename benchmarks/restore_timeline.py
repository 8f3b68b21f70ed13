"""Where a hot restore into a GPU spends its time, phase by phase (issue 39): one model + AdamW on the GPU, one step
snapshotted into a daemon, then hot restores in turn under several variants, each timed from the call:

- ``shipped``: as ckptd restores;
- ``unchecked``: no checksum verified (what the checks cost; never shipped);
- ``populated``: the segment's mapping given its page tables up front (``MAP_POPULATE``) before it is registered.

Per variant, the median over ``--reps`` of: the step open (its manifest read), the read starting, the last range
registered and every copy enqueued (the registered path, segments on huge pages), the read returning (every check
done), the copies ending (``Uploads.finish``), and the restore returning.

    bash benchmarks/on_device.sh timeline --reps 5    # on the device: on huge pages, then on 4 KiB pages

An experiment measured with it (docs/bench/gpu/register_ahead_*): registering the segment on a thread from the moment
the step is open, while the restore plans. The plan takes ~15 ms, registering bounds the path (~24 GB/s), and
registering beside the copies slowed them: 354 ms against 284 ms inline; it was taken out.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Block, DaemonProcess, shape_for  # noqa: E402

import ckptd  # noqa: E402
from ckptd.client import cuda, hotreg  # noqa: E402
from ckptd.client.reader import CheckpointReader  # noqa: E402

MARKS = ("open", "read", "registered", "enqueued", "checked", "copied", "returned")
EVENTS: dict[str, float] = {}
T0 = [0.0]


def mark(name: str, last: bool = False) -> None:
    """Record ``name`` at its first time (``last``: at its latest) since the restore was called."""
    t = time.perf_counter() - T0[0]
    if last or name not in EVENTS:
        EVENTS[name] = t


@contextlib.contextmanager
def patched(obj: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    real = getattr(obj, name)
    setattr(obj, name, make(real))
    try:
        yield
    finally:
        setattr(obj, name, real)


def timed(real: Callable[..., Any], before: str | None = None, after: str | None = None, last: bool = False) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        if before:
            mark(before)
        out = real(*a, **k)
        if after:
            mark(after, last)
        return out

    return run


def variant(name: str) -> contextlib.ExitStack:
    """The patches that time a restore's phases, and those that make variant ``name``."""
    stack = contextlib.ExitStack()
    stack.enter_context(patched(CheckpointReader, "_check_step", lambda real: timed(real, after="open")))
    stack.enter_context(patched(cuda.Uploads, "register_range", lambda real: timed(real, after="registered", last=True)))
    stack.enter_context(patched(CheckpointReader, "read_many", lambda real: timed(real, before="read", after="checked")))
    stack.enter_context(patched(hotreg.RegisteredRead, "_copy_segment", lambda real: timed(real, after="enqueued", last=True)))
    stack.enter_context(patched(cuda.Uploads, "finish", lambda real: timed(real, after="copied", last=True)))
    if name == "unchecked":
        stack.enter_context(patched(CheckpointReader, "_check", lambda real: lambda *a, **k: None))
    elif name == "populated":
        stack.enter_context(patched(CheckpointReader, "_mapped", lambda real: lambda self, n, populate=True: real(self, n, True)))
    elif name != "shipped":
        raise SystemExit(f"no variant {name!r}: shipped, unchecked or populated")
    return stack


def build(params: float, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers, d = shape_for(params)
    with torch.device(device):
        model = nn.Sequential(*[Block(d) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, d, device=device)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=5e8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--variants", default="shipped,unchecked,populated")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = args.variants.split(",")
    model, optim = build(args.params, device)
    nbytes = sum(t.numel() * t.element_size() for t in list(model.state_dict().values()) + list(_optim_tensors(optim)))
    work = tempfile.mkdtemp(prefix="ckptd-timeline-")
    dp = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "daemon.log"))
    times: dict[str, dict[str, list[float]]] = {n: {m: [] for m in MARKS} for n in names}
    try:
        dp.wait_ready()
        with ckptd.Client(endpoint=dp.endpoint, job="timeline") as c:
            c.snapshot(model, optim, step=1, blocking=True).wait()
            del model, optim
            torch.cuda.empty_cache() if device.type == "cuda" else None
            target, topt = build(args.params, device)
            c.restore(target, topt)  # the optimizer's state tensors exist from here, as in every rep
            for _, name in itertools.product(range(args.reps), names):
                EVENTS.clear()
                with variant(name):
                    torch.cuda.synchronize() if device.type == "cuda" else None
                    T0[0] = time.perf_counter()
                    c.restore(target, topt)
                    torch.cuda.synchronize() if device.type == "cuda" else None
                    mark("returned")
                for m in MARKS:
                    if m in EVENTS:
                        times[name][m].append(EVENTS[m])
    finally:
        dp.stop(60)
    print(f"hot restore of {nbytes / 1e9:.2f} GB into {device}; /dev/shm {hotreg.mount_of('/dev/shm')}; {args.reps} reps, median ms")
    print("| variant | " + " | ".join(MARKS) + " |")
    print("|---|" + "---:|" * len(MARKS))
    for name in names:
        cells = [f"{statistics.median(v) * 1e3:.1f}" if v else "" for v in times[name].values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _optim_tensors(optim: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for st in optim.state.values():
        yield from (v for v in st.values() if isinstance(v, torch.Tensor))


if __name__ == "__main__":
    main()
