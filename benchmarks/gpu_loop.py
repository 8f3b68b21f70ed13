"""GPU training-loop benchmark: what a checkpoint costs a training loop on the device, ckptd against a
device-to-host floor and torch DCP's async savers, and what a restore costs against the host-to-device floors.
Every mode runs in one process, on one state, between two checkpoint-free baselines.

On the GPU box (one H100; the defaults: 0.5e9 fp32 parameters, 6 GB of state with AdamW, a batch of 4096, 40 steps,
a checkpoint every 10):

    pip install -e . matplotlib     # ckptd's dependencies (pyzmq, psutil, xxhash, boto3, prometheus-client); matplotlib: the plot
    python benchmarks/gpu_loop.py

Through the ``device`` tool, whose machine cannot download: ``make device-wheels`` here, then
``bash benchmarks/on_device.sh loop [arguments]`` there, carrying ``.whl`` (see that script).

It needs 3.5x the state in /dev/shm (within half of it: the daemon's default budget; else it says so and exits 2)
and about 5x on the work directory's disk (``--workdir``, default ``$CKPTD_BENCH_DIR`` or the temp dir). It writes
about 60 copies of the state in all (360 GB at the defaults: every ckptd and DCP checkpoint is made durable before
the next mode; each daemon keeps its default 3 steps), so the disk sets much of the run time (3 minutes of writing at 2 GB/s).
On cuda it leaves out the modes not started after ``--max-minutes`` (default 8: a command may run 10 minutes on the
GPU box), marked skipped, and still ends with the closing baseline and the report; run those in a second call with
``--modes`` (the floor is always measured), e.g. ``--modes lag-wait,lag-memory,dcp-thread,dcp-thread-pinned`` and
``--modes dcp-thread-pinned-fresh,dcp-process,dcp-process-pinned,dcp-process-pinned-fresh``.
Progress goes to stderr with timestamps.

Here (no GPU: every code path on the CPU, with a small state):

    .venv/bin/python benchmarks/gpu_loop.py --device cpu --params 5e6 --steps 24 --every 4

The loop: a stack of transformer-shaped blocks (``_harness.Block``) sized by ``--params``, fp32, AdamW, a
batch of ``--batch`` rows; each step is zero_grad, forward, backward, ``optimizer.step()`` and reading the
loss (as a logging loop does, so a step ends when the device is done). A checkpoint follows the optimizer
step every ``--every`` steps. What each figure means:

* **overhead per checkpoint** = (loop time with checkpoints - loop time without) / checkpoints. The time
  without is the mean of a baseline run before every mode and one after them all; their difference is the
  noise floor of every overhead. A mode's loop time includes waiting, at its end, for its last checkpoint's
  copy to leave the state (ckptd's background copy, DCP's asynchronous staging), not for the disk.
* **D2H floor**: the whole state copied into one preallocated, page-locked host buffer on a side stream,
  then synchronized (on CPU: a plain preallocated buffer). It is the least a checkpoint that must copy the
  state out can cost; shown in ms and GB/s, and as a loop mode (the copy after the optimizer step,
  blocking). **x floor** is each overhead divided by the floor's time.
* **ckptd default**: ``snapshot()`` returns once the copy is enqueued; the copy runs behind the next
  forward and backward, and the optimizer step pre-hook waits for it. Warm pool: ``prepare()`` and a
  warm-up at the loop's cadence first, so every staging slot is made, mapped and page-locked.
* **ckptd blocking**: ``snapshot(blocking=True)``: returns when every byte is in the daemon's memory.
* **ckptd memory tier**: a snapshot every step (``Client(persist_every=K)``, ``--persist-every``), one in K
  due for disk, and a daemon with ``--lagging memory`` (a step due while the disk is busy stays in memory);
  its overhead is per step.
* **persisting lags**: the default mode against a daemon whose disk writes are throttled
  (``--write-rate-limit``, one persist worker) so that one persist takes ``--lag-factor`` checkpoint
  intervals, and never faster than half the disk's own sequential write rate, measured before these modes
  (one write + fsync of ``--disk-probe-gb`` in the work directory): a cap above the disk's speed would not
  throttle at all. Shared memory for three slots, and a loop of more checkpoints than that (``--lag-ckpts``,
  default the larger of the other loops' count and five), so the pool runs out; each row's notes give the
  slot count, the checkpoints, and the persist time per checkpoint the daemon measured (its seconds writing /
  steps persisted). Their overhead is against the baseline scaled to the loop's steps. ``--lagging wait``:
  every snapshot is queued for disk, and once the slots are all taken the next snapshot waits
  (backpressure); it gets only ``prepare()``'s two slots, so its third is made during the loop (a cold
  pool). ``--lagging memory``: a snapshot due for disk while the disk is busy stays in memory, the newest is
  persisted when the disk is free; it gets ``prepare()``'s three slots and a warm-up.
* **dcp.async_save**: thread mode with its default stager; thread mode with a ``DefaultStager`` on pinned
  memory with asynchronous staging (the optimizer step waits for staging, as torch asks); process mode with
  the default stager, and with a ``DefaultStager`` on pinned shared memory. Each ``DefaultStager`` mode runs
  twice: one stager reused across saves (its cached buffers are the point of it), and a fresh stager per save
  (``-fresh``), closed once its save is on disk; a torch that closes a stager after a save fails the reused
  rows, whose failure then says "stager reused across saves". One save in flight, as users run it: a
  checkpoint first waits for the previous save. The process and pinned modes get a warm-up save first (it
  spawns the checkpoint process, allocates the stager's cached buffers). A mode the installed torch lacks or
  that raises is reported as failed with the exception's type and message.
* **restore** of the newest step into a fresh model + AdamW on the device, from the daemon's memory
  (``restore()``, hot), from disk (``hot=False``) with the step's files evicted from the page cache, and
  from disk with them in the page cache; against the H2D floors: the whole state copied from one pinned and
  from one pageable host buffer into the device tensors (on CPU both are plain copies), and the disk's floor:
  the step's shard files, evicted, read whole in 16 MiB reads. GB/s, and the ratio
  of each time to the pinned floor's.

Prints markdown tables; writes ``--json`` (rewritten after every mode, so a run cut short keeps what it
measured) and ``--plot`` (a PNG, if matplotlib is installed). Exit status 0 whenever it ran to the end, also
with failed modes (this is a report); 2 when /dev/shm cannot hold the ckptd modes' slots.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dcp_saves import DcpSaves  # noqa: E402
from _harness import (  # noqa: E402
    Block,
    DaemonProcess,
    disk_write_rate,
    evict,
    fds_to,
    machine_info,
    shape_for,
    state_tensors,
    stop_dcp_checkpoint_process,
    views_into,
    write_json,
)  # fmt: skip
from hot_restore import read_files  # noqa: E402

import ckptd  # noqa: E402
from ckptd.client import pinned as pinned_blocks  # noqa: E402
from ckptd.client.hotreg import SHMEM_ENABLED, huge_backed, mount_of, path_for  # noqa: E402

LOOP_MODES = (
    "floor", "default", "blocking", "memtier", "lag-wait", "lag-memory",
    "dcp-thread", "dcp-thread-pinned", "dcp-thread-pinned-fresh", "dcp-process", "dcp-process-pinned", "dcp-process-pinned-fresh",
)  # fmt: skip
ALL_MODES = (*LOOP_MODES, "restore")
CKPTD_SECTIONS = {"main": ("default", "blocking", "restore"), "memtier": ("memtier",), "lag": ("lag-wait", "lag-memory")}
SLOT_ROOM = 3.5  # shared memory the ckptd daemons need, in states: three slots (a memory tier's steady pool) and a margin
SHM_ALIGN = 2 << 20  # the daemon rounds segment sizes up to this (ckptd.shm.ALIGN)
LAG_SLOTS = 3  # the lagging modes' shared-memory budget holds this many slots
LAG_DISK_SHARE = 0.5  # the lagging modes' write cap: at most this share of the disk's measured sequential write rate
REUSED = "stager reused across saves"  # what a failure of the reused-DefaultStager rows is put down to
# the daemons keep their default 3 steps on disk: with fewer, a persist thread whose step the retention of newer steps
# (completed by the other persist thread meanwhile) removed before it read back its own manifest reports the step
# failed (ckptd 0.1.0), and wait() raises for a step that was durable; seen here with --keep 1 and --keep 2
KEEP: list[str] = []


def log(msg: str) -> None:
    print(f"[gpu_loop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def describe(e: BaseException) -> str:
    """``Type: first line of the message``, bounded: what a failed mode reports."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# ---------------------------------------------------------------------------- the trainer


