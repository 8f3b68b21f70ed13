"""Exceptions raised by ckptd. Every failure to take, make durable or restore a checkpoint that a user can see is a
:class:`CheckpointError`; an argument of the wrong kind is a ``ValueError`` or ``TypeError``, and a ``wait(timeout=...)``
that runs out a ``TimeoutError``."""

from __future__ import annotations

import errno


class CheckpointError(RuntimeError):
    """A checkpoint could not be taken, made durable or restored."""


class ProtocolError(CheckpointError):
    """A message to or from the daemon is malformed or refused."""


class DaemonBusy(ProtocolError):
    """The daemon is still busy with an earlier attempt at the same step (one of its shards is being written, queued
    or sealed) and refused a new attempt for now. The client asks again for a while (``BUSY_RETRY_S``); a user sees
    this only when the earlier attempt outlasts that."""


class FormatError(CheckpointError):
    """A shard file or manifest on disk is malformed, of an unknown version, or corrupt."""


class DaemonUnavailable(CheckpointError):
    """No daemon answered at the configured endpoint in time."""


class UnsupportedState(CheckpointError, TypeError):
    """The state holds a value ckptd cannot store (its path is named); also a ``TypeError``."""


class StepDropped(CheckpointError):
    """A snapshot held in the daemon's memory tier only was dropped before anyone asked for it durable (a
    later step was complete, or shared memory was full), as the job's tiering policy allows."""


class HeldInMemory(CheckpointError):
    """A step of a job that spans nodes is complete in the memory of the job's daemons and their replicas, and that is
    all it will be: without a bucket or a shared directory there is nowhere every node can read it from on disk."""


class StepUnknown(CheckpointError):
    """The daemon has no record of a snapshot's step and the step is not on disk: the daemon restarted since
    the step was committed, and retention removed it, the memory tier dropped it, or it was lost."""


class DiskFull(CheckpointError):
    """A write did not fit (``ENOSPC``, ``EDQUOT``): the disk, or the user's quota on it, is full. Raised inside the
    daemon, which makes room and tries again; a trainer sees a step that still failed as a :class:`CheckpointError`
    naming the error."""


def write_failed(what: str, e: OSError) -> CheckpointError:
    """The error for a failed write of ``what``: :class:`DiskFull` where the disk or the quota is full."""
    return (DiskFull if e.errno in (errno.ENOSPC, errno.EDQUOT) else CheckpointError)(f"writing {what} failed: {e.strerror or e}")
