"""The object-storage tier: what the daemon stores in the bucket, how a multi-node step is committed
there, how a step comes back, and which steps the bucket keeps.

Bucket layout, under the store's prefix (see :mod:`ckptd.objstore`)::

    <job>/step-<N>/rank-RRRRR.safetensors   a rank's shard: the very bytes of the local file
    <job>/step-<N>/rank-RRRRR.json          that rank's fragment (chunk table, checksums, tree)
    <job>/step-<N>/manifest.json            written last: a step is complete in the bucket iff it exists

Single node: once a step is durable on local disk, its files are uploaded data first, fragments next,
manifest last, so a reader never sees a manifest whose data is missing. Multi-node (ranks spread over
several daemons, each with its own root): each daemon uploads the shards and fragments of its own
ranks once they are durable locally; whichever daemon then finds every rank's fragment in the bucket
merges them into the manifest (the same checks as a local commit: coverage, replicas) and writes it.
Both may do so at once: they write the same manifest. The trainers' process groups play no part.

Everything here blocks on the network: the daemon calls it from its upload and fetch threads only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import persist
from .errors import CheckpointError, FormatError
from .format import MANIFEST, fsync_dir, validate_manifest
from .verify import verify_checkpoint

log = logging.getLogger("ckptd.tier")

_STEP_KEY = re.compile(r"^step-(\d+)/(.+)$")
_FRAG = re.compile(r"^rank-(\d{5})\.json$")
Progress = Callable[[int], None]


def step_prefix(job: str, step: int) -> str:
    return f"{job}/step-{step}/"


def url(store: Any, job: str, step: int) -> str:
    """Where a step lives in the bucket, for messages and ``wait()``'s answer."""
    return f"s3://{store.config.bucket}/{store.key(step_prefix(job, step)[:-1])}"


def _upload(store: Any, local_dir: str, names: list[str], job: str, step: int, progress: Progress | None) -> int:
    total = 0
    for name in names:
        store.put_file(step_prefix(job, step) + name, os.path.join(local_dir, name), progress)
        total += os.path.getsize(os.path.join(local_dir, name))
    return total


def upload_step(store: Any, step_dir: str, job: str, step: int, progress: Progress | None = None) -> int:
    """Upload a locally committed step: shards, then fragments, then the manifest. Returns bytes sent."""
    names = sorted(os.listdir(step_dir))
    if MANIFEST not in names:
        raise CheckpointError(f"{step_dir} has no {MANIFEST}: only committed steps are uploaded")
    shards = [n for n in names if n.endswith(".safetensors")]
    frags = [n for n in names if _FRAG.match(n)]
    return _upload(store, step_dir, shards + frags + [MANIFEST], job, step, progress)


def upload_ranks(store: Any, local_dir: str, job: str, step: int, ranks: list[int], progress: Progress | None = None) -> int:
    """Multi-node: upload this node's ranks of a step (each shard before its fragment). Returns bytes sent."""
    shards = [persist.shard_name(r) for r in sorted(ranks)]
    frags = [f"rank-{r:05d}.json" for r in sorted(ranks)]
    return _upload(store, local_dir, shards + frags, job, step, progress)


def try_commit(store: Any, job: str, step: int, world_size: int) -> bool:
    """Multi-node: write the step's manifest if every rank's fragment is in the bucket.

    True when the step is (now, or already) complete in the bucket. Raises ``CheckpointError`` when
    the fragments do not make a whole checkpoint (coverage, differing replicas, mismatched steps).
    """
    names = {k[len(step_prefix(job, step)) :] for k in store.list(step_prefix(job, step))}
    if MANIFEST in names:
        return True
    present = {int(m.group(1)) for n in names if (m := _FRAG.match(n))}
    if not set(range(world_size)) <= present:
        return False
    frags = []
    for r in range(world_size):
        frag = json.loads(store.get_bytes(step_prefix(job, step) + f"rank-{r:05d}.json"))
        if persist.shard_name(r) not in names:
            raise CheckpointError(f"step {step} of job {job}: rank {r}'s fragment is in the bucket but its shard is not")
        frags.append(frag)
    manifest = persist.build_manifest(job, step, world_size, frags)
    store.put_bytes(step_prefix(job, step) + MANIFEST, json.dumps(manifest, separators=(",", ":")).encode())
    return True


def remote_steps(store: Any, job: str) -> tuple[list[int], list[int]]:
    """``(committed, partial)`` steps of ``job`` in the bucket, each sorted."""
    committed, seen = set(), set()
    for key in store.list(f"{job}/"):
        m = _STEP_KEY.match(key[len(job) + 1 :])
        if m:
            seen.add(int(m.group(1)))
            if m.group(2) == MANIFEST:
                committed.add(int(m.group(1)))
    return sorted(committed), sorted(seen - committed)


