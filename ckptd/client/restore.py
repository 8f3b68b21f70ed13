"""Where a restore reads from — the daemon's shared memory, the local root, or the bucket — and the
conversation with the daemon that decides it. The reading itself is :mod:`.reader`'s.

* ``path`` given: that directory, no daemon (:attr:`Source.DISK`).
* ``hot_open``: if the daemon still holds every rank's shard of the step in shared memory (a trainer
  restarted on the same node), those segments are read, pinned until ``hot_close``
  (:attr:`Source.MEMORY`). This is the only way to read a step held in the memory tier only.
* First (``promote``, then ``wait``): a step the daemon is still sealing or persisting is waited for, so a
  restore right after a snapshot reads that snapshot; a restore that may not read shared memory has a
  memory-only step persisted first, and reads it from disk.
* else ``fetch``: the daemon picks the newest complete step (or the one asked for) under its root or
  in its bucket, downloading it into the root first if only the bucket has it
  (:attr:`Source.DISK` / :attr:`Source.BUCKET`).

Runs on the calling (training) thread. Every rank asks the daemon on its own: no collectives, except that
a failure before the restore reads anything is shared with the other ranks of a collective restore
(:func:`.agree.fail_early`), so that none waits for a rank that gave up.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from .. import shm
from ..errors import CheckpointError, FormatError
from ..protocol import Source
from .agree import shared
from .load import Restored, restore_state
from .reader import CheckpointReader
from .rpc import Channel

log = logging.getLogger("ckptd.client")

FETCH_POLL_S = 25.0  # each fetch_wait; the daemon is probed between polls (a download may take minutes)


def restored(step: int | None, path: str, source: Source) -> dict[str, Any]:
    """What :attr:`Client.last_restore` says about a restore."""
    return {"step": step, "path": path, "source": source.value}


def fetch(rpc: Channel, job: str, step: int | None) -> dict[str, Any]:
    """The daemon's answer to which step to restore (``fetch_wait``'s reply, its ``fetch`` id added),
    downloaded into its root if only the bucket had it. The step is held from the daemon's local
    retention until :func:`close_fetch`."""
    fid = rpc.call("fetch", job=job, step=step)["fetch"]
    while True:
        rep = rpc.call("fetch_wait", rpc_timeout=rpc.timeout + FETCH_POLL_S + 5.0, fetch=fid, timeout=FETCH_POLL_S)
        if rep["state"] == "done":
            return {**rep, "fetch": fid}
        if rep["state"] == "failed":
            raise CheckpointError(rep["error"])


def close_fetch(rpc: Channel, fid: int) -> None:
    """Done reading the step of fetch ``fid``: retention may remove it. Best effort: a daemon older than
    ``fetch_close`` (or one that restarted) lets its hold lapse on its own."""
    try:
        rpc.call("fetch_close", fetch=fid)
    except CheckpointError as e:
        log.debug("fetch_close %s: %s", fid, e)


def settled(rpc: Channel, job: str, step: int | None, *, persist: bool) -> int | None:
    """Before a restore of ``step`` (``None``: the newest): if the daemon still works on it (its ranks all
    committed, it is being sealed or persisted) or holds it in the memory tier only, wait until it is
    complete (``persist``: durable, a memory-only one persisted for it) and return it; the restore then
    reads exactly that step. ``step`` unchanged when the durable steps answer, or when the newest step
    failed meanwhile (the one before it answers)."""
    newest = rpc.call("promote", job=job, step=step, persist=persist)["step"]
    if newest is None:
        return step
    while True:
        rep = rpc.call("wait", rpc_timeout=rpc.timeout + FETCH_POLL_S + 5.0, job=job, step=newest, timeout=FETCH_POLL_S, persist=persist)
        if rep["state"] == "durable" or (rep["state"] == "memory" and not persist):
            return newest
        if rep["state"] in ("failed", "dropped"):
            if step is not None:
                raise CheckpointError(f"step {step} of job {job} cannot be restored: {rep['error']}")
            log.warning("the newest step %s of job %s failed (%s): restoring the one before it", newest, job, rep["error"])
            return None


def _settle(rpc: Channel, job: str, step: int | None, *, persist: bool) -> int | None:
    """:func:`settled`; a restore of the newest step (``step`` None) then still asks for the newest: a step
    completed meanwhile (a job that snapshots every step while another process reads it) may already have
    dropped the one settled on from memory."""
    got = settled(rpc, job, step, persist=persist)
    return None if step is None else got


@dataclass
class OpenStep:
    """A step opened for reading through the daemon (:func:`open_step`): close it when done."""

    reader: CheckpointReader
    info: dict[str, Any]  # what :attr:`Client.last_restore` says
    rpc: Channel
    held: dict[str, Any] | None = None  # hot_open's reply, while its segments are pinned
    fid: int | None = None  # the fetch holding the step on disk, until closed

    def close(self) -> None:
        self.reader.close()
        held, self.held = self.held, None
        if held is not None:
            self.rpc.call("hot_close", pin=held["pin"], segments=list(held["segments"].values()))
        fid, self.fid = self.fid, None
        if fid is not None:
            close_fetch(self.rpc, fid)


def _hot_reader(held: dict[str, Any]) -> CheckpointReader:
    files = {f: shm.path_of(seg) for f, seg in held["segments"].items()}
    return CheckpointReader(held["path"], manifest=held["manifest"], files=files, memory=held.get("tier") == "memory")


def open_step(rpc: Channel, job: str, step: int | None, *, hot: bool = True) -> OpenStep:
    """The newest complete step of ``job`` (or ``step``) opened for reading: from the daemon's shared memory
    while it holds the step (``hot``), else from its root, downloaded from the bucket first if need be."""
    step = _settle(rpc, job, step, persist=not hot)
    if hot:
        held = rpc.call("hot_open", job=job, step=step, pid=os.getpid())
        if held["step"] is None:
            step = _settle(rpc, job, step, persist=True)  # as in restore_from_daemon
        else:
            try:
                return OpenStep(_hot_reader(held), restored(held["step"], held["path"], Source.MEMORY), rpc, held)
            except FormatError as e:
                rpc.call("hot_close", pin=held["pin"], segments=list(held["segments"].values()))
                log.warning("hot read of step %s failed (%s): reading it from disk", held["step"], e)
                step = settled(rpc, job, held["step"], persist=True)
    rep = fetch(rpc, job, step)
    try:
        reader = CheckpointReader(rep["path"])
    except BaseException:
        close_fetch(rpc, rep["fetch"])
        raise
    return OpenStep(reader, restored(rep["step"], rep["path"], Source.from_wire(rep["source"])), rpc, fid=rep["fetch"])


def _restore_hot(
    rpc: Channel, held: dict[str, Any], model: torch.nn.Module, optim: torch.optim.Optimizer | None, rank: int, how: dict[str, Any]
) -> tuple[Restored, dict[str, Any]]:
    try:  # the reader is opened in there: a malformed manifest fails every rank of a collective restore alike
        extra = restore_state(held["path"], model, optim, rank, opener=lambda: _hot_reader(held), **how)
    finally:
        rpc.call("hot_close", pin=held["pin"], segments=list(held["segments"].values()))
    extra.source = Source.MEMORY.value
    return extra, restored(held["step"], held["path"], Source.MEMORY)


def restore_from_daemon(
    rpc: Channel,
    job: str,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None,
    rank: int,
    *,
    step: int | None,
    hot: bool,
    how: dict[str, Any],
) -> tuple[Restored, dict[str, Any]]:
    """Load the newest complete step of ``job`` (or ``step``) in place; returns ``(extra, last_restore)``.
    ``how``: :func:`.load.restore_state`'s ``strict``, ``dtype`` and ``rename``. The daemon's failures before the
    restore itself (it is gone, the step asked for failed) are shared as :func:`.load.restore_state` shares
    its own: every rank of a collective restore raises."""
    strict = how.get("strict", True)
    asked, step = step, shared(strict, _settle, rpc, job, step, persist=not hot)
    if hot:
        held = shared(strict, rpc.call, "hot_open", job=job, step=step, pid=os.getpid())
        if held["step"] is not None:
            try:
                return _restore_hot(rpc, held, model, optim, rank, how)
            except FormatError as e:  # a segment reused or not what the manifest says: the disk has the step
                if not getattr(e, "fall_back", True):  # another rank's file on disk is bad: every rank raises
                    raise
                log.warning("hot restore of step %s failed (%s): restoring from disk", held["step"], e)
                # the newest asked for: if the step cannot be made durable either (its segments are gone), the newest
                # step that can be restored is, with a warning (settled's)
                step = shared(strict, settled, rpc, job, held["step"] if asked is not None else None, persist=True)
        else:
            log.info("restoring from disk: %s", held["reason"])
            # the step settled on (or one the daemon holds in memory only) may not be on disk yet: it is made durable
            # first, so the restore reads exactly that step, never an older one the disk already has
            step = shared(strict, _settle, rpc, job, step, persist=True)
    rep = shared(strict, fetch, rpc, job, step)
    try:
        try:
            extra = restore_state(rep["path"], model, optim, rank, **how)
        except FormatError as e:
            if not getattr(e, "fall_back", False):
                raise
            # another rank's hot restore failed, and it reads the step from disk now: so does this one, again, with it
            log.warning("restore of step %s again from disk, with a rank whose hot restore failed (%s)", rep["step"], e)
            extra = restore_state(rep["path"], model, optim, rank, **how)
    finally:
        close_fetch(rpc, rep["fetch"])
    extra.source = Source.from_wire(rep["source"]).value
    return extra, restored(rep["step"], rep["path"], Source.from_wire(rep["source"]))
