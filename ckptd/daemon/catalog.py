"""The step catalog: the daemon's one answer to "which complete steps does a job have, and which
one does a restore read" — under the local root, in the bucket, and in shared memory.

* :meth:`StepCatalog.latest` — the newest complete local step (``latest`` when it names a complete
  step, else the highest complete one): the ``latest`` op, ``status``, a fetch without a bucket.
* :meth:`StepCatalog.find` — the step a restore reads: the one asked for, or the newest complete
  step under the root or in the bucket (blocks on the network: the fetch thread only).
* :meth:`StepCatalog.in_memory` — the newest step this daemon completed since it started, with its
  manifest: the only step a hot restore reads from shared memory.
* :meth:`StepCatalog.note_uploaded` / :meth:`uploaded` — the newest step complete in the bucket
  (this run), for ``status``.

``in_memory`` and ``uploaded`` are written and read by the main thread only; the rest reads storage
and may run on any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..layout import complete_steps, is_complete, list_jobs, step_dir
from ..protocol import Source
from ..storage.local import latest_step
from ..storage.remote import remote_steps
from ..storage.store import ObjectStore


class NoStep(CheckpointError):
    """The asked-for step exists neither under the root nor in the bucket."""


@dataclass(frozen=True)
class Found:
    """The step a restore reads and where it is (a local path when on disk)."""

    step: int
    source: Source  # DISK or BUCKET
    path: str | None


@dataclass(frozen=True)
class InMemory:
    step: int
    path: str
    manifest: dict[str, Any] | None


class StepCatalog:
    def __init__(self, root: str, store: ObjectStore | None = None) -> None:
        self.root, self.store = root, store
        self._in_memory: dict[str, InMemory] = {}
        self._uploaded: dict[str, int] = {}

    def jobs(self) -> list[str]:
        return list_jobs(self.root)

    def latest(self, job: str) -> tuple[int | None, str | None]:
        """The newest complete local step of ``job`` and its directory, or ``(None, None)``."""
        return latest_step(self.root, job)

    def complete_path(self, job: str, step: int) -> str | None:
        """The directory of step ``step`` if it is complete under the root."""
        path = step_dir(self.root, job, step)
        return path if is_complete(path) else None

    def local_steps(self, job: str) -> list[int]:
        return complete_steps(self.root, job)

    def bucket_steps(self, job: str) -> list[int]:
        """Complete steps of ``job`` in the bucket (network: worker threads only); none without one."""
        return remote_steps(self.store, job)[0] if self.store is not None else []

    def where(self) -> str:
        """Where this catalog looks, for messages."""
        return f"under {self.root}" + (f" or in {self.store.url()}" if self.store is not None else "")

    def find(self, job: str, step: int | None = None) -> Found:
        """Step ``step`` of ``job`` (or the newest complete one), preferring the local copy; raises
        :class:`NoStep` when neither the root nor the bucket has it. Blocks on the network."""
        if step is None:
            local, path = self.latest(job)
        else:
            path = self.complete_path(job, step)
            if path is not None:
                return Found(step, Source.DISK, path)  # on disk: the bucket (reachable or not) is not asked
            local = None
        remote = self.bucket_steps(job)
        if step is None:
            want = max([s for s in (local, remote[-1] if remote else None) if s is not None], default=None)
            if want is None:
                raise NoStep(f"job {job!r} has no committed checkpoint {self.where()}")
        else:
            want = step
            if local is None and step not in remote:
                raise NoStep(f"step {step} of job {job!r} is not a committed checkpoint {self.where()}")
        if want == local:
            return Found(want, Source.DISK, path)
        return Found(want, Source.BUCKET, None)

    # ------------------------------------------------------------------ what this run completed (main thread)

    def note_complete(self, job: str, step: int, path: str, manifest: dict[str, Any] | None) -> None:
        """Step ``step`` completed here; it is the one hot restores read unless a newer one completed
        first (persist threads may finish an older step after a newer one, as ``latest`` allows)."""
        cur = self._in_memory.get(job)
        if cur is None or step >= cur.step:
            self._in_memory[job] = InMemory(step, path, manifest)

    def in_memory(self, job: str) -> InMemory | None:
        return self._in_memory.get(job)

    def in_memory_steps(self) -> dict[str, int]:
        return {job: m.step for job, m in self._in_memory.items()}

    def note_uploaded(self, job: str, step: int) -> None:
        self._uploaded[job] = max(step, self._uploaded.get(job, -1))

    def uploaded(self) -> dict[str, int]:
        return dict(self._uploaded)