def download_step(store: Any, root: str, job: str, step: int, progress: Progress | None = None) -> str:
    """Bring a step from the bucket into ``root`` (``<root>/<job>/step-N``), manifest last; returns it.

    Each file's size is checked as it arrives, and every chunk's checksum before the step is renamed
    into place: a corrupt object fails the fetch, naming the object and tensor, and leaves nothing.
    """
    final = persist.step_dir(root, job, step)
    if os.path.exists(os.path.join(final, MANIFEST)):
        return final
    tmp = final + ".fetch"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        raw = store.get_bytes(step_prefix(job, step) + MANIFEST)
        try:
            manifest = validate_manifest(json.loads(raw), url(store, job, step) + "/" + MANIFEST)
        except ValueError as e:
            raise FormatError(f"{url(store, job, step)}/{MANIFEST} is not valid JSON: {e}") from None
        if (manifest["job"], manifest["step"]) != (job, step):
            raise FormatError(f"{url(store, job, step)}/{MANIFEST} describes job {manifest['job']} step {manifest['step']}")
        for name, ent in sorted(manifest["files"].items()):
            if "/" in name or name in (".", ".."):
                raise FormatError(f"{url(store, job, step)}/{MANIFEST} names a file outside the step: {name!r}")
            path = os.path.join(tmp, name)
            store.get_file(step_prefix(job, step) + name, path, progress)
            size = os.path.getsize(path)
            if size != ent["size"]:
                raise FormatError(f"{url(store, job, step)}/{name} is {size} bytes, the manifest says {ent['size']}")
        fd = os.open(os.path.join(tmp, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, raw)
            os.fsync(fd)
        finally:
            os.close(fd)
        # every checksum, before the step enters the root: a corrupt object never becomes the newest
        # local step that every later restore would trip over (one more read, from the page cache)
        problems = [p.replace(tmp, url(store, job, step)) for p in verify_checkpoint(tmp)]
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise FormatError(f"step {step} of job {job} in the bucket is corrupt: {problems[0]}{more}")
        fsync_dir(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(persist.job_dir(root, job))
    if (persist.read_latest(root, job) or -1) < step:
        persist.update_latest(root, job, step)
    return final


def _delete_step(store: Any, job: str, step: int) -> None:
    keys = store.list(step_prefix(job, step))
    man = step_prefix(job, step) + MANIFEST
    if man in keys:
        store.delete([man])  # first: a half-deleted step never looks complete
    store.delete([k for k in keys if k != man])


def apply_remote_retention(store: Any, job: str, keep: int, keep_every: int, busy: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """Keep the newest ``keep`` committed steps and every step divisible by ``keep_every`` (0: none);
    also remove partial uploads older than the newest committed step (they can no longer complete),
    except ``busy`` ones. Returns the steps removed."""
    committed, partial = remote_steps(store, job)
    kept = set(committed[-keep:]) if keep > 0 else set(committed)
    if keep_every > 0:
        kept |= {s for s in committed if s % keep_every == 0}
    newest = committed[-1] if committed else -1
    doomed = [s for s in committed if s not in kept] + [s for s in partial if s < newest and s not in busy]
    for s in sorted(doomed):
        _delete_step(store, job, s)
    return sorted(doomed)


# ---------------------------------------------------------------------------- the daemon's upload thread


@dataclass
class Upload:
    job: str
    step: int
    world_size: int
    ranks: list[int] | None = None  # multi-node: this node's ranks; None: the whole local step
    catch_up: bool = False  # queued at start-up: skip it if the bucket already has the step
    bytes_total: int = 0
    bytes_done: int = 0
    started: float = 0.0


@dataclass
class UploadResult:
    job: str
    step: int
    error: str | None
    nbytes: int
    seconds: float
    committed: bool  # the step is complete in the bucket
    multi_node: bool
    url: str = ""
    removed_remote: list[int] = field(default_factory=list)


class Uploader:
    """One thread that uploads steps in the order they became durable.

    When uploads fall behind, a queued step is skipped if a newer one of the same job is queued and
    it is not one the bucket keeps forever (``keep_every``): the bucket wants the newest state, and
    skipping bounds the backlog. Multi-node steps are never skipped (other nodes wait for them).
    ``done`` is called on this thread with an :class:`UploadResult` for each step.
    """

    POLL_S = 0.25

    def __init__(
        self,
        store: Any,
        root: str,
        done: Callable[[UploadResult], None],
        *,
        keep: int,
        keep_every: int,
        commit_timeout: float,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self.store, self.root, self.done = store, root, done
        self.keep, self.keep_every, self.commit_timeout = keep, keep_every, commit_timeout
        self._initializer = initializer
        self._queue: list[Upload] = []
        self._cv = threading.Condition()
        self._closing = False
        self.current: Upload | None = None
        self._thread = threading.Thread(target=self._run, name="ckptd-upload", daemon=True)
        self._thread.start()

    def submit(self, job: str, step: int, world_size: int, ranks: list[int] | None = None, *, catch_up: bool = False) -> None:
        with self._cv:
            self._queue.append(Upload(job, step, world_size, ranks, catch_up=catch_up))
            self._cv.notify()

    def pending(self, job: str) -> set[int]:
        """Steps of ``job`` queued or uploading: local retention must leave them alone."""
        with self._cv:
            out = {u.step for u in self._queue if u.job == job}
            cur = self.current
        if cur is not None and cur.job == job:
            out.add(cur.step)
        return out

    def backlog(self) -> list[tuple[str, int]]:
        with self._cv:
            return [(u.job, u.step) for u in self._queue]

    def close(self) -> None:
        """Finish the upload in progress and the queue, then stop."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()

    def _next(self) -> Upload | None:
        with self._cv:
            while not self._queue and not self._closing:
                self._cv.wait()
            while self._queue:
                u = self._queue.pop(0)
                newer = any(q.job == u.job and q.step > u.step for q in self._queue)
                if u.ranks is None and newer and not (self.keep_every and u.step % self.keep_every == 0):
                    log.info("upload of job %s step %s skipped: a newer step is queued", u.job, u.step)
                    continue
                self.current = u
                return u
            return None

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()  # the daemon lowers this thread's CPU and I/O priority
        while True:
            u = self._next()
            if u is None:
                return
            try:
                res = self._upload(u)
            except Exception as e:  # reported, never swallowed: the step's waiters or status get it
                log.error("upload of job %s step %s failed: %s", u.job, u.step, e)
                res = UploadResult(u.job, u.step, str(e), u.bytes_done, time.monotonic() - u.started, False, u.ranks is not None)
            finally:
                with self._cv:
                    self.current = None
            try:
                self.done(res)
            except Exception:
                log.exception("upload result for job %s step %s was not delivered", u.job, u.step)

    def _progress(self, u: Upload) -> Progress:
        last = [time.monotonic()]

        def cb(n: int) -> None:
            u.bytes_done += n
            now = time.monotonic()
            if now - last[0] >= 10.0 and u.bytes_total:
                last[0] = now
                rate = u.bytes_done / max(now - u.started, 1e-9)
                log.info(
                    "uploading job %s step %s: %.0f%% (%.2f of %.2f GB, %.0f MB/s)",
                    u.job, u.step, 100 * u.bytes_done / u.bytes_total, u.bytes_done / 1e9, u.bytes_total / 1e9, rate / 1e6,
                )  # fmt: skip

        return cb

    def _upload(self, u: Upload) -> UploadResult:
        u.started = time.monotonic()
        multi = u.ranks is not None
        if u.catch_up and self.store.exists(step_prefix(u.job, u.step) + MANIFEST):
            return UploadResult(u.job, u.step, None, 0, 0.0, True, False, url(self.store, u.job, u.step))
        if not multi:
            d = persist.step_dir(self.root, u.job, u.step)
            u.bytes_total = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
            nbytes = upload_step(self.store, d, u.job, u.step, self._progress(u))
            committed = True
        else:
            d = persist.tmp_dir(self.root, u.job, u.step)
            assert u.ranks is not None
            names = [persist.shard_name(r) for r in u.ranks] + [f"rank-{r:05d}.json" for r in u.ranks]
            u.bytes_total = sum(os.path.getsize(os.path.join(d, n)) for n in names)
            nbytes = upload_ranks(self.store, d, u.job, u.step, u.ranks, self._progress(u))
            deadline = time.monotonic() + self.commit_timeout
            while not (committed := try_commit(self.store, u.job, u.step, u.world_size)):
                if time.monotonic() > deadline:
                    _, partial = remote_steps(self.store, u.job)
                    raise CheckpointError(
                        f"step {u.step} of job {u.job}: not every rank's shard reached the bucket within {self.commit_timeout:.0f} s"
                        " (is every node's daemon configured with the same bucket and prefix?)"
                    )
                time.sleep(self.POLL_S)
            shutil.rmtree(d, ignore_errors=True)  # the bucket holds the step now; this node's part is not a checkpoint
        removed = apply_remote_retention(self.store, u.job, self.keep, self.keep_every, busy={u.step} | self.pending(u.job))
        if removed:
            log.info("remote retention: removed steps %s of job %s from the bucket", removed, u.job)
        dt = time.monotonic() - u.started
        return UploadResult(u.job, u.step, None, nbytes, dt, committed, multi, url(self.store, u.job, u.step), removed)
