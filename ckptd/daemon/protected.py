"""Steps a job protects from retention by name: the checkpoint a framework keeps a file for.

Lightning's ``ModelCheckpoint`` keeps its top-k files (``epoch=3-step=400.ckpt``, ``best_model_path``)
as pointers to ckptd steps (:mod:`ckptd.integrations.lightning`); the daemon's retention, which keeps the
newest ``keep`` steps, must never remove a step such a file still names. So a client names it:
``protect`` ``{job, step, name}`` keeps ``step`` of ``job`` on local disk and in the bucket, whatever its
age, until ``unprotect`` ``{job, name}`` lets it go (a retention pass then runs). One
name protects one step: protecting a name again moves it (``last.ckpt`` follows the newest save). A
step a name protects that is held in the memory tier only is persisted.

Durable in ``<root>/<job>/protected.json`` (``{"names": {name: step}}``), written by the daemon only,
atomically; read at start-up. A file that cannot be read (corrupt, a planted link) protects every
step of its job (retention removes nothing) and the job's ``protect`` / ``unprotect`` are refused,
naming the file, until an operator mends or removes it: a lost protection is never guessed at.

Threads: the ops arrive on the loop; the file is written on a thread of its own (an fsync behind a
busy disk must not stall the loop), and the reply follows once it is durable (an :class:`Answered`
event). :meth:`Protections.policy`: any thread.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..config import MAX_PROTECTED_NAME, MAX_STEP
from ..errors import CheckpointError
from ..storage.files import fsync_dir, write_json_durable
from ..storage.retention import KeepLatest, Protect, RetentionPolicy
from .events import Answered, EventQueue

log = logging.getLogger("ckptd.daemon")

FILE = "protected.json"
MAX_NAMES = 10_000  # per job
MAX_QUEUED = 256  # requests being recorded at once (each rewrites its job's file)
MAX_FILE_BYTES = MAX_NAMES * (MAX_PROTECTED_NAME + 64)

_NONE = Protect(frozenset())
_ALL = KeepLatest(0)  # every step: what an unreadable file protects


class Protections:
    def __init__(
        self, root: str, events: EventQueue, *, retain: Callable[[str], None], initializer: Callable[[], None] | None = None
    ) -> None:
        """``retain(job)``: a local retention pass, run once a step is let go."""
        self.root, self._events, self._retain = root, events, retain
        self._names: dict[str, dict[str, int]] = {}  # job -> name -> step; replaced whole under the lock
        self._policy: dict[str, RetentionPolicy] = {}  # job -> what retention keeps for it (read by any thread)
        self._broken: dict[str, str] = {}  # job -> why its file could not be read
        self._coming: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)  # protects being written
        self._queued = 0  # requests submitted, not answered yet
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-protect", initializer=initializer)

    def load(self, jobs: Iterable[str]) -> None:
        """At start-up, before the loop: read each job's file."""
        for job in jobs:
            try:
                names = read(self.path(job))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                self._broken[job] = f"{self.path(job)} cannot be read ({e}): every step of job {job} is kept until it is mended or removed"
                self._policy[job] = _ALL
                log.error("%s", self._broken[job])
                continue
            self._set(job, names)

    def path(self, job: str) -> str:
        return os.path.join(self.root, job, FILE)

    def policy(self, job: str) -> RetentionPolicy:
        """The steps of ``job`` retention must keep for their names (any thread)."""
        return self._policy.get(job, _NONE)

    def names(self, job: str) -> dict[str, int]:
        """``job``'s names and the step each protects (``ckptd status``)."""
        return dict(self._names.get(job, {}))

    def submit(self, ident: bytes, req_id: Any, job: str, name: str, step: int | None, known: Callable[[int], bool]) -> None:
        """Main thread: protect ``step`` under ``name`` (``None``: unprotect ``name``); answered once durable.
        Retention keeps the step from now on; ``known(step)``: it is being saved or is complete on disk."""
        if job in self._broken:
            raise CheckpointError(self._broken[job])
        if self._queued >= MAX_QUEUED:
            raise CheckpointError(f"{MAX_QUEUED} protect/unprotect requests are being recorded already: try again")
        self._arrived(job, step, +1)  # first: retention cannot remove the step between the check and the write
        if step is not None and not known(step):
            self._arrived(job, step, -1)
            raise CheckpointError(
                f"step {step} of job {job} is neither being saved nor complete on this node's disk"
                " (never saved, or removed by retention already): nothing to protect"
            )
        self._pool.submit(self._write, ident, req_id, job, name, step)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _write(self, ident: bytes, req_id: Any, job: str, name: str, step: int | None) -> None:
        try:
            with self._lock:
                names = dict(self._names.get(job, {}))
                before = names.pop(name, None)
                if step is not None:
                    if len(names) >= MAX_NAMES:
                        raise CheckpointError(f"job {job} protects {MAX_NAMES} names already: unprotect some first")
                    names[name] = step
                if step is not None or before is not None:
                    if not os.path.isdir(d := os.path.join(self.root, job)):
                        os.makedirs(d, exist_ok=True)
                        fsync_dir(self.root)
                    write_json_durable(self.path(job), {"names": names})
                    self._set(job, names)
            answer = {"protected": step, "before": before}
        except (OSError, CheckpointError) as e:
            what = f"protect step {step} as" if step is not None else "unprotect"
            answer = {"error": f"could not {what} {name!r} of job {job}: {e}"}
        self._arrived(job, step, -1)
        self._events.post(Answered(ident, req_id, answer))
        if answer.get("before") is not None and answer["before"] not in self._names.get(job, {}).values():
            try:  # let go: removed now if no other rule keeps it, not at the job's next step
                self._retain(job)
            except Exception as e:
                log.error("retention of job %s after step %s was let go failed: %s", job, answer["before"], e)

    def _arrived(self, job: str, step: int | None, n: int) -> None:
        """A request came in (``n`` 1) or was answered (-1): its step is kept meanwhile."""
        with self._lock:
            self._queued += n
            if step is not None:
                self._coming[job][step] += n
                self._set(job, self._names.get(job, {}))

    def _set(self, job: str, names: dict[str, int]) -> None:
        """Under the lock, or before the loop runs."""
        self._names[job] = names
        steps = set(names.values()) | {s for s, n in self._coming.get(job, {}).items() if n > 0}
        self._policy[job] = Protect(frozenset(steps)) if steps else _NONE


def read(path: str) -> dict[str, int]:
    """The names of a protected-steps file, checked; ``ValueError`` for anything else."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:  # never through a link
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON: {e}") from None
    names = doc.get("names") if isinstance(doc, dict) else None
    if not isinstance(names, dict) or len(names) > MAX_NAMES:
        raise ValueError(f"not a map of at most {MAX_NAMES} names to steps")
    for name, step in names.items():
        if not valid_name(name) or isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"bad entry {name[:80]!r}: {step!r}")
    return names


def valid_name(name: object) -> bool:
    return isinstance(name, str) and 0 < len(name) <= MAX_PROTECTED_NAME and "\0" not in name
