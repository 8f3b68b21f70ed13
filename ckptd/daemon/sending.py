"""A thread that sends, per job, the newest step queued (:mod:`.replicator`, :mod:`.mesh`).

A step not yet taken when a later one of its job is queued is skipped (superseded): a job that snapshots faster than
the link sends the newest step it can, never a backlog. What became of each step is reported (:class:`.events.Replicated`,
posted to the daemon's loop); a bug on one step ends that step's sending, not the thread.
"""

from __future__ import annotations

import abc
import collections
import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from ..errors import CheckpointError
from .events import Replicated

log = logging.getLogger("ckptd.daemon")


class Superseded(CheckpointError):
    """A memory-only step's slots were reused while it was sent: the copy is abandoned."""


class _Step(Protocol):
    @property
    def job(self) -> str: ...

    @property
    def step(self) -> int: ...


S = TypeVar("S", bound=_Step)


class NewestPerJob(abc.ABC, Generic[S]):
    """The queue and the thread; a subclass sends (:meth:`_send`). The queue, :attr:`results` and :attr:`counters` are
    under :attr:`_lock`."""

    def __init__(self, name: str, report: Callable[[Replicated], None], initializer: Callable[[], None]) -> None:
        self._report, self._init = report, initializer
        self._lock = threading.Condition()
        self._queue: collections.OrderedDict[str, S] = collections.OrderedDict()  # job -> its newest step to send
        self.current: tuple[str, int] | None = None
        self.results: dict[str, dict[str, Any]] = {}  # job -> its newest step's outcome
        self.counters = collections.Counter[str]()
        self._running = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _enqueue(self, item: S) -> None:
        """Queue ``item`` in its job's place (lock held): the one it replaces is superseded."""
        old = self._queue.pop(item.job, None)
        if old is not None:
            self.counters["superseded"] += 1
            self._report(Replicated(old.job, old.step, "superseded"))
        self._queue[item.job] = item
        self._lock.notify()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop after the step being sent (waiting ``timeout`` s at most); queued steps are not sent."""
        with self._lock:
            self._running = False
            self._queue.clear()
            self._lock.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("sending %s to peers was still under way at shutdown; abandoned", self.current)

    def _run(self) -> None:
        self._init()
        try:
            while True:
                with self._lock:
                    while self._running and not self._queue:
                        self._lock.wait()
                    if not self._running:
                        return
                    _, item = self._queue.popitem(last=False)
                    self._taken(item)
                    self.current = (item.job, item.step)
                try:
                    self._send(item)
                except Superseded as e:  # its slots were reused before it could be read
                    log.info("sending job %s step %s abandoned: %s", item.job, item.step, e)
                    self.counters["superseded"] += 1
                    self._report(Replicated(item.job, item.step, "superseded"))
                except Exception as e:  # a bug must not end sending for every later step
                    log.exception("sending job %s step %s failed", item.job, item.step)
                    self._report(Replicated(item.job, item.step, "not_replicated", reason=f"{type(e).__name__}: {e}"))
                finally:
                    self.current = None
        finally:
            self._closing()

    def _taken(self, item: S) -> None:
        """``item`` leaves the queue to be sent (lock held)."""

    @abc.abstractmethod
    def _send(self, item: S) -> None:
        """Send ``item`` and report what became of it (the thread)."""

    def _closing(self) -> None:
        """The thread ends: let the links go."""

    def _done(self, item: S, state: str, took: list[str], seconds: float) -> None:
        """``item`` was sent to ``took``: ``state`` ``replicated`` or ``degraded``, reported and kept for ``status``."""
        self.counters[f"steps_{state}"] += 1
        self._report(Replicated(item.job, item.step, state, tuple(took)))
        with self._lock:
            self.results[item.job] = {"step": item.step, "state": state, "peers": took, "seconds": round(seconds, 3)}
        (log.info if state == "replicated" else log.warning)("job %s step %s %s to %s", item.job, item.step, state, took or "no peer")
