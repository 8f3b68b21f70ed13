"""The bucket tier: what the daemon stores in the bucket, how a multi-node step completes there, how
a step comes back, and which steps the bucket keeps (keys in :mod:`ckptd.layout`).

Single node: once a step is complete on local disk, its files are uploaded data first, fragments
next, manifest last, so a reader never sees a manifest whose data is missing. Multi-node (ranks spread
over several daemons, each with its own root): each daemon uploads the shards and fragments of its own
ranks once they are durable locally; whichever daemon then finds every rank's fragment in the bucket
merges them into the manifest (the same checks as a local step: coverage, replicas) and writes it.
Both may do so at once: they write the same manifest. The trainers' process groups play no part.

Everything here blocks on the network: the daemon calls it from its upload and fetch threads only,
through the :class:`~ckptd.storage.store.ObjectStore` protocol.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from ..config import MAX_DOCUMENT_BYTES
from ..errors import CheckpointError, FormatError
from ..format import Attempt, attempt_of, build_manifest, commit_time
from ..layout import (
    FETCHED,
    MANIFEST,
    bucket_key,
    bucket_prefix,
    fetch_dir,
    fragment_name,
    fragment_rank,
    is_complete,
    job_dir,
    parse_bucket_key,
    shard_name,
    step_dir,
)
from ..validate import confined_name, parse_fragment, parse_manifest
from .files import create_new, fsync_dir, write_all
from .local import committed_at, job_lock, retire_now, update_latest
from .retention import RetentionPolicy, doomed
from .store import ObjectStore, Progress

log = logging.getLogger("ckptd.daemon")


def get_document(store: ObjectStore, key: str) -> bytes:
    """A manifest or fragment from the bucket, refused past ``MAX_DOCUMENT_BYTES`` as it arrives (another
    node or a bad actor with bucket access wrote it: it must not take the daemon's memory)."""
    return store.get_bytes(key, limit=MAX_DOCUMENT_BYTES)


def step_url(store: ObjectStore, job: str, step: int) -> str:
    """Where a step lives in the bucket, for messages and ``wait()``'s answer."""
    return store.url(bucket_prefix(job, step)[:-1])


def _upload(store: ObjectStore, local_dir: str, names: list[str], job: str, step: int, progress: Progress | None) -> int:
    total = 0
    for name in names:
        store.put_file(bucket_key(job, step, name), os.path.join(local_dir, name), progress)
        total += os.path.getsize(os.path.join(local_dir, name))
    return total


def upload_step(store: ObjectStore, local_dir: str, job: str, step: int, progress: Progress | None = None) -> int:
    """Upload a complete local step: shards, then fragments, then the manifest. Returns bytes sent."""
    ino = os.stat(local_dir).st_ino  # before the listing: a directory renamed into place after it is caught below
    names = sorted(os.listdir(local_dir))
    if MANIFEST not in names:
        raise CheckpointError(f"{local_dir} has no {MANIFEST}: only complete steps are uploaded")
    with open(os.path.join(local_dir, MANIFEST), "rb") as f:
        manifest = f.read()
    # a step number saved again (after a rollback) replaces an older step of that number: it must not look
    # complete while its files are being replaced. The multi-node rule decides whether it may: a run that
    # restored nothing (a replaced node, the same command run again) never overwrites the bucket's step
    try:
        doc = json.loads(manifest)
    except (ValueError, RecursionError):  # the bytes are uploaded as they are; a download verifies them
        doc = None
    if attempt_of(doc) is not None:
        clear_for_attempt(store, job, step, doc)
    else:  # written by a ckptd that did not name attempts
        store.delete([bucket_key(job, step, MANIFEST)])
        _forget_commit(store, job, step)
    shards = [n for n in names if n.endswith(".safetensors")]
    frags = [n for n in names if fragment_rank(n) is not None]
    total = _upload(store, local_dir, shards + frags, job, step, progress)
    if os.stat(local_dir).st_ino != ino:  # a rolled-back run's re-save took its place meanwhile: its files may be mixed in
        raise CheckpointError(f"{local_dir} was replaced by a new step {step} while it was uploaded; that one is uploaded instead")
    store.put_bytes(bucket_key(job, step, MANIFEST), manifest)  # the manifest read with the files it names
    if progress is not None:
        progress(len(manifest))
    return total + len(manifest)


def rank_files(ranks: list[int]) -> list[str]:
    """A multi-node step's files of these ranks, in upload order: every shard before any fragment."""
    return [shard_name(r) for r in sorted(ranks)] + [fragment_name(r) for r in sorted(ranks)]


def upload_ranks(store: ObjectStore, local_dir: str, job: str, step: int, ranks: list[int], progress: Progress | None = None) -> int:
    """Multi-node: upload this node's ranks of a step (each shard before its fragment). Returns bytes sent."""
    return _upload(store, local_dir, rank_files(ranks), job, step, progress)


def _bucket_doc(store: ObjectStore, job: str, step: int) -> tuple[bool, Any]:
    """``(complete, manifest)``: whether step ``step`` has a manifest in the bucket, and that manifest
    parsed loosely (``None`` when it is not JSON; it is only asked which attempt wrote it and when)."""
    try:
        raw = get_document(store, bucket_key(job, step, MANIFEST))
    except FileNotFoundError:
        return False, None
    try:
        return True, json.loads(raw)
    except (ValueError, RecursionError):
        return True, None


def bucket_attempt(store: ObjectStore, job: str, step: int) -> tuple[bool, Attempt | None]:
    """``(complete, attempt)``: whether step ``step`` has a manifest in the bucket, and the attempt it names."""
    complete, doc = _bucket_doc(store, job, step)
    return complete, attempt_of(doc)


def clear_for_attempt(store: ObjectStore, job: str, step: int, frag: dict[str, Any]) -> bool:
    """Multi-node, before this node uploads its ranks of a step (``frag``: one of their fragments): make
    room in the bucket. Nothing to do when no manifest of that number is there, or it is this attempt's
    own (an upload again after a restart). Another attempt's manifest is deleted, since its objects are
    about to be overwritten and it must stop looking complete first, only if this attempt replaces it:
    saved by a launch that restored an earlier step (a rollback) and committed after it. Else
    ``CheckpointError``: a run that restored nothing, or a dead attempt's part uploaded late, never
    overwrites a complete step. True if a manifest was deleted."""
    ours = attempt_of(frag)
    complete, doc = _bucket_doc(store, job, step)
    if not complete or ours is None:  # ours None: a fragment of a ckptd that did not name attempts
        return False
    theirs = attempt_of(doc)
    if theirs == ours:
        return False
    after, at = ours[1], frag.get("committed_at") or 0
    if after is None or after >= step or commit_time(doc) >= at:
        how = "restored no step" if after is None else f"restored step {after}"
        raise CheckpointError(
            f"step {step} of job {job} is complete in the bucket, saved by another attempt (launch, restored step) {theirs};"
            f" this node's part of attempt {ours} ({how}, committed {'earlier' if commit_time(doc) >= at else 'later'})"
            " does not replace it: only a run that restored an earlier step replaces a step, with a newer commit"
        )
    store.delete([bucket_key(job, step, MANIFEST)])
    _forget_commit(store, job, step)
    return True


def try_complete(store: ObjectStore, job: str, step: int, world_size: int, attempt: Attempt | None = None) -> bool:
    """Multi-node: write the step's manifest if every rank's fragment is in the bucket.

    True when the step is (now, or already) complete in the bucket. ``attempt``: whose step this is;
    another attempt's fragments (the step before a rollback) are never merged with its own, and another
    attempt's manifest is not its completion (a fragment or manifest naming no attempt, an older
    ckptd's, counts as any). Raises ``CheckpointError`` when the fragments do not make a whole
    checkpoint (coverage, differing replicas, mismatched steps).
    """
    prefix = bucket_prefix(job, step)
    names = {k[len(prefix) :] for k in store.list(prefix)}
    if MANIFEST in names:
        complete, theirs = bucket_attempt(store, job, step)
        done = complete and (attempt is None or theirs in (None, attempt))
        if done:  # this process may have cached the commit time of the step this attempt replaced
            _forget_commit(store, job, step)
        return done
    present = {r for n in names if (r := fragment_rank(n)) is not None}
    if not set(range(world_size)) <= present:
        return False
    frags = []
    for r in range(world_size):
        key = bucket_key(job, step, fragment_name(r))
        frag = parse_fragment(get_document(store, key), store.url(key))  # another node's: checked like a manifest
        if shard_name(r) not in names:
            raise CheckpointError(f"step {step} of job {job}: rank {r}'s fragment is in the bucket but its shard is not")
        if attempt is not None and attempt_of(frag) not in (None, attempt):
            return False  # the step before a rollback's, on a node still uploading this attempt's ranks
        frags.append(frag)
    manifest = build_manifest(job, step, world_size, frags)
    store.put_bytes(bucket_key(job, step, MANIFEST), json.dumps(manifest, separators=(",", ":")).encode())
    _forget_commit(store, job, step)
    log.info("step %s of job %s is complete in the bucket: wrote its manifest (attempt %s)", step, job, attempt_of(manifest))
    return True


def _listing(store: ObjectStore, job: str) -> tuple[dict[int, str], list[int]]:
    """The steps of ``job`` in the bucket: the complete ones with their manifest's tag (one listing), and
    the partial ones, sorted."""
    tags: dict[int, str] = {}
    seen = set()
    for key, tag in store.list_tagged(f"{job}/").items():
        parsed = parse_bucket_key(job, key)
        if parsed is not None:
            seen.add(parsed[0])
            if parsed[1] == MANIFEST:
                tags[parsed[0]] = tag
    return tags, sorted(seen - tags.keys())


def remote_steps(store: ObjectStore, job: str) -> tuple[list[int], list[int]]:
    """``(complete, partial)`` steps of ``job`` in the bucket, each sorted."""
    tags, partial = _listing(store, job)
    return sorted(tags), partial


# (bucket url, job, step) -> (the manifest's tag when read, its committed_at); a manifest changes only when a
# rollback re-save replaces its step, maybe by other nodes' daemons: the tag of a listing tells
_commit_cache: dict[tuple[str, str, int], tuple[str | None, int]] = {}


def _forget_commit(store: ObjectStore, job: str, step: int) -> None:
    """This process deleted, replaced or completed the bucket's step: its cached commit time may be stale."""
    _commit_cache.pop((store.url(), job, step), None)


def bucket_committed_at(store: ObjectStore, job: str, step: int, tag: str | None = None) -> int | None:
    """When step ``step`` (complete in the bucket) was committed: its manifest's ``committed_at``, 0 if
    absent (older ckptd) or unreadable, ``None`` if the manifest is gone (another node's retention).
    Read once per version of the manifest: ``tag``, the manifest's tag in a listing just made, tells a
    replaced manifest from the one read before; without it the value read before stands (this process
    forgets it when it deletes or uploads the step)."""
    key = (store.url(), job, step)
    cached = _commit_cache.get(key)
    if cached is None or (tag is not None and cached[0] != tag):
        complete, doc = _bucket_doc(store, job, step)
        if not complete:
            _commit_cache.pop(key, None)
            return None
        if len(_commit_cache) > 65536:
            _commit_cache.clear()
        cached = _commit_cache[key] = (tag, commit_time(doc))
    return cached[1]


def bucket_steps_by_commit(store: ObjectStore, job: str) -> tuple[list[int], list[int]]:
    """``(complete, partial)`` steps of ``job`` in the bucket: the complete ones oldest commit first (the
    last is the bucket's latest), the partial ones ascending."""
    tags, partial = _listing(store, job)
    when = {s: at for s, tag in tags.items() if (at := bucket_committed_at(store, job, s, tag)) is not None}
    return sorted(when, key=lambda s: (when[s], s)), partial


def _fetch_files(store: ObjectStore, job: str, step: int, tmp: str, progress: Progress | None) -> None:
    """Download the step's manifest-listed files into ``tmp``, then its manifest; check every size."""
    where = step_url(store, job, step)
    raw = get_document(store, bucket_key(job, step, MANIFEST))
    manifest = parse_manifest(raw, f"{where}/{MANIFEST}")  # every field, names confined, nesting bounded
    if (manifest["job"], manifest["step"]) != (job, step):
        raise FormatError(f"{where}/{MANIFEST} describes job {manifest['job']} step {manifest['step']}")
    if FETCHED in manifest["files"]:
        raise FormatError(f"{where}/{MANIFEST} lists a file named {FETCHED!r}, the name ckptd marks a downloaded step with")
    for name, ent in sorted(manifest["files"].items()):
        path = os.path.join(tmp, confined_name(name, f"{where}/{MANIFEST}", "files"))
        store.get_file(bucket_key(job, step, name), path, progress, limit=ent["size"])  # no more on disk than the manifest says
        size = os.path.getsize(path)
        if size != ent["size"]:
            raise FormatError(f"{where}/{name} is {size} bytes, the manifest says {ent['size']}")
    os.close(create_new(os.path.join(tmp, FETCHED)))  # before the manifest: a complete downloaded step is always marked
    fd = create_new(os.path.join(tmp, MANIFEST))
    try:
        write_all(fd, raw)
        os.fsync(fd)
    finally:
        os.close(fd)


def download_step(store: ObjectStore, root: str, job: str, step: int, progress: Progress | None = None) -> str:
    """Bring a step from the bucket into ``root`` (``<root>/<job>/step-N``), manifest last; returns it.
    The step holds :data:`~ckptd.layout.FETCHED`: a restarted daemon never uploads it again.

    Each file's size is checked as it arrives, and every chunk's checksum before the step is renamed
    into place: a corrupt object fails the fetch, naming the object and tensor, and leaves nothing.
    """
    from ..tools.verify import verify_checkpoint

    final = step_dir(root, job, step)
    stale: int | None = None  # the local copy's commit time, if the bucket's step of that number replaced it
    if is_complete(final):
        theirs = bucket_committed_at(store, job, step)
        if theirs is None or theirs <= committed_at(final):
            return final
        stale = committed_at(final)  # a rollback re-save by other nodes: this copy is of the abandoned line
    trash: str | None = None
    tmp = fetch_dir(root, job, step)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _fetch_files(store, job, step, tmp, progress)
        # every checksum, before the step enters the root: a corrupt object never becomes the newest
        # local step that every later restore would trip over (one more read, from the page cache)
        problems = [p.replace(tmp, step_url(store, job, step)) for p in verify_checkpoint(tmp)]
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise FormatError(f"step {step} of job {job} in the bucket is corrupt: {problems[0]}{more}")
        fsync_dir(tmp)
        with job_lock(root, job):
            if stale is not None:
                trash = retire_now(root, job, step, stale)
            if os.path.isdir(final) and not is_complete(final):  # a leftover without a manifest is no checkpoint
                shutil.rmtree(final)
            if not is_complete(final):
                os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # still there only if another fetch completed the step first
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(job_dir(root, job))
    update_latest(root, job, step)  # under the job's lock; moves only if this step was committed after latest's
    return final


def _delete_step(store: ObjectStore, job: str, step: int) -> None:
    _forget_commit(store, job, step)
    keys = store.list(bucket_prefix(job, step))
    man = bucket_key(job, step, MANIFEST)
    if man in keys:
        store.delete([man])  # first: a half-deleted step never looks complete
    store.delete([k for k in keys if k != man])


def apply_remote_retention(
    store: ObjectStore,
    job: str,
    policy: RetentionPolicy,
    busy: frozenset[int] | set[int] = frozenset(),
    settled: Callable[[int], bool] | None = None,
) -> list[int]:
    """Remove the complete steps ``policy`` does not keep (given them in commit order; never the latest),
    and partial uploads that can no longer complete, except ``busy`` ones: those ``settled`` says so of (a
    multi-node job: another node may still be uploading any partial step, even one numbered below the
    latest after a rollback), else those below the latest complete step. Returns the steps removed."""
    complete, partial = bucket_steps_by_commit(store, job)
    latest = complete[-1] if complete else -1
    stale = [s for s in partial if s not in busy and (settled(s) if settled is not None else s < latest)]
    gone = [s for s in doomed(policy, complete) if s != latest] + stale
    for s in sorted(gone):
        _delete_step(store, job, s)
    return sorted(gone)
