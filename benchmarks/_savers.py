"""torch's own savers timed for ``stall.py``: ``torch.save`` + fsync, ``dcp.save``, and ``dcp.async_save`` in
thread mode and (with a 1-rank gloo group) process mode, each call's output removed before the next."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _floor import log  # noqa: E402
from _harness import Results, fds_to, stop_dcp_checkpoint_process, timer  # noqa: E402


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
