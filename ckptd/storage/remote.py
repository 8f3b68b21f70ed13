"""The bucket tier: what the daemon stores in the bucket, how a multi-node step completes there, how
a step comes back, and which steps the bucket keeps (keys in :mod:`ckptd.layout`).

Single node: once a step is complete on local disk, its files are uploaded data first, fragments
next, manifest last, so a reader never sees a manifest whose data is missing. Multi-node (ranks spread
over several daemons, each with its own root): each daemon uploads the shards and fragments of its own
ranks once they are durable locally, into the folder of the attempt that saved them; whichever daemon
then finds every rank's fragment of that attempt in the bucket merges them into the manifest (the same
checks as a local step: coverage, replicas) and writes it, conditionally: if two try at once, one write
lands and the other reads it at its next poll. The trainers' process groups play no part. Two attempts
of one step number (a rollback, a dead run's part uploaded late) share only the manifest's key, written
only over the version its writer judged, never a shard or fragment: a step of that number in the bucket
stays complete until the attempt replacing it is, and no late upload overwrites a complete step's shard;
retention removes another attempt's objects once they have stayed unchanged for ``commit_timeout``.

What is read back (manifests, fragments) another node or anyone with access to the bucket may have written: each
is read only up to what a real one of its step can be, and a step is complete in the bucket only once its manifest
validates; a ``latest`` lookup orders steps by each manifest's head (:mod:`.documents`).

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
from ..files import create_new, fsync_dir, write_all
from ..format import Attempt, attempt_of, build_manifest, commit_time, encode_manifest, objects_folder
from ..layout import (
    FETCHED,
    MANIFEST,
    attempt_folder,
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
from .documents import (
    Objects,
    commit_order,
    forget_commit,
    fragment_limit,
    get_document,
    list_objects,
    manifest_facts,
    manifest_limit,
    read_document,
    step_objects,
    valid_manifest,
)
from .local import committed_at, job_lock, retire_now, update_latest
from .retention import RetentionPolicy, doomed
from .store import ObjectStore, Progress, SizedStore

log = logging.getLogger("ckptd.daemon")


def step_url(store: ObjectStore, job: str, step: int) -> str:
    """Where a step lives in the bucket, for messages and ``wait()``'s answer."""
    return store.url(bucket_prefix(job, step)[:-1])


def _upload(store: ObjectStore, local_dir: str, names: list[str], job: str, step: int, progress: Progress | None, folder: str = "") -> int:
    total = 0
    for name in names:
        store.put_file(bucket_key(job, step, folder + name), os.path.join(local_dir, name), progress)
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
    if attempt_of(doc) is None or check_replaces(store, job, step, doc):  # a one-node step's files keep their names:
        store.delete([bucket_key(job, step, MANIFEST)])  # the step they replace stops looking complete first
        forget_commit(store, job, step)
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


def upload_ranks(
    store: ObjectStore,
    local_dir: str,
    job: str,
    step: int,
    ranks: list[int],
    progress: Progress | None = None,
    attempt: Attempt | None = None,
) -> int:
    """Multi-node: upload this node's ranks of a step (every shard before any fragment) into the folder of
    ``attempt``, the one their fragments name (``None``: fragments of a ckptd that named none go under the
    step's prefix itself). Returns bytes sent."""
    folder = "" if attempt is None else attempt_folder(*attempt)
    return _upload(store, local_dir, rank_files(ranks), job, step, progress, folder)


def _bucket_doc(store: ObjectStore, job: str, step: int, objects: Objects | None = None) -> tuple[bool, Any, bytes | None]:
    """``(there, manifest, raw)``: whether step ``step`` has a manifest in the bucket (``objects``: the step's, listed),
    that manifest parsed loosely (``None`` when it is not JSON or is larger than one of its step can be: it is only
    asked which attempt wrote it and when; a writer never overwrites it unseen), and its bytes."""
    objects = step_objects(store, job, step) if objects is None else objects
    key = bucket_key(job, step, MANIFEST)
    try:
        raw = read_document(store, key, None if objects is None else objects.get(MANIFEST), manifest_limit(objects))
    except FileNotFoundError:
        return False, None, None
    except FormatError:
        return True, None, None
    try:
        return True, json.loads(raw), raw
    except (ValueError, RecursionError):
        return True, None, raw