class Trainer:
    """The benchmark model on ``device`` with an AdamW whose state exists (one small step), and a fixed batch."""

    def __init__(self, params: float, device: torch.device, batch: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.device = device
        self.layers, self.d = shape_for(params)
        with torch.device(device):
            self.model = nn.Sequential(*[Block(self.d) for _ in range(self.layers)])
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, self.d, device=device) if batch > 0 else None
        self.model(torch.randn(4, self.d, device=device)).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.sync()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        assert self.x is not None
        self.optim.zero_grad(set_to_none=True)
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.optim.step()
        return loss.item()  # a logging loop reads the loss every step: the step ends when the device is done

    def tensors(self) -> list[torch.Tensor]:
        return state_tensors(self.model, self.optim)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def run_loop(
    tr: Trainer, steps: int, every: int, ckpt: Callable[[int], None] | None = None, finish: Callable[[], None] | None = None
) -> float:
    """Seconds for ``steps`` steps, ``ckpt(i)`` after every ``every``-th optimizer step, then ``finish()``."""
    tr.sync()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        tr.step()
        if ckpt is not None and i % every == 0:
            ckpt(i)
    if finish is not None:
        finish()
    tr.sync()
    return time.perf_counter() - t0


class HostBuffer:
    """One preallocated host buffer for the whole state: page-locked on CUDA when ``pinned``, every page touched."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.pinned = pinned
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.tensor.fill_(0)


def copy_out(dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Any) -> None:
    """The D2H floor's copy: on ``stream`` (after the work queued so far), synchronized; without one, a fused CPU copy."""
    with torch.no_grad():
        if stream is None:
            torch._foreach_copy_(dsts, srcs)
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
        stream.synchronize()


def copy_in(dsts: list[torch.Tensor], srcs: list[torch.Tensor], cuda: bool) -> None:
    """The H2D floors' copy: host views into the device tensors, synchronized."""
    with torch.no_grad():
        if not cuda:
            torch._foreach_copy_(dsts, srcs)
            return
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()


def pool(client: ckptd.Client) -> dict[str, Any]:
    """The daemon's slot pool and counters, for the notes."""
    st = client.status()
    slots = st.get("slots") or {}
    return {
        "slots": sum(slots.values()),
        "by_state": dict(slots),
        "shm_bytes": st.get("shm_bytes", 0),
        "deferred": st.get("deferred_allocs", 0),
        "memory_steps": st.get("memory_steps", 0),
        "dropped": st.get("memory_steps_dropped", 0),
        "durable": st.get("steps_committed", 0),
        "persist_seconds": st.get("persist_seconds", 0.0),
        "persisted_bytes": st.get("persisted_bytes", 0),
        "errors": st.get("errors", 0),
        "last_error": st.get("last_error"),
    }


def drain(client: ckptd.Client, timeout: float) -> float:
    """Wait until no slot is leased or committed (being persisted or sealed) and no allocation waits; seconds waited."""
    t0 = time.perf_counter()
    while True:
        st = client.status()
        slots = st.get("slots") or {}
        if not slots.get("leased") and not slots.get("committed") and not st.get("deferred_allocs"):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"the daemon still persists after {timeout:.0f} s: {slots}")
        time.sleep(0.02)


def wait_all(client: ckptd.Client) -> tuple[list[str], list[str]]:
    """``client.wait()`` to the end: the durable steps' directories, and each failure (raised once each) as text."""
    paths: list[str] = []
    errors: list[str] = []
    for _ in range(100):
        try:
            paths += client.wait()
            break
        except ckptd.CheckpointError as e:
            errors.append(describe(e))
    return paths, errors


def pinned_mappings(client: ckptd.Client) -> int | None:
    """How many of the client's slot mappings are page-locked (no public API says: read for the notes only)."""
    maps = getattr(client, "_maps", None)
    pinned = getattr(maps, "pinned", None)
    return len(pinned) if isinstance(pinned, set) else None


def mapped(client: ckptd.Client) -> dict[str, int | None]:
    """Slots the client mapped (and page-locked) first on a snapshot's path, and spares it mapped ahead on a thread
    of its own (read for the notes only, like :func:`pinned_mappings`)."""
    on_path = getattr(getattr(client, "_maps", None), "made_on_path", None)
    ahead = getattr(getattr(client, "_spare", None), "warmed", None)
    return {"on_path": on_path if isinstance(on_path, int) else None, "ahead": ahead if isinstance(ahead, int) else None}


# ---------------------------------------------------------------------------- results


@dataclass
class Row:
    key: str
    name: str
    short: str = ""  # the plot's label
    checkpoints: int = 0
    steps: int | None = None  # steps of its loop, when not --steps (the lagging modes run more)
    loop_s: float | None = None
    overhead_ms: float | None = None
    x_floor: float | None = None
    call_ms: list[float] = field(default_factory=list)  # until the checkpoint call returned, each checkpoint
    copied_ms: list[float] = field(default_factory=list)  # ckptd: from the call until the copy was committed
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RestoreRow:
    key: str
    name: str
    short: str = ""
    samples_s: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.samples_s) if self.samples_s else None


def mode_names(args: argparse.Namespace, cuda: bool) -> dict[str, str]:
    k = args.persist_every
    pin = "pinned" if cuda else "not pinned on cpu"
    return {
        "floor": "D2H floor: whole state into one pinned buffer, side stream, synchronized"
        if cuda
        else "copy floor: whole state into one preallocated buffer (cpu)",
        "default": "ckptd snapshot() default (copy guarded until optimizer.step), warm pool",
        "blocking": "ckptd snapshot(blocking=True), warm pool",
        "memtier": f"ckptd default, memory tier: a snapshot every step, 1 in {k} persisted, --lagging memory (per step)",
        "lag-wait": "ckptd default, disk throttled below its speed, --lagging wait (backpressure), pool from prepare() only (cold)",
        "lag-memory": "ckptd default, disk throttled below its speed, --lagging memory, warm pool",
        "dcp-thread": "dcp.async_save, thread mode (default stager)",
        "dcp-thread-pinned": f"dcp.async_save, thread mode, one DefaultStager ({pin}, async staging) reused across saves",
        "dcp-thread-pinned-fresh": f"dcp.async_save, thread mode, DefaultStager ({pin}, async staging), fresh per save",
        "dcp-process": "dcp.async_save, process mode (default stager)",
        "dcp-process-pinned": f"dcp.async_save, process mode, one DefaultStager ({pin}, shared memory, async staging) reused across saves",
        "dcp-process-pinned-fresh": f"dcp.async_save, process mode, DefaultStager ({pin}, shared memory, async staging), fresh per save",
    }


