"""A client's settings from its arguments and the environment: where the rank stands in the job, the
job's tiering, and whether ``snapshot()``'s default mode copies behind the next step (``overlap``)."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ..config import default_job, env_float, env_int, validate_job
from ..errors import CheckpointError

log = logging.getLogger("ckptd.client")

OVERLAP_MODES = ("auto", "always", "never")


def dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_world_size(world: int) -> int:
    """How many of the job's ranks share this node's daemon: torchrun's ``LOCAL_WORLD_SIZE``, else all."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(v) if v.isdigit() and 1 <= int(v) <= world else world


def tier_settings(every: int | None, interval: float | None) -> dict[str, Any]:
    """The commit's ``persist_every`` / ``persist_interval``: the arguments, else the environment, else
    ``None`` (the daemon's); ``ValueError`` naming a bad one."""
    if every is None and os.environ.get("CKPTD_PERSIST_EVERY"):
        every = env_int("CKPTD_PERSIST_EVERY", 1)
    if interval is None and os.environ.get("CKPTD_PERSIST_INTERVAL"):
        interval = env_float("CKPTD_PERSIST_INTERVAL", 0.0)
    # the daemon's bounds (protocol): refused here, before a snapshot copies its data only to fail at the commit
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= 1 << 31):
        raise ValueError(f"persist_every must be an int in 1..{1 << 31}, got {every!r}")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval <= 1e9):
        raise ValueError(f"persist_interval must be a number of seconds in 0..1e9, got {interval!r}")
    return {"persist_every": every, "persist_interval": interval}


def overlap_setting(overlap: str | None) -> str:
    """``snapshot()``'s default mode: the argument, else ``CKPTD_OVERLAP``, else ``"auto"``.

    * ``"auto"``: copy what only ``optimizer.step()`` mutates behind the next forward/backward when the
      state has CUDA tensors (the device-to-host copy runs on the copy engine, beside the compute); copy
      a CPU-only state before returning, as ``blocking=True`` does (on CPU the copy and the step share
      the same cores, and a background copy slowed the steps it overlapped by more than it saved);
    * ``"always"``: the background copy for CPU state too (a CPU trainer with cores to spare);
    * ``"never"``: every snapshot copies before returning.
    """
    if overlap is None:
        overlap = os.environ.get("CKPTD_OVERLAP") or "auto"
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"CKPTD_OVERLAP={overlap!r} is not one of {', '.join(OVERLAP_MODES)}")
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, got {overlap!r}")
    return overlap


def check_step(step: object) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


def check_not_saved(client: Any, step: int) -> None:
    """A client that restored a step refuses to save a number it saved since (that would replace it)."""
    if client._stager.after is not None and step in client._stager.saved:
        raise CheckpointError(
            f"step {step} of job {client.job} was already saved by this client since it restored step {client._stager.after}:"
            " saving it again would replace it"
        )


class JobName:
    """The job's name, and whether ckptd derived it (no ``job=``, no ``CKPTD_JOB``): a derived name changes with the
    script's arguments and directory, so a run meant to resume could start a new job over silently. Such a name is said
    once, on rank 0, at warning level, with the job's newest step (or that it starts fresh) and, when it starts fresh,
    the other jobs of the same script that have steps under the daemon's root.

    Args:
        job: The name given, or ``None`` to derive it (:func:`ckptd.config.default_job`).
    """

    def __init__(self, job: str | None) -> None:
        self.derived = job is None and not os.environ.get("CKPTD_JOB")
        self.name = validate_job(job if job is not None else default_job())
        self._said = not self.derived

    def announce(self, rpc: Any) -> None:
        """Say the derived name, once per client (the first ``latest()`` or ``snapshot()``); never raises."""
        if self._said:
            return
        self._said = True
        if dist_rank_world()[0] != 0:
            return
        try:
            newest = rpc.call("latest", job=self.name)["step"]
            jobs = rpc.call("status").get("jobs") or {} if newest is None else {}
        except CheckpointError:
            return  # the call the user made says what is wrong with the daemon
        how = f"its newest step is {newest}" if newest is not None else "no step of it yet: it starts fresh"
        log.warning("ckptd job %r is named after the script, its directory and its arguments (set CKPTD_JOB to choose): %s", self.name, how)
        script = re.fullmatch(r"(.+)-[0-9a-f]{8}", self.name)
        others = [
            f"{j} (step {v['latest']})" for j, v in sorted(jobs.items())
            if script and j != self.name and re.fullmatch(re.escape(script[1]) + r"-[0-9a-f]{8}", j) and isinstance(v, dict)
            and v.get("latest") is not None
        ]  # fmt: skip
        if others:
            log.warning(
                "other runs of this script have steps under the daemon's root: %s. A run with other arguments or in another"
                " directory is another job: to resume one of them, set CKPTD_JOB to its name",
                ", ".join(others),
            )
