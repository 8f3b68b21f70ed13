"""``dcp.async_save`` as the GPU loop benchmark (``gpu_loop.py``) runs it in its DCP modes: one save in flight, the
optimizer step waiting for asynchronous staging, and torch's ``DefaultStager`` reused across saves or fresh per save.
Training thread only."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DcpSave:
    ret: Any  # what async_save returned
    path: str
    stager: Any = None  # its own DefaultStager (fresh per save), closed once the save is on disk
    settled: bool = False


class DcpSaves:
    """One DCP mode's ``dcp.async_save`` calls: one save in flight, as users run it (a save first waits for the previous
    one's upload); with asynchronous staging, the optimizer step waits for the newest staging (:meth:`pre_step`).
    ``-pinned`` modes stage through a ``DefaultStager`` on pinned memory: one reused across saves, or (``-fresh``) a new
    one per save, closed once its save is on disk."""

    def __init__(self, key: str, work: str, model: torch.nn.Module, optim: torch.optim.Optimizer, timeout: float) -> None:
        """On CPU state (no accelerator) the stager's memory is not page-locked and its copies are blocking."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.key, self.work, self.model, self.optim, self.timeout = key, work, model, optim, timeout
        cuda = any(p.is_cuda for p in model.parameters())
        self.process, self.pinned, self.fresh = key.startswith("dcp-process"), "-pinned" in key, key.endswith("-fresh")
        self._save, self._state = dcp.async_save, get_state_dict
        self.kw: dict[str, Any] = {}
        if self.process:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            self.kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        self.new_stager: Callable[[], Any] | None = None
        if self.pinned:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            opts = StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=self.process, use_async_staging=True, use_non_blocking_copy=cuda
            )
            self.new_stager = lambda: DefaultStager(opts)
        self.stager: Any = self.new_stager() if self.new_stager is not None and not self.fresh else None  # reused across saves
        self.inflight: list[DcpSave] = []
        self.staging: list[Any] = []  # the staging futures of asynchronous staging
        self.done = 0  # saves on disk
        self.n = itertools.count()

    @staticmethod
    def upload(ret: Any) -> Any:
        return getattr(ret, "upload_completion", ret)  # an AsyncSaveResponse, or the Future itself

    def settle(self, s: DcpSave) -> None:
        """Wait for a save's upload; then its own (fresh) stager is closed."""
        if s.settled:
            return
        self.upload(s.ret).result(timeout=self.timeout)
        s.settled = True
        self.done += 1
        if s.stager is not None:
            s.stager.close()
            s.stager = None

    def save(self) -> tuple[float, float]:
        """One save: (seconds waiting for the previous one, seconds until the call returned)."""
        t0 = time.perf_counter()
        if self.inflight:
            self.settle(self.inflight[-1])
            while len(self.inflight) > 1:
                shutil.rmtree(self.inflight.pop(0).path, ignore_errors=True)
        t1 = time.perf_counter()
        msd, osd = self._state(self.model, self.optim)
        path = os.path.join(self.work, f"{self.key}-{next(self.n)}")
        own = self.new_stager() if self.fresh and self.new_stager is not None else None
        stager = own if own is not None else self.stager
        kw = {**self.kw, **({"async_stager": stager} if stager is not None else {})}
        ret = self._save({"model": msd, "optim": osd}, checkpoint_id=path, **kw)
        self.inflight.append(DcpSave(ret, path, own))
        if hasattr(ret, "staging_completion"):
            self.staging.append(ret.staging_completion)
        return t1 - t0, time.perf_counter() - t0

    def pre_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.staged()  # the state must be staged before the step mutates it

    def staged(self) -> None:
        if self.staging:
            self.staging[-1].result(timeout=self.timeout)

    def wait_all(self) -> float:
        """Every save on disk; the seconds it took."""
        t0 = time.perf_counter()
        for s in self.inflight:
            self.settle(s)
        return time.perf_counter() - t0

    def close(self) -> None:
        for s in self.inflight:
            with contextlib.suppress(Exception):
                self.settle(s)
            shutil.rmtree(s.path, ignore_errors=True)
            if s.stager is not None:
                with contextlib.suppress(Exception):
                    s.stager.close()
        if self.stager is not None:
            with contextlib.suppress(Exception):
                self.stager.close()