SHORT = {
    "floor": "floor: one copy, synchronized",
    "default": "ckptd default",
    "blocking": "ckptd blocking",
    "memtier": "ckptd memory tier (per step)",
    "lag-wait": "ckptd, slow disk, lagging=wait (cold pool)",
    "lag-memory": "ckptd, slow disk, lagging=memory",
    "dcp-thread": "dcp.async_save thread",
    "dcp-thread-pinned": "dcp.async_save thread, pinned stager reused",
    "dcp-thread-pinned-fresh": "dcp.async_save thread, pinned stager per save",
    "dcp-process": "dcp.async_save process",
    "dcp-process-pinned": "dcp.async_save process, pinned shm stager reused",
    "dcp-process-pinned-fresh": "dcp.async_save process, pinned shm stager per save",
    "h2d_pinned": "floor: pinned buffer -> device",
    "h2d_pageable": "floor: pageable buffer -> device",
    "memory": "ckptd.restore, hot (daemon memory)",
    "disk_cold": "ckptd.restore, disk (cache evicted)",
    "disk_warm": "ckptd.restore, disk (page cache)",
    "disk_read": "disk floor: files read (evicted)",
}


def shm_pages(path: str = "/dev/shm") -> str:
    """What pages the daemon's segments get, as the hot restore judges it (:func:`ckptd.client.hotreg.huge_backed`),
    with the ``huge=`` option of the tmpfs at ``path`` and the kernel's ``shmem_enabled``."""
    opts = (mount_of(os.path.realpath(path)) or ("", ""))[1]
    huge = next((o.split("=", 1)[1] for o in opts.split(",") if o.startswith("huge=")), "never")
    shmem = "?"
    with contextlib.suppress(OSError, IndexError):
        shmem = open(SHMEM_ENABLED).read().split("[")[1].split("]")[0]
    pages = "huge pages" if huge_backed(os.path.join(path, "segment")) else "4 KiB pages"
    return f"{pages} ({path} huge={huge}, shmem_enabled {shmem})"


def forced_wait(checkpoints: int, slots: int, interval: float, persist: float) -> float:
    """Seconds in all that a loop of ``checkpoints`` checkpoints ``interval`` seconds apart must wait under backpressure
    when ``slots`` staging slots hold the checkpoints not yet persisted and one worker persists each in ``persist``
    seconds, in order: a checkpoint waits until the slot of the one ``slots`` before it is persisted. The least any
    saver that keeps every checkpoint can cost on that disk; copies are taken as free."""
    waited, ends = 0.0, []
    for k in range(checkpoints):
        call = k * interval + waited
        if k >= slots and ends[k - slots] > call:
            waited += ends[k - slots] - call
            call = ends[k - slots]
        ends.append(max(call, ends[-1] if ends else 0.0) + persist)
    return waited


def staging_note(counts: Counter[str]) -> str:
    """Which page-locked staging a restore made (:mod:`ckptd.client.pinned`), over all its reps."""
    if not counts:
        return "no page-locked staging made"
    how = {"huge": "anonymous huge pages registered", "pinned": "pin_memory (cudaHostAlloc)"}
    return "staging: " + ", ".join(f"{n} block(s) of {how.get(k, k)}" for k, n in sorted(counts.items()))


