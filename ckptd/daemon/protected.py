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
from ..files import fsync_dir, write_durable
from ..layout import is_complete, step_dir
from ..storage.local import job_lock
from ..storage.retention import KeepLatest, Protect, RetentionPolicy
from .events import Answered, EventQueue

log = logging.getLogger("ckptd.daemon")

FILE = "protected.json"
MAX_NAMES = 10_000  # per job
MAX_QUEUED = 256  # requests being recorded at once (each rewrites its job's file)
MAX_FILE_BYTES = 64 << 20  # a job's file: a protect that would make it larger is refused (it must read back at start-up)

_NONE = Protect(frozenset())
_ALL = KeepLatest(0)  # every step: what an unreadable file protects


class Protections:
    def __init__(
        self,
        root: str,
        events: EventQueue,
        *,
        retain: Callable[[str], None],
        initializer: Callable[[], None] | None = None,
        upload: Callable[[str, int], None] | None = None,
    ) -> None:
        """``retain(job)``: a local retention pass, run once a step is let go. ``upload(job, step)``: have a
        complete local step the bucket may lack uploaded (the daemon's uploader, with a bucket)."""
        self.root, self._events, self._retain = root, events, retain
        self.upload = upload
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

    def submit(self, ident: bytes, req_id: Any, job: str, name: str, step: int | None, live: bool = False) -> None:
        """Main thread: protect ``step`` under ``name`` (``None``: unprotect ``name``); answered once durable.
        Retention keeps the step from now on. ``live``: the step is being saved or held in memory (else it must
        be complete on disk, which the writer thread checks under the job's lock)."""
        if job in self._broken:
            raise CheckpointError(self._broken[job])
        if self._queued >= MAX_QUEUED:
            raise CheckpointError(f"{MAX_QUEUED} protect/unprotect requests are being recorded already: try again")
        self._arrived(job, step, +1)  # first: a retention pass that starts from now on keeps the step
        self._pool.submit(self._write, ident, req_id, job, name, step, live)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _write(self, ident: bytes, req_id: Any, job: str, name: str, step: int | None, live: bool) -> None:
        """The writer thread (one: the only one that changes ``_names``)."""
        on_disk = False
        try:
            if step is not None and not live:
                with job_lock(self.root, job):  # a retention pass under way ends first; those after it keep the step
                    on_disk = is_complete(step_dir(self.root, job, step))
                if not on_disk:
                    raise CheckpointError(
                        f"step {step} of job {job} is neither being saved nor complete on this node's disk"
                        " (never saved, or removed by retention already): nothing to protect"
                    )
            names = dict(self._names.get(job, {}))
            before = names.pop(name, None)
            if step is not None:
                if len(names) >= MAX_NAMES:
                    raise CheckpointError(f"job {job} protects {MAX_NAMES} names already: unprotect some first")
                names[name] = step
            if step is not None or before is not None:
                self._record(job, names)
            answer = {"protected": step, "before": before}
        except (OSError, CheckpointError) as e:
            what = f"protect step {step} as" if step is not None else "unprotect"
            answer = {"error": f"could not {what} {name!r} of job {job}: {e}"}
        self._arrived(job, step, -1)
        self._events.post(Answered(ident, req_id, answer))
        self._after(job, answer, on_disk)

    def _record(self, job: str, names: dict[str, int]) -> None:
        """Write ``job``'s file (no lock held: the loop may take it meanwhile), then take ``names`` as its names."""
        data = json.dumps({"names": names}, separators=(",", ":")).encode()
        if len(data) > MAX_FILE_BYTES:
            raise CheckpointError(f"the job's protected names would take {len(data)} bytes, over {MAX_FILE_BYTES}: unprotect some first")
        if not os.path.isdir(d := os.path.join(self.root, job)):
            os.makedirs(d, exist_ok=True)
            fsync_dir(self.root)
        write_durable(self.path(job), data)
        with self._lock:
            self._set(job, names)

    def _after(self, job: str, answer: dict[str, Any], on_disk: bool) -> None:
        """A step let go goes to retention now, not at the job's next step; one protected on disk to the bucket too."""
        try:
            if answer.get("before") is not None and answer["before"] not in self._names.get(job, {}).values():
                self._retain(job)
            if on_disk and answer.get("protected") is not None and self.upload is not None:
                self.upload(job, answer["protected"])  # skipped if the bucket has it (a newer step may have passed it by)
        except Exception as e:
            log.error("after protecting a step of job %s: %s", job, e)

    def _arrived(self, job: str, step: int | None, n: int) -> None:
        """A request came in (``n`` 1) or was answered (-1): its step is kept meanwhile."""
        with self._lock:
            self._queued += n
            if step is not None:
                coming = self._coming[job]
                coming[step] += n
                if coming[step] <= 0:
                    del coming[step]
                    if not coming:
                        del self._coming[job]
                self._set(job, self._names.get(job, {}))

    def _set(self, job: str, names: dict[str, int]) -> None:
        """Under the lock, or before the loop runs."""
        self._names[job] = names
        steps = set(names.values()) | set(self._coming.get(job, ()))
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