def step_complete(store: ObjectStore, job: str, step: int) -> bool:
    """Whether step ``step`` of ``job`` is complete in the bucket: its manifest read by its key (bounded by the step's
    listing) and valid. Not through a listing of the manifest itself, which a network file system's cached directory
    may not show yet (a restore of a step another node just completed)."""
    objects = step_objects(store, job, step)
    try:
        raw = read_document(store, bucket_key(job, step, MANIFEST), None, manifest_limit(objects))
    except (FileNotFoundError, FormatError):
        return False
    return valid_manifest(store, job, step, raw) is not None


def bucket_attempt(store: ObjectStore, job: str, step: int) -> tuple[bool, Attempt | None]:
    """``(complete, attempt)``: whether step ``step`` has a manifest in the bucket, and the attempt it names."""
    complete, doc, _ = _bucket_doc(store, job, step)
    return complete, attempt_of(doc)


def _refusal(job: str, step: int, ours: Attempt, at: int, doc: Any) -> str | None:
    """Why attempt ``ours`` (committed at ``at``) may not replace the bucket's complete step ``step`` of
    another attempt (manifest ``doc``), or ``None`` if it may: only a launch that restored an earlier step
    (a rollback) and committed after it replaces a step. A run that restored nothing (a replaced node,
    the same command run again) or a dead attempt's part uploaded late never does."""
    after, theirs = ours[1], commit_time(doc)
    if after is not None and after < step and theirs < at:
        return None
    how = "restored no step" if after is None else f"restored step {after}"
    return (
        f"step {step} of job {job} is complete in the bucket, saved by another attempt (launch, restored step)"
        f" {attempt_of(doc)}; this node's part of attempt {ours} ({how}, committed {'earlier' if theirs >= at else 'later'})"
        " does not replace it: only a run that restored an earlier step replaces a step, with a newer commit"
    )


def check_replaces(store: ObjectStore, job: str, step: int, frag: dict[str, Any]) -> bool:
    """Before this node uploads its part of a step (``frag``: one of its fragments, or a one-node step's
    manifest): whether the bucket holds another attempt's complete step of that number, which this attempt
    replaces once it is complete itself (its manifest takes the old one's key). False when none is there,
    it is this attempt's own (an upload again after a restart), or this part names no attempt (an older
    ckptd's). A step whose manifest names no attempt (an older ckptd's, or unreadable) is another's.
    ``CheckpointError`` when this attempt may not replace it (:func:`_refusal`): this node's part could
    never complete."""
    ours = attempt_of(frag)
    complete, doc, _ = _bucket_doc(store, job, step)
    if not complete or ours is None or attempt_of(doc) == ours:
        return False
    why = _refusal(job, step, ours, frag.get("committed_at") or 0, doc)
    if why is not None:
        raise CheckpointError(why)
    return True


def _own_fragments(
    store: ObjectStore, job: str, step: int, objects: Objects, world_size: int, attempt: Attempt | None
) -> list[dict[str, Any]] | None:
    """Every rank's fragment of ``attempt`` in the bucket (its folder; the step's prefix for ``None``), each read no
    further than one of its shard can be (``objects``: the step's, listed) and checked like a manifest, or ``None``
    while some rank's is missing."""
    folder = "" if attempt is None else attempt_folder(*attempt)
    if any(folder + fragment_name(r) not in objects for r in range(world_size)):
        return None
    frags = []
    for r in range(world_size):
        if folder + shard_name(r) not in objects:
            raise CheckpointError(f"step {step} of job {job}: rank {r}'s fragment is in the bucket but its shard is not")
        key = bucket_key(job, step, folder + fragment_name(r))
        raw = read_document(store, key, objects[folder + fragment_name(r)], fragment_limit(objects, folder, r))
        frag = parse_fragment(raw, store.url(key))  # another node's: checked like a manifest
        if attempt is not None and attempt_of(frag) != attempt:
            raise CheckpointError(
                f"step {step} of job {job}: {store.url(key)} names attempt {attempt_of(frag)}, not its folder's {attempt}"
            )
        frags.append(frag)
    return frags


PROBE_MAX = 64  # ranks whose missing objects one probe asks for by name (beyond: the listing decides)


