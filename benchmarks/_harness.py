"""Shared helpers for the benchmarks: machine description, the benchmark model, a ckptd daemon
run as a subprocess, timing and markdown output.

Only ckptd's public API is used (``ckptd.Client``, ``python -m ckptd serve``), so the numbers are
what a user of the package sees.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn as nn

A = TypeVar("A")
B = TypeVar("B")

# ---------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """nproc (usable CPUs), RAM, CPU model, kernel, python and torch versions."""
    cpu_model = "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    ram = None
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
                    break
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count() or 1
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "nproc": nproc,
        "ram_bytes": ram,
        "cpu_model": cpu_model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "dev_shm_bytes": shm.f_frsize * shm.f_blocks if shm else None,
    }


# ---------------------------------------------------------------------------- model


class Block(nn.Module):
    """The parameter shapes of a transformer block (attention projections + MLP + norms)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) + v)  # no attention: only the parameters matter here
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def block_params(d: int) -> int:
    return (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d


def shape_for(params: float, layers: int = 7) -> tuple[int, int]:
    """``(layers, d_model)``, d a multiple of 64, with about ``params`` parameters (88e6 -> 7 x 1024)."""
    d = max(64, 64 * round(math.sqrt(params / (12 * layers)) / 64))
    layers = max(1, round(params / block_params(d)))
    return layers, d


def build_state(params: float, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and an AdamW whose state exists (one forward/backward/step)."""
    torch.manual_seed(seed)
    layers, d = shape_for(params)
    model = nn.Sequential(*[Block(d) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, d)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def loop_parser(doc: str, json_path: str) -> argparse.ArgumentParser:
    """The arguments every training-loop benchmark takes: state size, batch, steps, checkpoint interval, output."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--params", type=float, default=22e6)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--json", default=json_path)
    return p


def loop_state(params: float, batch: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, int]:
    """A training loop's model, optimizer (its state made), input batch, and the bytes of its state."""
    model, optim = build_state(params)
    _, d = shape_for(params)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for st in optim.state.values() for v in st.values())
    return model, optim, torch.randn(batch, d), nbytes


