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
* a hot read that met a bad segment (:class:`.agree.ReadAgain`) reads the step from disk instead; a disk read that
  raised it (another rank's hot read failed) reads it again, with that rank.

:func:`read_step` is that ladder, once: :func:`restore_from_daemon` loads what it reads into a model and optimizer,
:func:`open_step` opens a reader on it (DCP, Lightning, Hugging Face).

Runs on the calling (training) thread. Every rank asks the daemon on its own: no collectives, except that
a failure before the restore reads anything is shared with the other ranks of a collective restore
(:func:`.agree.fail_early`), so that none waits for a rank that gave up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from .. import shm
from ..errors import CheckpointError, FormatError
from ..protocol import Source
from .agree import ReadAgain, shared
from .load import Restored, restore_state
from .reader import CheckpointReader
from .rpc import Channel

log = logging.getLogger("ckptd.client")

T = TypeVar("T")
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
            if rep.get("passed_over"):  # the latest step could not be delivered whole: an earlier one is restored
                log.warning("restore of job %s: %s", job, rep["passed_over"])
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
        if rep["state"] == "durable" or (rep["state"] == "memory" and (not persist or rep.get("peers_only"))):
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
class Hold:
    """What keeps a step where a restore reads it until :meth:`release`: the daemon's segments pinned by
    ``hot_open`` (``held``, its reply), or the fetch that holds the step on disk (``fid``)."""

    rpc: Channel
    held: dict[str, Any] | None = None
    fid: int | None = None

    def release(self) -> None:
        """Let go of the step: ``hot_close`` its segments, or close its fetch (best effort). Once: a second call does nothing."""
        held, self.held = self.held, None
        if held is not None:
            self.rpc.call("hot_close", pin=held["pin"], segments=list(held["segments"].values()))
        fid, self.fid = self.fid, None
        if fid is not None:
            close_fetch(self.rpc, fid)


def _alone(call: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``call(*args, **kw)``: a read of this process alone shares nothing with other ranks."""
    return call(*args, **kw)


def _kept(hold: Hold, read: Callable[[], T]) -> T:
    """``read()``, the step let go of if it raises (the caller releases ``hold`` once done with what it returns)."""
    try:
        return read()
    except BaseException:
        hold.release()
        raise


def _from_disk(read: Callable[[str], T], rep: dict[str, Any]) -> T:
    """``read`` of the step directory ``fetch`` answered, twice where the first read raised :class:`.agree.ReadAgain`."""
    try:
        return read(rep["path"])
    except ReadAgain as e:  # another rank's hot read failed, and it reads the step from disk now: so does this one, again, with it
        log.warning("restore of step %s again from disk, with a rank whose hot restore failed (%s)", rep["step"], e)
        return read(rep["path"])


def read_step(
    rpc: Channel,
    job: str,
    step: int | None,
    *,
    hot: bool,
    memory: Callable[[dict[str, Any]], T],
    disk: Callable[[str], T],
    share: Callable[..., Any] = _alone,
) -> tuple[T, dict[str, Any], Hold]:
    """Read the newest complete step of ``job`` (or ``step``) through the daemon: the one restore ladder.

    1. ``hot``, and the daemon holds the step in shared memory (``hot_open``): ``memory`` reads it there.
    2. Else, or where that raised :class:`.agree.ReadAgain` (a bad segment, on this rank or on another of a
       collective restore): the step is made durable, fetched (from the bucket if need be), and ``disk`` reads it.
    3. Where that raised :class:`.agree.ReadAgain` (another rank's hot read failed, and it reads the disk now):
       ``disk`` reads it again, with that rank, so that their collectives stay paired.

    Runs on the calling thread. A read that raises has the step released first.

    Args:
        rpc: The channel to the daemon.
        job: The job whose step is read.
        step: The step asked for; ``None``: the newest.
        hot: Whether the daemon's shared memory may be read.
        memory: Reads the step from ``hot_open``'s reply (its pinned segments).
        disk: Reads the step from its directory.
        share: Calls the daemon: :func:`.agree.shared`'s wrapper in a restore whose ranks all raise when one fails.

    Returns:
        What ``memory`` or ``disk`` returned, what :attr:`Client.last_restore` says, and the :class:`Hold` that keeps
        the step until the caller releases it.
    """
    asked, step = step, share(_settle, rpc, job, step, persist=not hot)
    if hot:
        held = share(rpc.call, "hot_open", job=job, step=step, pid=os.getpid())
        if held["step"] is not None:
            hold = Hold(rpc, held=held)
            try:  # a segment reused or not what the manifest says: the disk has the step
                return _kept(hold, lambda: memory(held)), restored(held["step"], held["path"], Source.MEMORY), hold
            except ReadAgain as e:
                log.warning("hot restore of step %s failed (%s): restoring from disk", held["step"], e)
                # the newest asked for: if the step cannot be made durable either (its segments are gone), the newest
                # step that can be restored is, with a warning (settled's)
                step = share(settled, rpc, job, held["step"] if asked is not None else None, persist=True)
        else:
            log.info("restoring from disk: %s", held["reason"])
            # the step settled on (or one the daemon holds in memory only) may not be on disk yet: it is made durable
            # first, so the restore reads exactly that step, never an older one the disk already has
            step = share(_settle, rpc, job, step, persist=True)
    rep = share(fetch, rpc, job, step)
    hold = Hold(rpc, fid=rep["fetch"])
    got = _kept(hold, lambda: _from_disk(disk, rep))
    return got, restored(rep["step"], rep["path"], Source.from_wire(rep["source"])), hold


@dataclass
class OpenStep:
    """A step opened for reading through the daemon (:func:`open_step`): close it when done."""

    reader: CheckpointReader
    info: dict[str, Any]  # what :attr:`Client.last_restore` says
    hold: Hold  # the step's segments pinned, or its fetch, until closed

    def close(self) -> None:
        """Close the reader and let go of the step."""
        self.reader.close()
        self.hold.release()


def _hot_reader(held: dict[str, Any]) -> CheckpointReader:
    files = {f: shm.path_of(seg) for f, seg in held["segments"].items()}
    return CheckpointReader(held["path"], manifest=held["manifest"], files=files, memory=held.get("tier") == "memory")


def _open_hot(held: dict[str, Any]) -> CheckpointReader:
    """:func:`_hot_reader`; a bad segment is this process's alone (no other rank to agree with): it reads the disk."""
    try:
        return _hot_reader(held)
    except FormatError as e:
        raise ReadAgain(str(e)) from e


def open_step(rpc: Channel, job: str, step: int | None, *, hot: bool = True) -> OpenStep:
    """The newest complete step of ``job`` (or ``step``) opened for reading (:func:`read_step`): from the daemon's
    shared memory while it holds the step (``hot``), else from its root, downloaded from the bucket first if need be."""
    reader, info, hold = read_step(rpc, job, step, hot=hot, memory=_open_hot, disk=CheckpointReader)
    return OpenStep(reader, info, hold)


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
    """Load the newest complete step of ``job`` (or ``step``) in place (:func:`read_step`); returns ``(extra, last_restore)``.
    ``how``: :func:`.load.restore_state`'s ``strict``, ``dtype`` and ``rename``. The daemon's failures before the
    restore itself (it is gone, the step asked for failed) are shared as :func:`.load.restore_state` shares
    its own: every rank of a collective restore raises."""

    def memory(held: dict[str, Any]) -> Restored:  # the reader is opened in there: a malformed manifest fails every rank alike
        return restore_state(held["path"], model, optim, rank, opener=lambda: _hot_reader(held), **how)

    def disk(path: str) -> Restored:
        return restore_state(path, model, optim, rank, **how)

    extra, info, hold = read_step(rpc, job, step, hot=hot, memory=memory, disk=disk, share=partial(shared, how.get("strict", True)))
    hold.release()
    extra.source = info["source"]
    return extra, info