def _probe(store: ObjectStore, prefix: str, objects: Objects, world_size: int, attempt: Attempt | None) -> None:
    """Where the store's listings may lag (a network file system's cached directory, :attr:`DirStore.listing_may_lag`):
    ask for this attempt's shards and fragments the listing misses by name (a lookup the cache does not hold back), at
    most :data:`PROBE_MAX` ranks' worth, and add those found to ``objects`` with their sizes."""
    if not getattr(store, "listing_may_lag", False) or not isinstance(store, SizedStore):
        return
    folder = "" if attempt is None else attempt_folder(*attempt)
    missing = [r for r in range(world_size) if folder + fragment_name(r) not in objects or folder + shard_name(r) not in objects]
    for r in missing[:PROBE_MAX]:
        # the fragment first: a node publishes a rank's shard before its fragment, so a fragment found has its shard
        # (asked second); the other order could find a fragment published between the two asks without its shard
        found: dict[str, tuple[str, int | None]] | None = {}
        for name in (folder + fragment_name(r), folder + shard_name(r)):
            if name not in objects and found is not None:
                try:
                    found[name] = ("", store.get_head(prefix + name, 0)[1])
                except FileNotFoundError:
                    found = None  # not both there yet: the rank is judged at a later poll
        objects.update(found or {})


def try_complete(store: ObjectStore, job: str, step: int, world_size: int, attempt: Attempt | None = None, probe: bool = False) -> bool:
    """Multi-node: write the step's manifest if every rank's fragment of ``attempt`` is in the bucket.

    True when the step is (now, or already) complete in the bucket. ``attempt``: whose step this is; only
    its own folder's fragments are merged, and another attempt's manifest (one naming none included) is
    not its completion: it is replaced if this attempt may (:func:`_refusal`), else ``CheckpointError``.
    The manifest is written only if it is still as listed (a conditional PUT): another attempt that
    completes the step number meanwhile is judged at the next poll, never overwritten unseen. Raises
    ``CheckpointError`` too when the fragments do not make a whole checkpoint (coverage, differing
    replicas, mismatched steps). ``attempt`` None: fragments of an older ckptd, any manifest completes it.
    Its own manifest (or for ``None``, any) completes it only if it validates; else it is written again. ``probe``:
    also look for objects a lagging listing misses (:func:`_probe`); the caller asks for it every few polls.
    """
    prefix = bucket_prefix(job, step)
    objects = {k[len(prefix) :]: v for k, v in list_objects(store, prefix).items()}
    if probe:
        _probe(store, prefix, objects, world_size, attempt)
    tag = objects[MANIFEST][0] if MANIFEST in objects else None
    complete, doc, raw = _bucket_doc(store, job, step, objects) if tag is not None else (False, None, None)
    ours = complete and (attempt is None or attempt_of(doc) == attempt)
    if ours and raw is not None and valid_manifest(store, job, step, raw) is not None:
        forget_commit(store, job, step)  # this process may have cached the commit time of the step this attempt replaced
        return True
    frags = _own_fragments(store, job, step, objects, world_size, attempt)  # a manifest of its own that is none: replaced
    if frags is None:
        return False
    manifest = build_manifest(job, step, world_size, frags)
    if attempt is not None:
        manifest["attempt_objects"] = True
        if complete and not ours and (why := _refusal(job, step, attempt, manifest["committed_at"], doc)) is not None:
            raise CheckpointError(why)
    if not store.put_bytes_if(bucket_key(job, step, MANIFEST), encode_manifest(manifest), tag):
        return _won_by_another(store, job, step, attempt, objects)
    forget_commit(store, job, step)
    log.info("step %s of job %s is complete in the bucket: wrote its manifest (attempt %s)", step, job, attempt_of(manifest))
    return True


def _won_by_another(store: ObjectStore, job: str, step: int, attempt: Attempt | None, objects: Objects) -> bool:
    """After another writer came first: whether what it wrote completes this attempt's step, read at once by its key
    (a listing may lag on a network file system's cached directory, which would otherwise hide it until it expires).
    False when it is another attempt's, or not a manifest: the next poll judges it. ``objects``: the step's, as this
    try listed (and probed) them, which bound the read."""
    try:  # by its key, bounded by the step's other objects as listed: not through the listing's view of the manifest
        raw = read_document(store, bucket_key(job, step, MANIFEST), None, manifest_limit(objects))
    except (FileNotFoundError, FormatError):
        return False
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    if (attempt is not None and attempt_of(doc) != attempt) or valid_manifest(store, job, step, raw) is None:
        return False
    forget_commit(store, job, step)
    log.info("step %s of job %s is complete in the bucket: another node wrote its manifest first", step, job)
    return True


