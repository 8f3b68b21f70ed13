"""Stall benchmark: how long a checkpoint holds up the training thread, ckptd against torch's savers.

One process, one model + AdamW state (default: 88M float32 parameters, about 1.06 GB of state),
every measurement on that same state in one run:

* floor: copy every tensor into a prefaulted, persistently mapped /dev/shm buffer (the least a
  blocking staging copy can cost), alone and once more just before each blocking ckptd snapshot
  (the per-rep ratio of such pairs holds up when other processes share the CPUs and memory bus);
* ckptd ``snapshot(blocking=True)`` (first call separately: it allocates the slot), default
  ``snapshot()`` (on this CPU-only state ``overlap="auto"`` copies before returning, as blocking does; on
  GPU state it returns before the copy, which finishes in a background thread), and time to durable (call until ``handle.wait()`` returns);
* ``torch.save`` + fsync, ``dcp.save``, and ``dcp.async_save`` in thread mode and, with a 1-rank gloo
  group, process mode (default stager, and a persistent shared-memory stager).

Every ckptd step is made durable, and every saver's output removed, before the next measurement.
Prints a markdown table (median seconds and ratio to the floor) and the acceptance ratios, and
writes everything as JSON (``--json``). The exit status is 0 when a target is missed (this is a
report) and nonzero only on errors.

Usage: ``.venv/bin/python benchmarks/stall.py [--params 88e6 | --size-gb 1.06] [--reps 5] [--json PATH]``
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import mmap
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (  # noqa: E402
    DaemonProcess,
    Results,
    build_state,
    dir_bytes,
    fds_to,
    machine_info,
    shape_for,
    state_tensors,
    stop_dcp_checkpoint_process,
    timer,
    write_json,
)

import ckptd  # noqa: E402

BLOCKING_FLOOR_TARGET = 1.5  # blocking snapshot / floor <= 1.5
VS_ASYNC_SAVE_TARGET = 1.0  # blocking snapshot / dcp.async_save warm stall < 1.0
WRITE_BLOCK = 16 << 20


def log(msg: str) -> None:
    print(f"[stall {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- floor


class ShmBuffer:
    """A /dev/shm file, fully allocated (``posix_fallocate``) and mapped once with ``MAP_POPULATE``."""

    def __init__(self, size: int) -> None:
        self.path = os.path.join("/dev/shm", f"ckptd-bench-floor-{os.getpid()}")
        self.size = size
        self._mm: mmap.mmap | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    def view(self) -> memoryview:
        assert self._mm is not None
        return memoryview(self._mm)

    def close(self) -> None:
        self.tensor = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes at exit
                self._mm.close()
            self._mm = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def pack(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int, torch.Tensor]], int]:
    """Back-to-back byte ranges, larger element sizes first (every tensor aligned to its element size)."""
    plan, pos = [], 0
    for t in sorted(tensors, key=lambda t: -t.element_size()):
        n = t.numel() * t.element_size()
        plan.append((pos, pos + n, t))
        pos += n
    return plan, pos


def copy_all(dst: torch.Tensor, plan: list[tuple[int, int, torch.Tensor]]) -> None:
    for b, e, t in plan:
        dst[b:e].view(t.dtype).view(t.shape).copy_(t)


def write_fsync(path: str, view: memoryview, nbytes: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        while pos < nbytes:
            pos += os.write(fd, view[pos : min(nbytes, pos + WRITE_BLOCK)])
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- measurements


class Floor:
    """The floor copy: every tensor into one prefaulted, persistently mapped /dev/shm buffer."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.plan, self.nbytes = pack(tensors)
        self.buf = ShmBuffer(self.nbytes)
        self.sample()  # warm-up: every later copy finds the pages mapped and the caches as they will be

    def sample(self) -> float:
        assert self.buf.tensor is not None
        with timer() as t:
            copy_all(self.buf.tensor, self.plan)
        return t[0]

    def close(self) -> None:
        self.buf.close()