def views_into(buf: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Typed views of ``buf`` (uint8) packed back to back, one shaped like each tensor: copy targets."""
    out, pos = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append(buf[pos : pos + n].view(t.dtype).view(t.shape))
        pos += n
    return out


def state_tensors(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the checkpoint: model state dict values and optimizer state tensors."""
    out = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    for st in optim.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


# ---------------------------------------------------------------------------- ckptd daemon


class DaemonProcess:
    """``python -m ckptd serve`` as a child process; :meth:`stop` sends SIGTERM and waits."""

    def __init__(self, root: str, endpoint: str, log_path: str, extra_args: list[str] | None = None) -> None:
        self.root, self.endpoint, self.log_path = root, endpoint, log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "ckptd", "serve", "--root", root, "--endpoint", endpoint, *(extra_args or [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        import ckptd

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ckptd serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ckptd serve did not answer within {timeout:.0f} s:\n{self.log_tail()}")
            sock = self.endpoint.removeprefix("ipc://")
            if not self.endpoint.startswith("ipc://") or os.path.exists(sock):
                probe = ckptd.Client(endpoint=self.endpoint, job="probe", timeout=1.0)
                try:
                    probe.hello()
                    return
                except ckptd.CheckpointError:
                    pass
                finally:
                    probe.close()
            time.sleep(0.1)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            if not self._log.closed:
                self._log.flush()
            with open(self.log_path, "rb") as f:
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM, wait (the daemon finishes pending persists and unlinks its segments), else SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"warning: ckptd serve (pid {self.proc.pid}) ignored SIGTERM for {timeout:.0f} s; killing it", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._remove_leftover_segments()
        return self.proc.returncode

    def _remove_leftover_segments(self) -> None:
        try:
            from ckptd import shm
        except ImportError:
            return
        with contextlib.suppress(Exception):
            for name in shm.purge(self.root):
                print(f"warning: ckptd left {name} in {shm.SHM_DIR} behind; removed it", file=sys.stderr)


# ---------------------------------------------------------------------------- results


@dataclass
class Row:
    key: str
    name: str
    samples: list[float] = field(default_factory=list)
    note: str = ""
    error: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


class Results:
    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def row(self, key: str, name: str, note: str = "") -> Row:
        if key not in self.rows:
            self.rows[key] = Row(key, name, note=note)
        return self.rows[key]

    def median(self, key: str) -> float | None:
        r = self.rows.get(key)
        return r.median if r is not None else None

    def ratio(self, num: str, den: str) -> float | None:
        a, b = self.median(num), self.median(den)
        return a / b if a is not None and b else None

    def markdown(self, floor_key: str) -> str:
        floor = self.median(floor_key)
        out = ["| measurement | n | median (s) | x floor | samples (s) | note |", "|---|---:|---:|---:|---|---|"]
        for r in self.rows.values():
            if r.median is None:
                out.append(f"| {r.name} | 0 | n/a | n/a | | {r.error or r.note} |")
                continue
            ratio = f"{r.median / floor:.2f}" if floor else "n/a"
            samples = " ".join(f"{s:.3f}" for s in r.samples)
            out.append(f"| {r.name} | {len(r.samples)} | {r.median:.4f} | {ratio} | {samples} | {r.note} |")
        return "\n".join(out)

    def to_json(self, floor_key: str) -> list[dict[str, Any]]:
        floor = self.median(floor_key)
        return [
            {
                "key": r.key,
                "name": r.name,
                "n": len(r.samples),
                "median_s": r.median,
                "ratio_to_floor": (r.median / floor) if (r.median is not None and floor) else None,
                "samples_s": r.samples,
                "note": r.note,
                "error": r.error,
            }
            for r in self.rows.values()
        ]


@contextlib.contextmanager
def timer() -> Iterator[list[float]]:
    """``with timer() as t: ...`` then ``t[0]`` is the elapsed wall time in seconds."""
    out: list[float] = []
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out.append(time.perf_counter() - t0)


@contextlib.contextmanager
def fds_to(path: str) -> Iterator[None]:
    """Point this process's stdout/stderr file descriptors at ``path`` (children spawned meanwhile keep it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for x in (*saved, fd):
            os.close(x)


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


def write_json(path: str, obj: Any) -> None:
    """A benchmark's results, for ``plot.py`` and for the record (``bench-out/<name>.json``)."""
    import json

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


# ---------------------------------------------------------------------------- shared by several benchmarks


def alternate(i: int, first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
    """Run a pair of measurements back to back, ``first`` first on even ``i`` and second on odd ``i``; their results
    in the order ``(first, second)``. Neither then always follows what ran before the pair (the previous snapshot's
    ``wait()``, a write-back), so a paired ratio carries no order bias."""
    if i % 2 == 0:
        a = first()
        return a, second()
    b = second()
    return first(), b


def disk_write_rate(directory: str, nbytes: int, block: int = 16 << 20) -> tuple[float, float]:
    """``(bytes/s, seconds)`` of one sequential write + fsync of ``nbytes`` incompressible bytes to a new file in
    ``directory`` (removed after): what the disk really sustains for a checkpoint-sized write."""
    chunk = memoryview(os.urandom(min(block, max(nbytes, 1))))
    path = os.path.join(directory, f"ckptd-disk-probe-{os.getpid()}.bin")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
        dt = time.perf_counter() - t0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return nbytes / dt, dt


def evict(step_dir: str) -> None:
    """Drop a step's files from the page cache (they are fsynced: written back already)."""
    for name in os.listdir(step_dir):
        fd = os.open(os.path.join(step_dir, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def stop_dcp_checkpoint_process() -> None:
    """Terminate the checkpoint process that process-mode ``async_save`` keeps for the process's lifetime."""
    try:
        import torch.distributed.checkpoint._async_process_executor as ape
    except ImportError:
        return
    p = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if p is None:
        return
    ape._CHECKPOINT_PROCESS = None
    with contextlib.suppress(Exception):
        p.__del__()  # sends TERMINATE, joins, SIGTERMs if needed


def gather(q: Any, procs: list[Any], timeout: float, failed: Callable[[], str]) -> list[Any]:
    """One result from ``q`` per rank process in ``procs``, then every process joined: ``RuntimeError`` (``failed()``
    says what) when a rank exits with an error, or the results take longer than ``timeout`` seconds."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < len(procs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"a rank failed or timed out: {failed()}")
        try:
            got.append(q.get(timeout=1.0))
        except Exception:  # queue.Empty
            continue
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return got