def _objects(store: ObjectStore, job: str) -> dict[int, Objects]:
    """Every object of ``job`` in the bucket, in one listing: step -> {name under the step's prefix: (tag, size)}."""
    out: dict[int, Objects] = {}
    for key, listed in list_objects(store, f"{job}/").items():
        parsed = parse_bucket_key(job, key)
        if parsed is not None:
            out.setdefault(parsed[0], {})[parsed[1]] = listed
    return out


def _tags(objects: Objects) -> dict[str, str]:
    return {name: tag for name, (tag, _) in objects.items()}


def _listing(store: ObjectStore, job: str) -> tuple[dict[int, Objects], list[int]]:
    """The steps of ``job`` in the bucket, in one listing: those with a manifest (their objects), and the partial
    ones, sorted."""
    objects = _objects(store, job)
    return {s: o for s, o in objects.items() if MANIFEST in o}, sorted(s for s, o in objects.items() if MANIFEST not in o)


def remote_steps(store: ObjectStore, job: str) -> tuple[list[int], list[int]]:
    """``(complete, partial)`` steps of ``job`` in the bucket, each sorted; a step whose manifest does not validate
    (read whole once per version) is in neither, logged."""
    listed, partial = _listing(store, job)
    return sorted(s for s, o in listed.items() if manifest_facts(store, job, s, o[MANIFEST][0], o) is not None), partial


def bucket_committed_at(store: ObjectStore, job: str, step: int, tag: str | None = None) -> int | None:
    """When step ``step`` (complete in the bucket) was committed: its manifest's ``committed_at``, 0 if absent (older
    ckptd), ``None`` if the manifest is gone or does not validate (see :func:`~.documents.manifest_facts`)."""
    facts = manifest_facts(store, job, step, tag)
    return None if facts is None else facts[0]


def bucket_steps_by_commit(store: ObjectStore, job: str) -> tuple[list[int], list[int]]:
    """``(complete, partial)`` steps of ``job`` in the bucket: the complete ones oldest commit first, the partial ones
    ascending. The last is the bucket's latest, the one committed last whose manifest validates: steps are ordered by
    each manifest's head (:func:`~.documents.commit_order`) and the newest validated until one does; an older
    manifest is read whole once it is the newest."""
    listed, partial = _listing(store, job)
    when = {s: at for s, o in listed.items() if (at := commit_order(store, job, s, o[MANIFEST][0], o)) is not None}
    order = sorted(when, key=lambda s: (when[s], s))
    while order and manifest_facts(store, job, order[-1], listed[order[-1]][MANIFEST][0], listed[order[-1]]) is None:
        order.pop()  # not a manifest (logged): the step committed before it may be the latest
    return order, partial


def _fetch_files(store: ObjectStore, job: str, step: int, tmp: str, progress: Progress | None) -> None:
    """Download the step's manifest-listed files into ``tmp``, then its manifest; check every size."""
    where = step_url(store, job, step)
    raw = get_document(store, bucket_key(job, step, MANIFEST), MAX_DOCUMENT_BYTES)  # no more than one of its step can be
    manifest = parse_manifest(raw, f"{where}/{MANIFEST}")  # every field, names confined, nesting bounded
    if (manifest["job"], manifest["step"]) != (job, step):
        raise FormatError(f"{where}/{MANIFEST} describes job {manifest['job']} step {manifest['step']}")
    if FETCHED in manifest["files"]:
        raise FormatError(f"{where}/{MANIFEST} lists a file named {FETCHED!r}, the name ckptd marks a downloaded step with")
    folder = objects_folder(manifest)  # a multi-node step's files lie in the folder of the attempt that saved it
    for name, ent in sorted(manifest["files"].items()):
        path = os.path.join(tmp, confined_name(name, f"{where}/{MANIFEST}", "files"))
        store.get_file(bucket_key(job, step, folder + name), path, progress, limit=ent["size"])  # no more on disk than the manifest says
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
    from .verify import verify_checkpoint

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


Settled = Callable[[int, frozenset[tuple[str, str]]], bool]  # have these objects of a step (key, tag) been given up?