def measure_floor(res: Results, floor: Floor, workdir: str, reps: int, slow_reps: int) -> None:
    row = res.row("floor", "floor: copy into prefaulted /dev/shm (warm mapping)")
    row.samples.extend(floor.sample() for _ in range(reps))
    row.note = f"{floor.nbytes / row.median / 1e9:.1f} GB/s" if row.median else ""
    log(f"floor: {row.median:.4f} s")
    res.row("floor_paired", "floor, interleaved: one copy just before each blocking snapshot")  # filled by measure_ckptd
    # the disk the checkpoints go to: one sequential write + fsync of the same bytes
    drow = res.row("disk", "disk: sequential write + fsync of the state bytes")
    path = os.path.join(workdir, "disk-probe.bin")
    view = floor.buf.view()
    try:
        for _ in range(slow_reps):
            with timer() as t:
                write_fsync(path, view, floor.nbytes)
            drow.samples.append(t[0])
            os.unlink(path)
    finally:
        view.release()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    drow.note = f"{floor.nbytes / drow.median / 1e9:.2f} GB/s" if drow.median else ""
    log(f"disk write+fsync: {drow.median:.3f} s")


def measure_ckptd(
    res: Results, model: torch.nn.Module, optim: torch.optim.Optimizer, floor: Floor, workdir: str, reps: int, profile: bool
) -> dict[str, Any]:
    root = os.path.join(workdir, "ckptd-root")
    endpoint = f"ipc://{os.path.join(workdir, 'sock', 'ckptd.sock')}"
    info: dict[str, Any] = {"root": root, "endpoint": endpoint}
    daemon = DaemonProcess(root, endpoint, os.path.join(workdir, "ckptd.log"))
    client: ckptd.Client | None = None
    ok = False
    try:
        daemon.wait_ready()
        client = ckptd.Client(endpoint=endpoint, job="bench")
        step = 0

        def snap(blocking: bool) -> tuple[ckptd.SnapshotHandle, float]:
            nonlocal step
            step += 1
            assert client is not None
            t0 = time.perf_counter()
            h = client.snapshot(model, optim, step=step, blocking=blocking)
            return h, t0

        h, t0 = snap(True)
        first = time.perf_counter() - t0
        path = h.wait()
        first_row = res.row("ckptd_first", "ckptd snapshot(blocking=True), first (allocation)")
        first_row.samples.append(first)
        first_row.note = f"durable after {time.perf_counter() - t0:.2f} s"
        info["checkpoint_bytes_on_disk"] = dir_bytes(path)
        log(f"ckptd first snapshot: {first:.3f} s, durable at {path}")

        # the same first snapshot for a job that called ckptd.prepare() at start-up
        with ckptd.Client(endpoint=endpoint, job="bench-prepared") as prepared:
            t0 = time.perf_counter()
            prepared.prepare(model, optim)
            prep_row = res.row("ckptd_prepare", "ckptd prepare() at start-up (one-time, outside the loop)")
            prep_row.samples.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            h = prepared.snapshot(model, optim, step=1, blocking=True)
            res.row("ckptd_first_prepared", "ckptd snapshot(blocking=True), first after prepare()").samples.append(time.perf_counter() - t0)
            h.wait()
        log(f"ckptd prepare: {prep_row.samples[0]:.3f} s, then first snapshot {res.rows['ckptd_first_prepared'].samples[0]:.3f} s")

        blk = res.row("ckptd_blocking", "ckptd snapshot(blocking=True), warm: until it returns")
        blk_d = res.row("ckptd_blocking_durable", "ckptd snapshot(blocking=True): call -> h.wait() (durable)")
        # a floor copy right before each blocking snapshot: the pair sees the same machine state,
        # so their ratio holds up when other processes share the memory bus
        paired = res.row("floor_paired", "floor, interleaved: one copy just before each blocking snapshot")
        for _ in range(reps):
            paired.samples.append(floor.sample())
            h, t0 = snap(True)
            t1 = time.perf_counter()
            h.wait()
            t2 = time.perf_counter()
            blk.samples.append(t1 - t0)
            blk_d.samples.append(t2 - t0)
        info["paired_ratios"] = [b / f for b, f in zip(blk.samples, paired.samples)]
        log(f"ckptd blocking: {blk.median:.4f} s (durable {blk_d.median:.3f} s), interleaved floor {paired.median:.4f} s")

        dflt = res.row("ckptd_default", "ckptd snapshot() default (overlap=auto), warm: until it returns")
        copied = res.row("ckptd_default_copied", "ckptd snapshot() default: call -> copy committed")
        durable = res.row("ckptd_durable", "ckptd time to durable: snapshot() call -> h.wait()")
        for _ in range(reps):
            h, t0 = snap(False)
            t1 = time.perf_counter()
            h.wait_copied()
            t2 = time.perf_counter()
            h.wait()
            t3 = time.perf_counter()
            dflt.samples.append(t1 - t0)
            copied.samples.append(t2 - t0)
            durable.samples.append(t3 - t0)
        copied.note = "bounds optimizer.step() wait"
        log(f"ckptd default: {dflt.median:.4f} s (copied {copied.median:.3f} s, durable {durable.median:.3f} s)")

        if profile:
            pr = cProfile.Profile()
            h, t0 = snap(True)  # one more warm-up so the profiled call is like the measured ones
            h.wait()
            step += 1
            pr.enable()
            h = client.snapshot(model, optim, step=step, blocking=True)
            pr.disable()
            h.wait()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(25)
            info["profile"] = out.getvalue()
        info["status"] = {k: v for k, v in client.status().items() if k in ("persisted_bytes", "persist_seconds", "steps_committed")}
        ok = True
    finally:
        if client is not None:
            client.close()
        rc = daemon.stop()
        if not ok:
            print(f"ckptd daemon log (tail):\n{daemon.log_tail()}", file=sys.stderr)
        info["daemon_exit"] = rc
    if rc != 0:
        raise RuntimeError(f"ckptd serve exited with status {rc}:\n{daemon.log_tail()}")
    return info


