"""Run a test body in N processes over gloo with a file rendezvous (no fixed ports).

The ranks are forked from a forkserver that imported torch once per test process: a spawned rank spent
3-4 s of CPU importing torch before its first line, which made most of the suite's time on 2 cores. A
forked rank inherits the forkserver's environment, not the caller's: the caller's environment at the call is
handed to each rank and set before the body is imported (multiprocessing sets its working directory and sys.path).
"""

from __future__ import annotations

import functools
import importlib
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

# imported once, in the forkserver: torch only. ckptd and the rank's body are imported in each rank once the
# caller's environment is set (ckptd.shm reads CKPTD_SHM_DIR when imported)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor", "numpy"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts (the first call)
    return ctx


def _entry(rank: int, world: int, tmp: str, where: tuple[str, str], args: tuple[Any, ...], env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    code = 0
    try:
        fn = functools.reduce(getattr, where[1].split("."), importlib.import_module(where[0]))
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
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks; return each rank's JSON result."""
    tmp = tempfile.mkdtemp(prefix="ckr")
    ctx = _context()
    env = dict(os.environ)
    where = (fn.__module__, fn.__qualname__)
    procs = [ctx.Process(target=_entry, args=(r, world, tmp, where, args, env)) for r in range(world)]
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