def fmt_ms(v: float | None, digits: int = 1) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def median_or_none(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------------- the benchmark


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"
        self.modes = [m for m in args.modes if m in LOOP_MODES]
        names = mode_names(args, self.cuda)
        self.rows: dict[str, Row] = {k: Row(k, names[k], SHORT[k]) for k in self.modes}
        self.restores: dict[str, RestoreRow] = {}
        self.baselines: list[float] = []
        self.floor_samples: list[float] = []
        self.t_start = time.perf_counter()
        self.mach = machine_info()
        self.mach["device"] = torch.cuda.get_device_name(device) if self.cuda else "cpu"
        self.mach["cuda"] = torch.version.cuda
        self.mach["ckptd"] = ckptd.__version__
        self.mach["loadavg_start"] = os.getloadavg()
        self.work = tempfile.mkdtemp(prefix="ckptd-gpu-loop-", dir=args.workdir)
        self.sockdir = tempfile.mkdtemp(prefix="ckgl")  # short: an ipc socket path must fit in 107 bytes
        self.daemons: list[DaemonProcess] = []
        self.host: HostBuffer | None = None
        self.stream: Any = None
        self.slot_bytes: int | None = None  # one staging slot, as the daemon made it (from the main daemon's pool)
        self.last_step_dir: str | None = None
        self.lag: dict[str, Any] = {}
        self.disk: dict[str, Any] = {}  # the work directory's disk: its measured sequential write rate
        self.restore_profile: str | None = None
        self.complete = False
        log(f"building the model on {device}")
        self.tr = Trainer(args.params, device, args.batch, seed=0)
        self.nbytes = self.tr.nbytes()
        self.ntensors = len(self.tr.tensors())
        self.checkpoints = args.steps // args.every

    # ------------------------------------------------------------------ plumbing

    def save(self) -> None:
        write_json(self.args.json, self.payload())

    def daemon(self, name: str, extra: list[str]) -> DaemonProcess:
        d = os.path.join(self.work, name)
        os.makedirs(d, exist_ok=True)
        dp = DaemonProcess(os.path.join(d, "root"), f"ipc://{self.sockdir}/{name}.sock", os.path.join(d, "daemon.log"), extra)
        self.daemons.append(dp)
        try:
            dp.wait_ready()
        except BaseException:
            self.stop(dp)
            raise
        log(f"daemon {name} up: {' '.join(extra)}")
        return dp

    def stop(self, dp: DaemonProcess, timeout: float = 120.0) -> None:
        rc = dp.stop(timeout)
        if dp in self.daemons:
            self.daemons.remove(dp)
        if rc != 0:
            log(f"warning: ckptd serve exited with {rc}; its log:\n{dp.log_tail()}")
        shutil.rmtree(os.path.dirname(dp.root), ignore_errors=True)  # its checkpoints: the disk is small on the GPU box

    @contextlib.contextmanager
    def section(self, keys: tuple[str, ...] | list[str]) -> Iterator[None]:
        """A failure outside a mode's own guard (a daemon that would not start) fails the modes not yet measured."""
        try:
            yield
        except Exception as e:
            log(f"{', '.join(keys)}: {describe(e)}")
            for k in keys:
                r = self.rows.get(k)
                if r is not None and r.loop_s is None and r.error is None:
                    r.error = describe(e)
                if k == "restore":
                    for row in self.restores.values():
                        if row.error is None and len(row.samples_s) < self.args.restore_reps:
                            row.error = describe(e)
                    if not self.restores:
                        self.restores["restore"] = RestoreRow("restore", "ckptd.restore", error=describe(e))
        finally:
            self.save()

    def cleanup(self) -> None:
        for dp in list(self.daemons):
            with contextlib.suppress(Exception):
                self.stop(dp)
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.sockdir, ignore_errors=True)

    def skip(self, keys: list[str] | tuple[str, ...]) -> bool:
        """True (and the modes marked skipped) once the run has spent ``--max-minutes``: the rest is left out so that the
        closing baseline and the report still come within the limit."""
        budget = self.args.max_minutes
        if budget is None or time.perf_counter() - self.t_start < budget * 60:
            return False
        why = f"skipped: the --max-minutes {budget:g} budget was spent"
        for k in keys:
            r = self.rows.get(k)
            if r is not None and r.loop_s is None and r.error is None:
                r.error = why
            if k == "restore" and not self.restores:
                self.restores["restore"] = RestoreRow("restore", "ckptd.restore", error=why)
        log(f"{', '.join(keys)}: {why}")
        return True

    # ------------------------------------------------------------------ baselines and the floor

    def baseline(self) -> None:
        t = run_loop(self.tr, self.args.steps, self.args.every)
        self.baselines.append(t)
        log(f"baseline {len(self.baselines)}: {t:.3f} s ({t / self.args.steps * 1e3:.1f} ms a step)")

    def floor(self) -> None:
        tensors = self.tr.tensors()
        self.host = HostBuffer(self.nbytes, pinned=self.cuda)
        dsts = views_into(self.host.tensor, tensors)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        copy_out(dsts, tensors, self.stream)  # warm-up
        for _ in range(self.args.floor_reps):
            self.tr.sync()
            t0 = time.perf_counter()
            copy_out(dsts, tensors, self.stream)
            self.floor_samples.append(time.perf_counter() - t0)
        f = statistics.median(self.floor_samples)
        log(f"floor: {f * 1e3:.2f} ms, {self.nbytes / f / 1e9:.2f} GB/s")
        r = self.rows.get("floor")
        if r is None:
            return

        def ckpt(i: int) -> None:
            t0 = time.perf_counter()
            copy_out(dsts, tensors, self.stream)
            r.call_ms.append((time.perf_counter() - t0) * 1e3)

        with self.section(["floor"]):
            r.loop_s = run_loop(self.tr, self.args.steps, self.args.every, ckpt)
            r.checkpoints = self.checkpoints

    # ------------------------------------------------------------------ ckptd

    def ckptd_loop(self, r: Row, client: ckptd.Client, steps: int, every: int, blocking: bool, counter: Iterator[int]) -> None:
        """The loop with ``client.snapshot`` every ``every`` steps; fills ``r``'s loop time and call/copy times."""
        handles: list[ckptd.SnapshotHandle] = []
        threads: list[threading.Thread] = []
        errors: list[BaseException] = []

        def ckpt(i: int) -> None:
            t0 = time.perf_counter()
            h = client.snapshot(self.tr.model, self.tr.optim, step=next(counter), blocking=blocking)
            r.call_ms.append((time.perf_counter() - t0) * 1e3)
            handles.append(h)

            def mark() -> None:
                try:
                    h.wait_copied()
                    r.copied_ms.append((time.perf_counter() - t0) * 1e3)
                except BaseException as e:
                    errors.append(e)

            th = threading.Thread(target=mark, daemon=True)
            th.start()
            threads.append(th)

        def finish() -> None:
            if handles:
                handles[-1].wait_copied()  # the last copy is the loop's too

        r.loop_s = run_loop(self.tr, steps, every, ckpt, finish)
        r.checkpoints, r.steps = steps // every, steps
        for th in threads:
            th.join()
        if errors:
            raise errors[0]

    def warm_up(self, client: ckptd.Client, counter: Iterator[int], every: int, ckpts: int) -> None:
        """At the loop's cadence, then two blocking snapshots back to back (the second while the first persists): the
        pool grows to what the loop uses, and each slot is mapped and, on CUDA, page-locked, before anything is timed."""
        scratch = Row("warm-up", "warm-up")
        self.ckptd_loop(scratch, client, every * ckpts, every, False, counter)
        for _ in range(2):
            client.snapshot(self.tr.model, self.tr.optim, step=next(counter), blocking=True)

    def main_daemon(self) -> None:
        keys = [k for k in CKPTD_SECTIONS["main"] if k in self.args.modes]
        if not keys or self.skip(keys):
            return
        with self.section(keys):
            dp = self.daemon("main", KEEP)
            try:
                with ckptd.Client(endpoint=dp.endpoint, job="gpu-loop") as c:
                    counter = itertools.count(1)
                    t0 = time.perf_counter()
                    c.prepare(self.tr.model, self.tr.optim)
                    prepare_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    self.warm_up(c, counter, self.args.every, self.args.warmup_ckpts)
                    paths, errors = wait_all(c)
                    self.last_step_dir = paths[-1] if paths else self.last_step_dir
                    for err in errors:
                        log(f"warm-up: {err}")
                    p = pool(c)
                    self.slot_bytes = p["shm_bytes"] // max(1, p["slots"])
                    log(f"main daemon: prepare() {prepare_s:.2f} s, warm-up {time.perf_counter() - t0:.2f} s; {p['slots']} slot(s)")
                    for key, blocking in (("default", False), ("blocking", True)):
                        r = self.rows.get(key)
                        if r is None or self.skip([key]):
                            continue
                        r.info["prepare_s"] = prepare_s
                        try:
                            before, pins = pool(c), pinned_mappings(c)
                            self.ckptd_loop(r, c, self.args.steps, self.args.every, blocking, counter)
                            t0 = time.perf_counter()
                            paths, errors = wait_all(c)
                            self.last_step_dir = paths[-1] if paths else self.last_step_dir
                            if errors:
                                r.notes.append(f"FAILED: {len(errors)} step(s) not durable: {errors[0]}")
                            after = pool(c)
                            r.info.update(pool_before=before, pool_after=after, durable_after_loop_s=time.perf_counter() - t0)
                            r.info.update(pinned_before=pins, pinned_after=pinned_mappings(c))
                            self.pool_notes(r, before, after)
                            r.notes.append(f"persists done {r.info['durable_after_loop_s']:.2f} s after the loop")
                        except Exception as e:
                            r.error = describe(e)
                            log(f"{key}: {r.error}")
                            wait_all(c)
                        self.save()
                if "restore" in self.args.modes and not self.skip(["restore"]):
                    self.restore(dp.endpoint, "gpu-loop")
                    if self.args.profile_restore:
                        self.profile_restore(dp.endpoint, "gpu-loop")
            finally:
                self.stop(dp)

    def pool_notes(self, r: Row, before: dict[str, Any], after: dict[str, Any]) -> None:
        grew = after["slots"] - before["slots"]
        r.notes.append(f"{after['slots']} slot(s)" + (f", {grew} made during the loop" if grew > 0 else ""))
        if after["errors"] > before["errors"]:
            r.notes.append(f"daemon error: {after['last_error']}")
        pb, pa = r.info.get("pinned_before"), r.info.get("pinned_after")
        if self.cuda and pb is not None and pa is not None and pa > pb:
            r.notes.append(f"{pa - pb} slot(s) page-locked during the loop")
        mb, ma = r.info.get("mapped_before"), r.info.get("mapped_after")
        if mb and ma and None not in (*mb.values(), *ma.values()):
            path, ahead = ma["on_path"] - mb["on_path"], ma["ahead"] - mb["ahead"]
            r.notes.append(f"{path} slot(s) mapped on a snapshot's path, {ahead} spare(s) mapped ahead")

    def memtier(self) -> None:
        r = self.rows.get("memtier")
        if r is None or self.skip(["memtier"]):
            return
        with self.section(["memtier"]):
            dp = self.daemon("memtier", [*KEEP, "--lagging", "memory"])  # a snapshot every step outruns any disk
            try:
                k = self.args.persist_every
                with ckptd.Client(endpoint=dp.endpoint, job="gpu-loop-mem", persist_every=k) as c:
                    counter = itertools.count(1)
                    c.prepare(self.tr.model, self.tr.optim)  # three slots: one persisting, the newest held, the next filled
                    self.warm_up(c, counter, 1, 2 * k + 3)
                    drain(c, self.args.drain_timeout)
                    try:
                        before, pins = pool(c), pinned_mappings(c)
                        self.ckptd_loop(r, c, self.args.steps, 1, False, counter)
                        r.info["drain_s"] = drain(c, self.args.drain_timeout)
                        after = pool(c)
                        r.info.update(pool_before=before, pool_after=after, pinned_before=pins, pinned_after=pinned_mappings(c))
                        self.pool_notes(r, before, after)
                        kept, dropped = after["memory_steps"] - before["memory_steps"], after["dropped"] - before["dropped"]
                        r.notes.append(f"{after['durable'] - before['durable']} persisted, {kept} memory only ({dropped} dropped)")
                    except Exception as e:
                        r.error = describe(e)
                        log(f"memtier: {r.error}")
            finally:
                self.stop(dp)

    def probe_disk(self) -> None:
        """The work directory's disk: one sequential write + fsync of ``--disk-probe-gb`` (the lagging modes' write cap
        is set below it)."""
        nbytes = int(self.args.disk_probe_gb * 1e9)
        rate, took = disk_write_rate(self.work, nbytes)
        self.disk = {"probe_bytes": nbytes, "seconds": took, "bytes_per_s": rate}
        log(f"disk: {nbytes / 1e9:.2f} GB written + fsynced in {took:.2f} s = {rate / 1e6:.0f} MB/s")

    def lag_settings(self) -> dict[str, Any]:
        """The lagging modes' daemon: a write cap below the disk's measured rate (``--lag-factor`` checkpoint intervals a
        persist, at most ``LAG_DISK_SHARE`` of the disk's rate), shared memory for ``LAG_SLOTS`` slots, and a loop of
        more checkpoints than that, so the pool runs out."""
        slot = self.slot_bytes or -(-(self.nbytes + (4 << 20)) // SHM_ALIGN) * SHM_ALIGN
        quiet_step = statistics.mean(self.baselines) / self.args.steps
        interval = self.args.every * quiet_step
        want = self.args.lag_rate or slot / (self.args.lag_factor * interval)
        cap = LAG_DISK_SHARE * self.disk["bytes_per_s"] if self.disk else None
        rate = int(max(min(want, cap) if cap else want, 1 << 20))
        ckpts = self.args.lag_ckpts or max(self.checkpoints, LAG_SLOTS + 2)
        self.lag = {
            "rate_bytes_per_s": rate, "capped_by_disk": bool(cap and want > cap), "disk_bytes_per_s": self.disk.get("bytes_per_s"),
            "shm_budget": int(LAG_SLOTS * slot + slot // 2), "slots": LAG_SLOTS, "checkpoints": ckpts, "slot_bytes": slot,
            "interval_s": interval, "persist_s": slot / rate,
        }  # fmt: skip
        return self.lag

    def lagging(self) -> None:
        for key in [k for k in CKPTD_SECTIONS["lag"] if k in self.rows]:
            if self.skip([key]):
                continue
            with self.section([key]):
                lag = self.lag_settings()
                args = [*KEEP, "--workers", "1", "--write-rate-limit", str(lag["rate_bytes_per_s"]), "--shm-budget", str(lag["shm_budget"])]
                dp = self.daemon(key, [*args, "--lagging", key.removeprefix("lag-")])
                try:
                    self.lag_mode(self.rows[key], dp, lag)
                finally:
                    self.stop(dp, timeout=120.0 + 4 * lag["persist_s"])

    def lag_mode(self, r: Row, dp: DaemonProcess, lag: dict[str, Any]) -> None:
        """One lagging mode's loop of ``lag["checkpoints"]`` checkpoints, then its backlog drained; the notes say the pool,
        the cap, and the persist time each checkpoint took (the daemon's seconds writing / steps persisted)."""
        with ckptd.Client(endpoint=dp.endpoint, job=f"gpu-loop-{r.key}") as c:
            counter = itertools.count(1)
            c.prepare(self.tr.model, self.tr.optim)  # wait: two slots; memory: three (the job has a memory tier)
            if r.key == "lag-memory":
                self.warm_up(c, counter, self.args.every, self.args.warmup_ckpts)
                drain(c, self.args.drain_timeout + 10 * lag["persist_s"])
            try:
                before, pins, maps = pool(c), pinned_mappings(c), mapped(c)
                self.ckptd_loop(r, c, self.args.every * lag["checkpoints"], self.args.every, False, counter)
                r.info["drain_s"] = drain(c, self.args.drain_timeout + 10 * lag["persist_s"])
                after = pool(c)
                r.info.update(pool_before=before, pool_after=after, pinned_before=pins, pinned_after=pinned_mappings(c))
                r.info.update(lag, mapped_before=maps, mapped_after=mapped(c))
                persisted = after["durable"] - before["durable"]
                took = (after["persist_seconds"] - before["persist_seconds"]) / persisted if persisted else None
                r.info["persist_s_measured"] = took
                r.notes.insert(0, f"{lag['slots']} slots in the shared-memory budget, {lag['checkpoints']} checkpoints")
                r.notes.append(
                    f"disk capped at {lag['rate_bytes_per_s'] / 1e6:.0f} MB/s (measured {(lag['disk_bytes_per_s'] or 0) / 1e6:.0f} MB/s):"
                    f" a persist took {fmt_ms(took, 2)} s measured, {lag['persist_s'] / lag['interval_s']:.1f} checkpoint intervals planned"
                )
                self.pool_notes(r, before, after)
                r.notes.append(f"{persisted} persisted")
                if after["memory_steps"] > before["memory_steps"]:
                    r.notes.append(
                        f"{after['memory_steps'] - before['memory_steps']} kept in memory ({after['dropped'] - before['dropped']} dropped)"
                    )
                r.notes.append(f"backlog drained {r.info['drain_s']:.1f} s after the loop")
            except Exception as e:
                r.error = describe(e)
                log(f"{r.key}: {r.error}")

    # ------------------------------------------------------------------ restore

    def restore(self, endpoint: str, job: str) -> None:
        """Hot and disk restores of the newest step into a fresh model + AdamW on the device, against the H2D floors."""
        cuda = self.cuda
        floors = (
            ("H2D floor: one pinned host buffer -> device tensors", "H2D floor: one pageable host buffer -> device tensors")
            if cuda
            else ("copy floor: one preallocated buffer -> state (cpu)", "copy floor: a second plain buffer -> state (cpu)")
        )
        names = {
            "h2d_pinned": floors[0],
            "h2d_pageable": floors[1],
            "memory": "ckptd.restore from the daemon's memory (hot)",
            "disk_cold": "ckptd.restore(hot=False): from disk, files evicted from the page cache",
            "disk_warm": "ckptd.restore(hot=False): from disk, files in the page cache",
            "disk_read": "disk floor: the step's shard files, evicted from the page cache, read in 16 MiB reads (no hash, no copy)",
        }
        self.restores = {k: RestoreRow(k, n, SHORT[k]) for k, n in names.items()}
        log("restore: building a fresh model on the device")
        target = Trainer(self.args.params, self.device, 0, seed=1)
        pinned = self.host if self.host is not None and self.host.tensor.numel() == self.nbytes else HostBuffer(self.nbytes, pinned=cuda)
        pageable = HostBuffer(self.nbytes, pinned=False)
        expect = {"memory": "memory", "disk_cold": "disk", "disk_warm": "disk"}
        made: dict[str, Counter[str]] = {k: Counter() for k in ("memory", "disk_cold", "disk_warm")}  # page-locked blocks made
        try:
            with ckptd.Client(endpoint=endpoint, job=job) as rc:
                for _ in range(self.args.restore_reps):
                    for key, row in self.restores.items():
                        if row.error is not None:
                            continue
                        try:
                            if key.startswith("h2d"):
                                tensors = target.tensors()  # a restore may have given the optimizer new state tensors
                                srcs = views_into((pinned if key == "h2d_pinned" else pageable).tensor, tensors)
                                target.sync()
                                t0 = time.perf_counter()
                                copy_in(tensors, srcs, cuda)
                                row.samples_s.append(time.perf_counter() - t0)
                                continue
                            if key == "disk_read":
                                if self.last_step_dir is None or not os.path.isdir(self.last_step_dir):
                                    raise RuntimeError(f"no step directory to read ({self.last_step_dir})")
                                evict(self.last_step_dir)
                                t0 = time.perf_counter()
                                read_files(self.last_step_dir)
                                row.samples_s.append(time.perf_counter() - t0)
                                continue
                            if key == "disk_cold":
                                if self.last_step_dir is None or not os.path.isdir(self.last_step_dir):
                                    raise RuntimeError(f"no step directory to evict ({self.last_step_dir})")
                                evict(self.last_step_dir)
                            target.sync()
                            before = Counter(pinned_blocks.MADE)
                            t0 = time.perf_counter()
                            rc.restore(target.model, target.optim, hot=key == "memory")
                            target.sync()
                            row.samples_s.append(time.perf_counter() - t0)
                            made[key] += Counter(pinned_blocks.MADE) - before
                            src = (rc.last_restore or {}).get("source", "?")
                            row.sources.append(src)
                            if src != expect[key] and f"read from {src}" not in row.notes:
                                row.notes.append(f"read from {src}")
                        except Exception as e:
                            row.error = describe(e)
                            log(f"restore {key}: {row.error}")
        finally:
            del target, pageable, pinned
            self.host = None
            if cuda:
                torch.cuda.empty_cache()
        for key, counts in made.items():  # which page-locked staging ran (ckptd.client.pinned): huge pages or pin_memory
            if cuda and key in self.restores:
                self.restores[key].notes.append(staging_note(counts))
        if cuda and "memory" in self.restores:
            shm_dir = os.environ.get("CKPTD_SHM_DIR", "/dev/shm")
            path = path_for(os.path.join(shm_dir, "segment"))
            how = "registered in ranges, copied straight" if path == "register" else "read into page-locked slots"
            self.restores["memory"].notes.append(f"segments on {shm_pages(shm_dir)}: {path} path ({how})")
        for row in self.restores.values():
            if row.median_s is not None:
                log(f"restore {row.key}: {row.median_s * 1e3:.1f} ms")

    def profile_restore(self, endpoint: str, job: str) -> None:
        """``--profile-restore``: one more hot restore, after the measured ones, under cProfile; its top entries by
        cumulative time go into the report (where a restore's time goes: reads, hashing, copies, waits)."""
        import cProfile
        import io
        import pstats

        target = Trainer(self.args.params, self.device, 0, seed=2)
        try:
            with ckptd.Client(endpoint=endpoint, job=job) as rc:
                rc.restore(target.model, target.optim)  # the optimizer's state tensors exist from here, as in the reps
                target.sync()
                prof = cProfile.Profile()
                t0 = time.perf_counter()
                prof.enable()
                rc.restore(target.model, target.optim)
                target.sync()
                prof.disable()
                took = time.perf_counter() - t0
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(35)
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            self.restore_profile = f"one hot restore, {took * 1e3:.1f} ms under cProfile\n" + out.getvalue()
        except Exception as e:
            self.restore_profile = f"failed: {describe(e)}"
        finally:
            del target
            if self.cuda:
                torch.cuda.empty_cache()
        log("restore profile: " + self.restore_profile.splitlines()[0])

    # ------------------------------------------------------------------ torch DCP

    def dcp(self) -> None:
        keys = [k for k in self.rows if k.startswith("dcp-")]
        if not keys:
            return
        import torch.distributed as dist

        for key in (k for k in keys if k.startswith("dcp-thread")):
            if not self.skip([key]):
                with self.section([key]):
                    self.dcp_mode(self.rows[key])
        proc = [k for k in keys if k.startswith("dcp-process")]
        if not proc or self.skip(proc):
            return
        own_pg = False
        with self.section(proc):
            try:
                if not dist.is_initialized():  # process mode's checkpoint process joins a process group
                    dist.init_process_group("gloo", init_method=f"file://{os.path.join(self.work, 'pg-init')}", rank=0, world_size=1)
                    own_pg = True
                for key in proc:
                    if not self.skip([key]):
                        self.dcp_mode(self.rows[key])
                        self.save()
            finally:
                stop_dcp_checkpoint_process()
                if own_pg:
                    dist.destroy_process_group()

    def dcp_mode(self, r: Row) -> None:
        """One DCP mode's loop (after a warm-up save for process mode and the stager modes); a failure is reported in the
        row, and a reused stager's failure after its first save is put down to the reuse."""
        saves: DcpSaves | None = None
        hook: Any = None
        try:
            saves = DcpSaves(r.key, self.work, self.tr.model, self.tr.optim, self.args.dcp_timeout)
            hook = self.tr.optim.register_step_pre_hook(saves.pre_step)
            if saves.process or saves.pinned:
                # warm-up: one save to disk first (it spawns the checkpoint process, allocates the stager's cached buffers)
                ctx = fds_to(os.path.join(self.work, "dcp-process.log")) if saves.process else contextlib.nullcontext()
                with ctx:
                    saves.save()
                    saves.wait_all()
            waited_ms: list[float] = []

            def ckpt(i: int) -> None:
                w, c = saves.save()
                waited_ms.append(w * 1e3)
                r.call_ms.append(c * 1e3)

            r.loop_s = run_loop(self.tr, self.args.steps, self.args.every, ckpt, saves.staged)
            r.checkpoints = self.checkpoints
            r.info["durable_after_loop_s"] = saves.wait_all()
            r.info["waited_for_previous_ms"] = waited_ms
            if any(w > 0.5 for w in waited_ms):
                r.notes.append(f"waited {sum(waited_ms):.0f} ms in all for the previous save")
            r.notes.append(f"last save on disk {r.info['durable_after_loop_s']:.2f} s after the loop")
        except Exception as e:
            avail = "" if r.loop_s is not None else f" (torch {torch.__version__})"
            reused = saves is not None and saves.stager is not None and saves.done > 0
            r.error = (f"{REUSED}: " if reused else "") + describe(e) + avail
            r.loop_s = None
            log(f"{r.key}: {r.error}")
        finally:
            if hook is not None:
                hook.remove()
            if saves is not None:
                saves.close()

    # ------------------------------------------------------------------ output

    def finalize(self) -> None:
        base = statistics.mean(self.baselines) if self.baselines else None
        floor_ms = statistics.median(self.floor_samples) * 1e3 if self.floor_samples else None
        for r in self.rows.values():
            if r.loop_s is None or base is None or not r.checkpoints:
                r.overhead_ms = r.x_floor = None
                continue
            base_for = base * (r.steps or self.args.steps) / self.args.steps  # a loop of other length: the baseline scaled
            r.overhead_ms = (r.loop_s - base_for) / r.checkpoints * 1e3
            r.x_floor = r.overhead_ms / floor_ms if floor_ms else None
            took, interval = r.info.get("persist_s_measured"), r.info.get("interval_s")
            if r.key == "lag-wait" and took and interval and floor_ms:  # backpressure: what the disk alone forces the loop to wait
                forced = forced_wait(r.checkpoints, r.info["slots"], interval, took)
                beyond = r.overhead_ms - forced / r.checkpoints * 1e3
                r.info.update(forced_wait_s=forced, beyond_disk_ms=beyond, beyond_disk_x_floor=beyond / floor_ms)
            if r.key == "memtier" and floor_ms:  # a snapshot every step: its cost as a share of a quiet step
                quiet_ms = base / self.args.steps * 1e3
                r.info.update(pct_of_step=100 * r.overhead_ms / quiet_ms, floor_pct_of_step=100 * floor_ms / quiet_ms)

    def payload(self) -> dict[str, Any]:
        self.finalize()
        floor = median_or_none(self.floor_samples)
        pinned = self.restores.get("h2d_pinned")
        restores = []
        for row in self.restores.values():
            m = row.median_s
            ref = pinned.median_s if pinned is not None else None
            restores.append({
                **asdict(row), "median_s": m, "gb_per_s": self.nbytes / m / 1e9 if m else None,
                "x_pinned_floor": m / ref if m is not None and ref else None,
            })  # fmt: skip
        return {
            "benchmark": "gpu_loop",
            "complete": self.complete,
            "machine": self.mach,
            "args": vars(self.args),
            "state": {"bytes": self.nbytes, "tensors": self.ntensors, "params": self.tr.params(), "layers": self.tr.layers, "d": self.tr.d},
            "loop": {
                "steps": self.args.steps,
                "every": self.args.every,
                "checkpoints": self.checkpoints,
                "batch": self.args.batch,
                "baselines_s": self.baselines,
                "baseline_mean_s": statistics.mean(self.baselines) if self.baselines else None,
            },
            "floor": {
                "samples_s": self.floor_samples,
                "median_s": floor,
                "gb_per_s": self.nbytes / floor / 1e9 if floor else None,
                "pinned": self.cuda,
            },
            "modes": [asdict(r) for r in self.rows.values()],
            "restore": restores,
            "lag": self.lag,
            "disk": self.disk,
            "restore_profile": self.restore_profile,
            "elapsed_s": time.perf_counter() - self.t_start,
            "unix_time": time.time(),
        }

    def header(self) -> list[str]:
        """The report's opening lines: the state, the loop, the floor, the disk, the lagging modes' settings, the machine."""
        a, m = self.args, self.mach
        base = statistics.mean(self.baselines) if self.baselines else None
        floor = median_or_none(self.floor_samples)
        out = [f"## ckptd GPU training-loop benchmark ({m['device']})", ""]
        out.append(
            f"- state: {self.tr.params() / 1e6:.1f} M fp32 params ({self.tr.layers} x Block(d={self.tr.d})) + AdamW ="
            f" {self.nbytes / 1e9:.3f} GB in {self.ntensors} tensors, on {self.device}; batch {a.batch}"
        )
        if base is not None:
            runs = " and ".join(f"{b:.2f} s" for b in self.baselines)
            out.append(
                f"- loop: {a.steps} steps, a checkpoint every {a.every} ({self.checkpoints} checkpoints); quiet step"
                f" {base / a.steps * 1e3:.1f} ms (baselines {runs}, before and after: the noise floor of the overheads)"
            )
        if floor is not None:
            what = "one pinned buffer on a side stream, synchronized" if self.cuda else "one preallocated buffer (cpu)"
            out.append(
                f"- D2H floor: the whole state into {what}: {floor * 1e3:.2f} ms = {self.nbytes / floor / 1e9:.2f} GB/s"
                f" (median of {len(self.floor_samples)})"
            )
        if self.disk:
            out.append(
                f"- disk: {self.disk['probe_bytes'] / 1e9:.2f} GB written + fsynced in {self.disk['seconds']:.2f} s ="
                f" {self.disk['bytes_per_s'] / 1e6:.0f} MB/s (the work directory's, measured at start)"
            )
        if self.lag:
            lag = self.lag
            capped = f"at most {LAG_DISK_SHARE:g} of the measured rate" + (", which set it" if lag["capped_by_disk"] else "")
            out.append(
                f"- persisting lags: disk writes capped at {lag['rate_bytes_per_s'] / 1e6:.0f} MB/s ({capped}; one persist planned at"
                f" {lag['persist_s']:.2f} s, a checkpoint interval {lag['interval_s']:.2f} s), one persist worker, shared memory"
                f" for {lag['slots']} slots, {lag['checkpoints']} checkpoints a loop (more than the slots: the pool runs out); the"
                " persist time measured is in each row's notes"
            )
        out.append(
            f"- torch {m['torch']}, CUDA {m['cuda']}, ckptd {m['ckptd']}; nproc {m['nproc']}; load average at start"
            f" {'/'.join(f'{x:.2f}' for x in m['loadavg_start'])}; total run {time.perf_counter() - self.t_start:.0f} s"
        )
        out.append(
            "- overhead per checkpoint: against the mean of the baselines (the lagging modes' longer loops: against it scaled"
            " to their steps); x floor: that overhead / the D2H floor's median"
        )
        return out

    def markdown(self) -> str:
        self.finalize()
        base = statistics.mean(self.baselines) if self.baselines else None
        out = self.header()
        out += [
            "",
            "| mode | checkpoints | loop (s) | overhead per checkpoint (ms) | x floor | call returns (ms, median / max) | notes |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        if base is not None:
            out.append(f"| no checkpoints (mean of the baselines) | 0 | {base:.3f} | | | | |")
        for r in self.rows.values():
            if r.error is not None:
                out.append(f"| {r.name} | | | {'skipped' if r.error.startswith('skipped') else 'failed'} | | | {r.error} |")
                continue
            calls = f"{statistics.median(r.call_ms):.1f} / {max(r.call_ms):.1f}" if r.call_ms else ""
            notes = list(r.notes)
            if r.copied_ms and r.key not in ("blocking",):
                notes.insert(0, f"copy committed {statistics.median(r.copied_ms):.1f} ms after the call (median)")
            if r.info.get("forced_wait_s") is not None:
                forced, beyond, x = r.info["forced_wait_s"], r.info["beyond_disk_ms"], r.info["beyond_disk_x_floor"]
                notes.insert(
                    0, f"**the disk forces {forced:.2f} s of waiting in all; beyond it {beyond:.1f} ms a checkpoint = {x:.2f}x the floor**"
                )
            if r.key == "memtier" and r.info.get("pct_of_step") is not None:
                pct, floor_pct = r.info["pct_of_step"], r.info["floor_pct_of_step"]
                notes.insert(0, f"**{pct:.1f} % of a quiet step** (the D2H floor is {floor_pct:.0f} % of it)")
            x = fmt_ms(r.x_floor, 2)
            out.append(
                f"| {r.name} | {r.checkpoints} | {fmt_ms(r.loop_s, 3)} | {fmt_ms(r.overhead_ms)} | {x} | {calls} | {'; '.join(notes)} |"
            )
        if self.restores:
            out += [
                "",
                f"Restore of the newest step ({self.nbytes / 1e9:.3f} GB) into a fresh model + AdamW on {self.device};"
                f" {self.args.restore_reps} reps, median:",
                "",
                "| restore | median (ms) | GB/s | x pinned floor | samples (ms) | notes |",
                "|---|---:|---:|---:|---|---|",
            ]
            for row in self.payload()["restore"]:
                if row["error"] is not None:
                    out.append(f"| {row['name']} | failed | | | | {row['error']} |")
                    continue
                if row["median_s"] is None:
                    continue
                samples = " ".join(f"{s * 1e3:.1f}" for s in row["samples_s"])
                x = fmt_ms(row["x_pinned_floor"], 2)
                out.append(
                    f"| {row['name']} | {row['median_s'] * 1e3:.1f} | {row['gb_per_s']:.2f} | {x} | {samples} | {'; '.join(row['notes'])} |"
                )
        if self.restore_profile is not None:
            out += ["", "### cProfile of one hot restore", "", "```", self.restore_profile.strip(), "```"]
        return "\n".join(out)


# ---------------------------------------------------------------------------- plot


def plot(path: str, data: dict[str, Any]) -> str | None:
    """Bars of the overhead per checkpoint per mode, the floor as a line; restore GB/s beside them. The PNG's path,
    or ``None`` (with a note printed) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\nnote: matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    modes = data["modes"]
    restores = [r for r in data["restore"] if r.get("gb_per_s")]
    ncols = 2 if restores else 1
    height = 0.45 * max(len(modes), len(restores), 3) + 1.6
    fig, axes = plt.subplots(1, ncols, figsize=(7.5 * ncols, height), squeeze=False)
    ax = axes[0][0]
    labels = [r["short"] or r["name"] for r in modes]
    values = [max(0.0, r["overhead_ms"]) if r["overhead_ms"] is not None else 0.0 for r in modes]
    colors = ["#d62728" if r["error"] else "#1f77b4" if r["key"] in ("default", "blocking", "memtier") or r["key"].startswith("lag")
              else "#999999" for r in modes]  # fmt: skip
    ypos = list(range(len(modes)))[::-1]
    ax.barh(ypos, values, color=colors)
    for y, r, v in zip(ypos, modes, values):
        text = f" {r['overhead_ms']:.3g}" if not r["error"] else " skipped" if r["error"].startswith("skipped") else " failed"
        ax.text(v, y, text, va="center", fontsize=8)
    ax.set_yticks(ypos, labels, fontsize=8)
    floor = data["floor"].get("median_s")
    if floor:
        what = "D2H floor" if data["floor"].get("pinned") else "copy floor"
        ax.axvline(floor * 1e3, color="#2ca02c", linestyle="--", label=f"{what}: {floor * 1e3:.3g} ms")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("training time added per checkpoint (ms; memory tier: per step)")
    gb = data["state"]["bytes"] / 1e9
    ax.set_title(f"{data['machine'].get('device')}: {gb:.2f} GB of state, lower is better", fontsize=10)
    if restores:
        ax2 = axes[0][1]
        ypos = list(range(len(restores)))[::-1]
        vals = [r["gb_per_s"] for r in restores]
        ax2.barh(ypos, vals, color=["#999999" if r["key"].startswith("h2d") else "#1f77b4" for r in restores])
        for y, v in zip(ypos, vals):
            ax2.text(v, y, f" {v:.3g}", va="center", fontsize=8)
        ax2.set_yticks(ypos, [r["short"] or r["name"] for r in restores], fontsize=8)
        ax2.set_xlabel("GB/s")
        ax2.set_title("restore into the device, higher is better", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--params", type=float, default=None, help="model parameters, fp32 (default 0.5e9 on cuda, 2e7 on cpu)")
    p.add_argument("--batch", type=int, default=None, help="rows of the batch (default 4096 on cuda, 48 on cpu)")
    p.add_argument("--steps", type=int, default=None, help="steps of each timed loop (default 40 on cuda, 36 on cpu)")
    p.add_argument("--every", type=int, default=None, help="a checkpoint every N steps (default 10 on cuda, 6 on cpu)")
    p.add_argument("--persist-every", type=int, default=10, help="the memory-tier mode persists one snapshot in K (default 10)")
    p.add_argument("--warmup-ckpts", type=int, default=3, help="checkpoints of each ckptd warm-up at the loop's cadence (default 3)")
    p.add_argument("--lag-factor", type=float, default=3.0, help="lagging modes: one persist takes this many checkpoint intervals")
    p.add_argument("--lag-rate", type=float, default=None, help="lagging modes: the disk write cap in bytes/s instead of --lag-factor")
    p.add_argument(
        "--lag-ckpts", type=int, default=None,
        help=f"lagging modes: checkpoints a loop (default: the larger of --steps / --every and {LAG_SLOTS + 2}, more than the slots)",
    )  # fmt: skip
    p.add_argument(
        "--disk-probe-gb", type=float, default=None,
        help="GB written + fsynced at start to measure the disk, for the lagging modes' write cap (default 1 on cuda, 0.1 on cpu)",
    )  # fmt: skip
    p.add_argument("--floor-reps", type=int, default=5)
    p.add_argument("--restore-reps", type=int, default=3)
    p.add_argument("--profile-restore", action="store_true", help="cProfile one more hot restore and print its top entries")
    p.add_argument("--dcp-timeout", type=float, default=600.0, help="seconds to wait for one DCP save or staging")
    p.add_argument("--drain-timeout", type=float, default=600.0, help="seconds to wait for the daemon's persists")
    p.add_argument(
        "--max-minutes", type=float, default=None,
        help="leave out the modes not started after this many minutes (default 8 on cuda: the GPU box's commands may run 10; cpu: none)",
    )  # fmt: skip
    p.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma-separated subset of {','.join(ALL_MODES)} (default: all)")
    p.add_argument("--workdir", default=os.environ.get("CKPTD_BENCH_DIR"), help="parent of the temp dir for checkpoints")
    p.add_argument("--json", default="bench-out/gpu_loop.json")
    p.add_argument("--plot", default="bench-out/gpu_loop.png")
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(a.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    a.params = a.params if a.params is not None else (0.5e9 if cuda else 2e7)
    a.batch = a.batch if a.batch is not None else (4096 if cuda else 48)
    a.steps = a.steps if a.steps is not None else (40 if cuda else 36)
    a.every = a.every if a.every is not None else (10 if cuda else 6)
    a.max_minutes = a.max_minutes if a.max_minutes is not None else (8.0 if cuda else None)
    a.disk_probe_gb = a.disk_probe_gb if a.disk_probe_gb is not None else (1.0 if cuda else 0.1)
    if a.max_minutes is not None and a.max_minutes <= 0:
        a.max_minutes = None  # --max-minutes 0: no budget
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in ALL_MODES]
    if bad:
        p.error(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(ALL_MODES)}")
    if a.steps < 1 or a.every < 1 or a.every > a.steps or a.persist_every < 1 or a.floor_reps < 1 or a.restore_reps < 1:
        p.error("--steps, --every (<= --steps), --persist-every, --floor-reps and --restore-reps must be >= 1")
    if (a.lag_ckpts is not None and a.lag_ckpts < 1) or a.disk_probe_gb <= 0:
        p.error("--lag-ckpts must be >= 1 and --disk-probe-gb > 0")
    return a


def shm_check(args: argparse.Namespace, nbytes: int) -> str | None:
    """Why /dev/shm cannot hold the ckptd modes' slots (three, and a margin), or ``None``."""
    if not any(k in args.modes for sec in CKPTD_SECTIONS.values() for k in sec):
        return None
    st = os.statvfs("/dev/shm")
    total, free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
    need = int(SLOT_ROOM * nbytes)
    if total // 2 >= need and free >= need:  # the daemon's default budget is half of /dev/shm
        return None
    fit = args.params * min(total // 2, free) / need
    return (
        f"/dev/shm has {free / 1e9:.1f} GB free of {total / 1e9:.1f} GB; the ckptd modes need {need / 1e9:.1f} GB within half of it"
        f" ({SLOT_ROOM}x the {nbytes / 1e9:.2f} GB state): run with --params {fit:.2g} or less, or with a larger /dev/shm"
        " (docker run --shm-size)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM (a timeout's) unwinds like Ctrl-C: the daemons are stopped, /dev/shm and the temp dirs cleaned
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    bench = Bench(args, device)
    stopped = False
    try:
        why = shm_check(args, bench.nbytes)
        if why is not None:
            print(f"gpu_loop: {why}", file=sys.stderr)
            return 2
        disk = shutil.disk_usage(bench.work).free
        if disk < 5 * bench.nbytes:
            log(f"warning: {disk / 1e9:.1f} GB free under {bench.work}; the checkpoints want about {5 * bench.nbytes / 1e9:.1f} GB")
        log(f"state {bench.nbytes / 1e9:.3f} GB in {bench.ntensors} tensors; modes: {', '.join(args.modes)}")
        run_loop(bench.tr, max(3, args.every), args.every)  # warm-up: kernels, allocator, caches
        bench.baseline()
        bench.floor()
        bench.save()
        bench.main_daemon()
        bench.memtier()
        if any(k in bench.rows for k in CKPTD_SECTIONS["lag"]):
            bench.probe_disk()
        bench.lagging()
        bench.dcp()
        bench.baseline()
        bench.mach["loadavg_end"] = os.getloadavg()
        bench.complete = True
    except SystemExit:  # a SIGTERM (the device's time limit): report what was measured, mark the rest
        stopped = True
        log("stopped by SIGTERM: reporting what was measured")
        for r in bench.rows.values():
            if r.error is None and r.loop_s is None:
                r.error = "skipped: the run was stopped (SIGTERM) before this mode ended"
    finally:
        bench.cleanup()
        bench.save()
    text = bench.markdown()
    print(text)
    data = bench.payload()
    data["markdown"] = text
    write_json(args.json, data)
    made = plot(args.plot, data)
    log(f"wrote {args.json}" + (f" and {made}" if made else ""))
    return 143 if stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