def sd_dcp(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def measure_torch_save(res: Results, model: torch.nn.Module, optim: torch.optim.Optimizer, workdir: str, reps: int) -> None:
    row = res.row("torch_save", "torch.save + fsync")
    path = os.path.join(workdir, "torch-save.pt")
    try:
        for _ in range(reps):
            with timer() as t:
                with open(path, "wb") as f:
                    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())
            row.samples.append(t[0])
            os.unlink(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    log(f"torch.save: {row.median:.3f} s")


def measure_dcp_save(res: Results, model: torch.nn.Module, optim: torch.optim.Optimizer, workdir: str, reps: int) -> None:
    row = res.row("dcp_save", "dcp.save")
    for i in range(reps):
        d = os.path.join(workdir, f"dcp-save-{i}")
        try:
            with timer() as t:
                dcp.save(sd_dcp(model, optim), checkpoint_id=d)
            row.samples.append(t[0])
        finally:
            shutil.rmtree(d, ignore_errors=True)
    log(f"dcp.save: {row.median:.3f} s")


def measure_async_save(
    res: Results,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    workdir: str,
    reps: int,
    key: str,
    label: str,
    first_call_wrapper: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    **kwargs: Any,
) -> None:
    """``dcp.async_save``: the first call, then ``reps`` warm calls, each waited to durable before the next."""
    first = res.row(f"{key}_first", f"dcp.async_save ({label}), first call: until it returns")
    stall = res.row(key, f"dcp.async_save ({label}), warm: until it returns")
    durable = res.row(f"{key}_durable", f"dcp.async_save ({label}): call -> future.result() (durable)")
    for i in range(reps + 1):
        d = os.path.join(workdir, f"{key}-{i}")
        try:
            ctx = first_call_wrapper() if i == 0 else contextlib.nullcontext()
            with ctx:
                t0 = time.perf_counter()
                fut = dcp.async_save(sd_dcp(model, optim), checkpoint_id=d, **kwargs)
                t1 = time.perf_counter()
                fut.result()
                t2 = time.perf_counter()
            if not os.path.exists(os.path.join(d, ".metadata")):
                raise RuntimeError(f"dcp.async_save ({label}) finished without writing {d}/.metadata")
            if i == 0:
                first.samples.append(t1 - t0)
                first.note = f"durable after {t2 - t0:.2f} s"
            else:
                stall.samples.append(t1 - t0)
                durable.samples.append(t2 - t0)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    log(f"dcp.async_save ({label}): first {first.median:.3f} s, warm {stall.median:.4f} s, durable {durable.median:.3f} s")


def measure_async_process(res: Results, model: torch.nn.Module, optim: torch.optim.Optimizer, workdir: str, reps: int) -> str | None:
    """Process mode needs a process group (it spawns a checkpoint process that joins its own gloo group)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    proc_log = os.path.join(workdir, "dcp-process.log")
    own_pg = False
    stager = None
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'pg-init')}", rank=0, world_size=1)
            own_pg = True
        # the checkpoint process logs every request to the fds it inherits: send them to a file
        measure_async_save(
            res,
            model,
            optim,
            workdir,
            reps,
            "dcp_async_process",
            "process, default stager",
            first_call_wrapper=lambda: fds_to(proc_log),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        # a persistent stager in shared memory: buffers are cached and reused after the first call
        stager = DefaultStager(
            StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False)
        )
        measure_async_save(
            res,
            model,
            optim,
            workdir,
            reps,
            "dcp_async_process_shm",
            "process, cached shm stager",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        return None
    except Exception as e:  # process mode is optional: report why it did not run
        err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        log(f"dcp.async_save process mode failed: {err}")
        for key in ("dcp_async_process", "dcp_async_process_shm"):
            r = res.row(key, f"dcp.async_save ({key.removeprefix('dcp_async_')}), warm: until it returns")
            if not r.samples:
                r.error = f"failed: {err}"
        return err
    finally:
        if stager is not None:
            stager.close()
        stop_dcp_checkpoint_process()
        if own_pg:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--params", type=float, default=88e6, help="model parameters (float32; state = 12 B/param with AdamW). Default 88e6")
    size.add_argument("--size-gb", type=float, default=None, help="state size in GB (10^9 B) instead of --params, e.g. 1.06")
    p.add_argument("--reps", type=int, default=5, help="repetitions of the fast measurements (default 5)")
    p.add_argument("--slow-reps", type=int, default=3, help="repetitions of torch.save, dcp.save, process mode, disk (default 3)")
    p.add_argument("--json", default="bench-out/stall.json", help="where to write the results (default bench-out/stall.json)")
    p.add_argument("--workdir", default=None, help="parent of the temp dir for checkpoints (default: the system temp dir)")
    p.add_argument("--skip-process", action="store_true", help="skip dcp.async_save process mode")
    p.add_argument("--profile", action="store_true", help="cProfile one warm blocking ckptd snapshot and print the top entries")
    a = p.parse_args(argv)
    if a.size_gb is not None:
        a.params = a.size_gb * 1e9 / 12
    if a.reps < 1 or a.slow_reps < 1:
        p.error("--reps and --slow-reps must be >= 1")
    return a


def verdict(ratio: float | None, target: float, strict: bool) -> str:
    if ratio is None:
        return "n/a"
    ok = ratio < target if strict else ratio <= target
    return "PASS" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    t_start = time.perf_counter()
    mach = machine_info()
    load_start = os.getloadavg()
    layers, d = shape_for(args.params)
    log(f"building {layers} x Block(d={d}) + AdamW")
    model, optim = build_state(args.params)
    tensors = state_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    nparams = sum(p.numel() for p in model.parameters())

    workdir = tempfile.mkdtemp(prefix="ckptd-stall-", dir=args.workdir)
    res = Results()
    extra: dict[str, Any] = {}
    floor: Floor | None = None
    try:
        floor = Floor(tensors)
        assert floor.nbytes == nbytes
        measure_floor(res, floor, workdir, args.reps, args.slow_reps)
        extra["ckptd"] = measure_ckptd(res, model, optim, floor, workdir, args.reps, args.profile)
        floor.close()
        measure_torch_save(res, model, optim, workdir, args.slow_reps)
        measure_dcp_save(res, model, optim, workdir, args.slow_reps)
        measure_async_save(res, model, optim, workdir, args.reps, "dcp_async_thread", "thread")
        if not args.skip_process:
            extra["process_mode_error"] = measure_async_process(res, model, optim, workdir, args.slow_reps)
    finally:
        if floor is not None:
            floor.close()
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    load_end = os.getloadavg()
    mach["loadavg_start"], mach["loadavg_end"] = load_start, load_end

    r_floor = res.ratio("ckptd_blocking", "floor")
    r_async = res.ratio("ckptd_blocking", "dcp_async_thread")
    pairs = extra.get("ckptd", {}).get("paired_ratios") or []
    r_paired = statistics.median(pairs) if pairs else None
    # the paired ratio is the criterion: each blocking snapshot against a floor copy taken right
    # before it, so both see the same machine. The unpaired medians ratio compares rows measured
    # at different moments and swings with the neighbours' load; it is shown for information.
    criteria = [
        {
            "name": "ckptd blocking snapshot / interleaved floor (median of per-rep ratios)",
            "ratio": r_paired,
            "target": f"<= {BLOCKING_FLOOR_TARGET}",
            "verdict": verdict(r_paired, BLOCKING_FLOOR_TARGET, strict=False),
        },
        {
            "name": "ckptd blocking snapshot / dcp.async_save (thread) warm stall",
            "ratio": r_async,
            "target": f"< {VS_ASYNC_SAVE_TARGET}",
            "verdict": verdict(r_async, VS_ASYNC_SAVE_TARGET, strict=True),
        },
        {
            "name": "(for information) ckptd blocking snapshot / floor, unpaired medians",
            "ratio": r_floor,
            "target": "-",
            "verdict": "info",
        },
    ]

    ram = f"{mach['ram_bytes'] / 2**30:.1f} GiB" if mach["ram_bytes"] else "unknown"
    lines = [
        "## ckptd stall benchmark",
        "",
        f"- machine: nproc {mach['nproc']}, RAM {ram}, CPU {mach['cpu_model']}, kernel {mach['kernel']}",
        f"- python {mach['python']}, torch {mach['torch']} ({mach['torch_threads']} intra-op threads)",
        f"- state: {nparams / 1e6:.2f} M float32 params ({layers} x Block(d={d})) + AdamW state = "
        f"{nbytes / 1e9:.3f} GB ({nbytes / 2**30:.3f} GiB) in {len(tensors)} tensors",
        f"- reps: {args.reps} (fast rows), {args.slow_reps} (torch.save, dcp.save, process mode, disk); median shown; "
        f"total run {elapsed:.0f} s",
        f"- load average (1/5/15 min) at start {'/'.join(f'{x:.2f}' for x in load_start)}, "
        f"at end {'/'.join(f'{x:.2f}' for x in load_end)}" + ("  (other processes were busy: expect noise)" if load_start[0] > 0.5 else ""),
        "",
        res.markdown("floor"),
        "",
    ]
    for c in criteria:
        ratio = "n/a" if c["ratio"] is None else f"{c['ratio']:.2f}"
        if c["verdict"] == "info":
            lines.append(f"- {c['name']} = {ratio}")
        else:
            lines.append(f"- {c['name']} = {ratio} (target {c['target']}): **{c['verdict']}**")
    print("\n".join(lines))
    if args.profile and "profile" in extra.get("ckptd", {}):
        print("\n### cProfile of one warm blocking ckptd snapshot\n\n```\n" + extra["ckptd"]["profile"].strip() + "\n```")

    out = {
        "benchmark": "stall",
        "machine": mach,
        "config": {"params": nparams, "layers": layers, "d_model": d, "reps": args.reps, "slow_reps": args.slow_reps},
        "state": {"bytes": nbytes, "tensors": len(tensors), "params": nparams},
        "rows": res.to_json("floor"),
        "criteria": criteria,
        "extra": extra,
        "elapsed_s": elapsed,
        "unix_time": time.time(),
    }
    if os.path.dirname(args.json):
        write_json(args.json, out)
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
