"""The handle ``Client.snapshot()`` returns: wait for the copy, or for the step to be durable.

Any thread. ``wait()`` asks the daemon (``wait``), which persists a step the tiering policy kept in
memory only (a wait asks for durability); a step the policy already dropped raises :class:`StepDropped`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, HeldInMemory, StepDropped, StepUnknown

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Pending", "SnapshotHandle", "StepDropped"]

log = logging.getLogger("ckptd.client")


class SnapshotHandle:
    """One snapshot in flight, as :func:`ckptd.snapshot` returns it; any thread may wait on it.

    A failure of a snapshot committed before it returned (``blocking=True``, or a CPU-only state under ``overlap="auto"``)
    is raised by ``snapshot()`` itself. A failure of a background copy is raised once by the client as a whole: by
    whichever of the next ``snapshot()``, ``Client.wait()`` or ``close()`` sees it first (``close`` warns); this
    handle's own :meth:`wait` always raises it.

    Args:
        client: The :class:`Client` that took the snapshot (a handle is made by it, not by users).
        step: The step this snapshot saves.

    Attributes:
        step: The step this snapshot saves.
        job: The job it belongs to."""

    def __init__(self, client: Client, step: int) -> None:
        self.client = client
        self.step = step
        self.job = client.job
        self._copied = threading.Event()
        self._error: BaseException | None = None
        self._failed: str | None = None  # the daemon's reason, once it said the step failed
        self._reported = False
        self._path: str | None = None

    def copied(self) -> bool:
        """Whether the copy into the daemon's shared memory has ended, without blocking.

        Returns:
            ``True`` once every byte is in the daemon's shared memory and committed, or the copy failed."""
        return self._copied.is_set()

    def _unreported(self) -> BaseException | None:
        """The copy's error if no one raised it yet (then it counts as raised)."""
        if self._error is None or self._reported:
            return None
        self._reported = True
        return self._error

    def wait_copied(self, timeout: float | None = None) -> None:
        """Block until every byte is in the daemon's shared memory and the commit is recorded there (not yet durable).

        Args:
            timeout: Seconds to wait, or ``None`` for no limit.

        Raises:
            CheckpointError: The copy or the commit failed, naming the cause.
            TimeoutError: The copy had not ended after ``timeout`` seconds."""
        if not self._copied.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} still copying after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise CheckpointError(f"snapshot of step {self.step} failed: {self._error}") from self._error

    def wait(self, timeout: float | None = None) -> str:
        """Block until the step is committed (its manifest written) and durable; return its directory.

        The daemon persists a step its memory tier kept in memory only (a wait asks for durability). A wait in progress
        when the daemon restarts asks the new one.

        Args:
            timeout: Seconds to wait in all, or ``None`` for no limit.

        Returns:
            The step's directory (retention may remove it later).

        Raises:
            StepDropped: The memory tier dropped the step before anyone asked for it durable, as the job's policy allows.
            HeldInMemory: The step spans nodes, no bucket or shared directory is configured: it stays in the memory of the
                job's daemons and their replicas (:mod:`ckptd.daemon.mesh`).
            StepUnknown: A daemon restarted since the commit has no record of the step, and it is not on disk.
            CheckpointError: The copy or the daemon failed, naming the cause.
            TimeoutError: The step was not durable after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_copied(timeout)
        if self._path is not None:
            return self._path
        while self._failed is None:
            left = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
            rep = self.client._rpc.call("wait", rpc_timeout=left + 10.0, job=self.job, step=self.step, timeout=left)
            if rep["state"] == "durable":
                self._path = rep["path"]
                return rep["path"]
            if rep["state"] == "dropped":
                self._reported = True
                raise StepDropped(f"step {self.step} of job {self.job} is not durable: {rep['error']}")
            if rep["state"] == "memory" and rep.get("peers_only"):
                self._reported = True
                raise HeldInMemory(
                    f"step {self.step} of job {self.job} spans nodes and is complete in the memory of the job's daemons and"
                    " their replicas, and is not persisted: a job that spans nodes persists only the steps whose number is a"
                    " multiple of persist_every, through a bucket or shared directory, if one is configured"
                    " (wait_replicated() says where its copies are)"
                )
            if rep["state"] == "failed" and rep.get("unknown"):  # the daemon restarted since: Client.wait() judges it
                self._reported = True
                raise StepUnknown(f"step {self.step} of job {self.job}: {rep['error']} (the daemon restarted since it was committed)")
            if rep["state"] == "failed" and rep.get("in_memory"):  # persisting failed, the daemon still holds it
                raise CheckpointError(f"step {self.step} of job {self.job} failed: {rep['error']}")  # a later wait tries again
            if rep["state"] == "failed":
                self._failed = rep["error"]
            elif deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"step {self.step} of job {self.job} not durable after {timeout} s")
        self._reported = True
        raise CheckpointError(f"step {self.step} of job {self.job} failed: {self._failed}")

    def wait_replicated(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the daemon has copied the step to its peers (``ckptd serve --replicas K``), or judged it.

        Independent of :meth:`wait`: a memory-only step is replicated without being persisted.

        Args:
            timeout: Seconds to wait in all, or ``None`` for no limit.

        Returns:
            A dict of ``state``, ``peers`` and ``reason``. ``state`` is ``"replicated"`` (K peers verified the step and
            hold it, named in ``peers``), ``"degraded"`` (fewer did: a peer down, full or refusing; ``peers`` those that hold it),
            ``"superseded"`` (a later step of the job completed before this one was sent, and went instead) or
            ``"not_replicated"`` (``reason`` says why: a step that spans nodes).

        Raises:
            CheckpointError: The copy failed, or the daemon replicates nothing.
            TimeoutError: No outcome after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_copied(timeout)
        while True:
            left = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
            rep = self.client._rpc.call("replicated", rpc_timeout=left + 10.0, job=self.job, step=self.step, timeout=left)
            if rep["state"] != "pending":
                return {"state": rep["state"], "peers": rep["peers"], "reason": rep.get("reason")}
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"step {self.step} of job {self.job} not replicated after {timeout} s")

    def __repr__(self) -> str:
        return f"SnapshotHandle(job={self.job!r}, step={self.step}, copied={self.copied()})"


class Pending:
    """The snapshots a client took that ``Client.wait()`` still answers for: the newest :data:`KEPT` (a client
    that never waits must not grow without bound; the daemon remembers more finished steps per job than
    this, so every kept handle can still be answered). Any thread."""

    KEPT = 64

    def __init__(self, job: str) -> None:
        self.job = job
        self._handles: list[SnapshotHandle] = []
        self._lock = threading.Lock()

    def track(self, handle: SnapshotHandle) -> None:
        with self._lock:
            self._handles.append(handle)
            del self._handles[: -self.KEPT]

    def _untrack(self, handle: SnapshotHandle) -> None:
        with self._lock:
            self._handles = [h for h in self._handles if h is not handle]

    def wait(self, timeout: float | None = None) -> list[str]:
        """``Client.wait()``: each handle in turn; a dropped step is skipped, and a step the restarted daemon no
        longer knows is fine once a later one is durable."""
        deadline = None if timeout is None else time.monotonic() + timeout
        paths: list[str] = []
        unknown: list[StepUnknown] = []  # steps the restarted daemon no longer knows: fine if a later one is durable
        while True:
            with self._lock:
                if not self._handles:
                    break
                h = self._handles[0]
            if h._reported:  # its failure was raised already (by the next snapshot, or its own wait)
                self._untrack(h)
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                paths.append(h.wait(left))
                for e in unknown:  # older than a durable step: removed by retention or dropped by the memory tier
                    log.warning("%s; step %s, snapshot after it, is durable", e, h.step)
                unknown.clear()
            except StepDropped:  # kept in memory only and dropped, as the job's tiering policy allows: not an error here
                log.debug("step %s of job %s was dropped from memory, not persisted", h.step, self.job)
            except HeldInMemory as e:  # as durable as this job's daemons make it
                log.info("%s", e)
            except StepUnknown as e:
                unknown.append(e)
            except CheckpointError:
                if h._failed is not None or h._reported:  # a failed step is reported once; a timeout, or a step
                    self._untrack(h)  # the daemon still holds after persisting it failed, stays pending
                raise
            self._untrack(h)
        if unknown:  # no snapshot after it is durable: it may be lost
            raise unknown[0]
        return paths
