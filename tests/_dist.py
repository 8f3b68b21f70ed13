"""Run a test body in N processes over gloo with a file rendezvous (no fixed ports)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def _entry(rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        with open(f"{tmp}/out-{rank}.json", "w") as f:
            json.dump(out, f)
    except BaseException:
        with open(f"{tmp}/err-{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 150.0, expect_exit: int = 0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; return each rank's JSON result."""
    tmp = tempfile.mkdtemp(prefix="ckr")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, tmp, fn, args)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        errors = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                errors.append(f"rank {r} timed out")
            elif p.exitcode != expect_exit:
                err = f"{tmp}/err-{r}.txt"
                detail = open(err).read() if os.path.exists(err) else ""
                errors.append(f"rank {r} exited {p.exitcode} (expected {expect_exit}):\n{detail}")
        if errors:
            raise AssertionError("\n".join(errors))
        outs = []
        for r in range(world):
            path = f"{tmp}/out-{r}.json"
            outs.append(json.load(open(path)) if os.path.exists(path) else None)
        return outs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