def _own(folder: str, name: str) -> bool:
    """Whether ``name``, under the prefix of a complete step whose files lie in ``folder``, is its manifest
    or one of its files (``folder`` empty: a file directly under the prefix)."""
    return name == MANIFEST or (name.startswith(folder) if folder else "/" not in name)


def _drop_complete(store: ObjectStore, job: str, step: int, tag: str, folder: str | None) -> bool:
    """Remove complete step ``step`` whose manifest had ``tag`` in retention's listing, manifest first (a
    half-deleted step never looks complete). False, touching nothing, if the manifest changed since (a
    rollback re-save completed that number; checked again by a conditional delete, which, retried after it
    went through, finds no manifest and goes on). ``folder``: a multi-node step's; only its own files go."""
    forget_commit(store, job, step)
    prefix = bucket_prefix(job, step)
    listed = store.list_tagged(prefix)
    man = bucket_key(job, step, MANIFEST)
    if listed.get(man) != tag or (not store.delete_if(man, tag) and store.exists(man)):
        log.info("remote retention: step %s of job %s was written again since it was listed: kept", step, job)
        return False
    store.delete([k for k in listed if k != man and (folder is None or _own(folder, k[len(prefix) :]))])
    return True


def _delete_judged(store: ObjectStore, objects: dict[str, str], conditional: bool) -> None:
    """Delete exactly these objects (key -> the tag they were judged by); ``conditional`` (a multi-node job's,
    whose nodes may upload a part again under the same names): each only if not written since."""
    if not conditional:
        return store.delete(sorted(objects))
    for key, tag in sorted(objects.items()):
        store.delete_if(key, tag)


def _remove_strays(store: ObjectStore, job: str, objects: dict[str, str], step: int, folder: str, settled: Settled) -> None:
    """Multi-node: another attempt's objects under complete step ``step`` (the step it replaced, a dead
    attempt's part uploaded late, a newer attempt still on its way up) go once ``settled`` says so."""
    strays = {bucket_key(job, step, n): tag for n, tag in objects.items() if not _own(folder, n)}
    if strays and settled(step, frozenset(strays.items())):
        log.info("remote retention: removing %d objects of another attempt of step %s of job %s", len(strays), step, job)
        _delete_judged(store, strays, True)


def apply_remote_retention(
    store: ObjectStore,
    job: str,
    policy: RetentionPolicy,
    busy: frozenset[int] | set[int] = frozenset(),
    settled: Settled | None = None,
) -> list[int]:
    """Remove the complete steps ``policy`` does not keep (given them in commit order; never the latest),
    and partial uploads that can no longer complete, except ``busy`` ones: those ``settled`` says so of (a
    multi-node job: another node may still be uploading any partial step, even one numbered below the
    latest after a rollback), else those below the latest complete step. A multi-node job's objects of
    another attempt under a complete step go by ``settled`` too. Returns the steps removed."""
    objects = _objects(store, job)
    tags = {s: names[MANIFEST][0] for s, names in objects.items() if MANIFEST in names}
    facts = {s: f for s, tag in tags.items() if (f := manifest_facts(store, job, s, tag, objects[s])) is not None}
    complete = sorted(facts, key=lambda s: (facts[s][0], s))
    latest = complete[-1] if complete else -1

    def gone(s: int) -> bool:  # a partial step that can no longer complete
        if s in busy:
            return False
        keys = frozenset((bucket_key(job, s, n), t) for n, t in _tags(objects[s]).items())
        return settled(s, keys) if settled is not None else s < latest

    stale = [s for s in sorted(objects.keys() - tags.keys()) if gone(s)]
    doomed_now = [s for s in doomed(policy, complete) if s != latest]
    dropped = [s for s in doomed_now if _drop_complete(store, job, s, tags[s], None if settled is None else facts[s][1])]
    for s in stale:  # exactly the objects judged: one written since the listing is a new upload's
        forget_commit(store, job, s)
        _delete_judged(store, {bucket_key(job, s, n): t for n, t in _tags(objects[s]).items()}, settled is not None)
    if settled is not None:
        for s in complete:
            if s not in busy and s not in doomed_now:
                _remove_strays(store, job, _tags(objects[s]), s, facts[s][1], settled)
    return sorted(dropped + stale)
