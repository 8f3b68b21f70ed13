"""Manifests and fragments read back from the bucket (for :mod:`.remote`): bounded by what a real one of their step
can be, validated before a step counts as complete, and what each manifest says cached per version.

Another node, or anyone who may write to the bucket, wrote them, and ``json.loads`` of 64 MiB of ``[{},{},...]``
takes 1.7 GiB. So:

* a document is read only up to what a real one of its step can be, judged from the step's listing (which gives
  every size): a manifest merges its step's fragments (:func:`manifest_limit`); a fragment holds its shard's chunk
  table and its rank's tree (:func:`fragment_limit`). One listed larger is refused before a byte is read; one that
  grows meanwhile stops as it arrives. A store that tells no sizes gets ``MAX_DOCUMENT_BYTES``, as before.
* a step is complete only once its manifest parses, validates and names its job and step
  (:func:`manifest_facts`); one that does not is logged once per version and skipped.
* steps are ordered for ``latest`` by a fixed-size head of each manifest (:func:`commit_order`: the envelope as
  :func:`ckptd.format.encode_manifest` writes it, up to ``committed_at``); only the one a lookup answers with is read whole.

What a manifest says is cached per version (the tag of the listing it was read after). Blocks on the network: the
daemon's upload, fetch and lookup threads.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from .. import protocol
from ..config import MAX_DOCUMENT_BYTES
from ..errors import FormatError
from ..format import MAX_HEADER_BYTES, commit_time, objects_folder
from ..layout import MANIFEST, bucket_key, bucket_prefix, fragment_rank, parse_bucket_key, shard_name
from ..validate import I64_MAX, parse_manifest
from .store import ObjectStore, SizedStore

log = logging.getLogger("ckptd.daemon")

Objects = dict[str, tuple[str, int | None]]  # name under a prefix -> (tag, size in bytes; None: the store does not tell)

DOCUMENT_SLACK = 64 << 10  # on top of each bound: a document's envelope, a step's lists of files and ranks
MANIFEST_PER_FRAGMENT_BYTE = 2  # a manifest merges its step's fragments, each chunk in fewer bytes than a fragment's
FRAGMENT_PER_SHARD_BYTE = 4  # a fragment's chunk table against its shard's header, which lists the same chunks (< 2x)
TREE_PER_FRAME_BYTE = 3  # a rank's tree: a frame a trainer may commit, written back with JSON's ASCII escapes (<= 3x)
HEAD_BYTES = 4096  # what ordering a step reads of its manifest: the envelope up to committed_at (~300 bytes)


def list_objects(store: ObjectStore, prefix: str) -> Objects:
    """Every key under ``prefix`` with its tag and size: one listing."""
    if isinstance(store, SizedStore):
        return {k: (tag, size) for k, (tag, size) in store.list_sized(prefix).items()}
    return {k: (tag, None) for k, tag in store.list_tagged(prefix).items()}


def step_objects(store: ObjectStore, job: str, step: int) -> Objects | None:
    """The objects under the step's prefix, listed where the store tells sizes (else ``None``, and no request)."""
    if not isinstance(store, SizedStore):
        return None
    prefix = bucket_prefix(job, step)
    return {k[len(prefix) :]: v for k, v in list_objects(store, prefix).items()}


def manifest_limit(objects: Objects | None, ceiling: int = MAX_DOCUMENT_BYTES) -> int:
    """The most bytes a real manifest of a step holding ``objects`` can have: it merges the fragments every rank
    uploaded before it (each attempt's under the prefix counted), so a multiple of their sizes. ``ceiling`` without
    sizes; never more."""
    if objects is None or any(size is None for _, size in objects.values()):
        return ceiling
    frags = sum(size or 0 for name, (_, size) in objects.items() if fragment_rank(name.rpartition("/")[2]) is not None)
    return min(ceiling, DOCUMENT_SLACK + MANIFEST_PER_FRAGMENT_BYTE * frags)


def fragment_limit(objects: Objects | None, folder: str, rank: int, ceiling: int = MAX_DOCUMENT_BYTES) -> int:
    """The most bytes a real fragment of ``rank`` (in ``folder``) can have: its chunk table, a multiple of its shard's
    header (no longer than the shard), and its rank's tree. ``ceiling`` without its shard's size; never more."""
    shard = None if objects is None else objects.get(folder + shard_name(rank), ("", None))[1]
    if shard is None:
        return ceiling
    tree = TREE_PER_FRAME_BYTE * protocol.MAX_MESSAGE_BYTES  # read now: the daemon's limit on a committed tree
    return min(ceiling, DOCUMENT_SLACK + FRAGMENT_PER_SHARD_BYTE * min(shard, 8 + MAX_HEADER_BYTES) + tree)


def read_document(store: ObjectStore, key: str, listed: tuple[str, int | None] | None, limit: int) -> bytes:
    """The bytes of ``key``, at most ``limit``: one its listing (``listed``: tag, size) shows larger is refused before
    a byte is read, one that grew since stops as it arrives (:class:`FormatError` either way)."""
    if listed is not None and listed[1] is not None and listed[1] > limit:
        raise FormatError(
            f"{store.url(key)} is larger than the {limit} bytes expected ({listed[1]} bytes listed),"
            " more than a real one of its step can be; not read"
        )
    return store.get_bytes(key, limit=limit)


def get_document(store: ObjectStore, key: str, ceiling: int = MAX_DOCUMENT_BYTES) -> bytes:
    """A manifest or fragment from the bucket, refused past what a real one of its step can be (:func:`manifest_limit`,
    :func:`fragment_limit`; the step is listed once, where the store tells sizes); never past ``ceiling``."""
    job = key.partition("/")[0]
    parsed = parse_bucket_key(job, key)
    if parsed is None:
        return store.get_bytes(key, limit=ceiling)
    step, name = parsed
    objects = step_objects(store, job, step)  # a name it misses is still read by its key: a cached listing may lag
    folder, _, base = name.rpartition("/")
    rank = fragment_rank(base)
    if name == MANIFEST:
        limit = manifest_limit(objects, ceiling)
    else:
        limit = ceiling if rank is None else fragment_limit(objects, folder + "/" if folder else "", rank, ceiling)
    return read_document(store, key, None if objects is None else objects.get(name), limit)


def valid_manifest(store: ObjectStore, job: str, step: int, raw: bytes) -> dict[str, Any] | None:
    """``raw``, the bucket's manifest of step ``step``, parsed and validated (:func:`ckptd.validate.parse_manifest`), or
    ``None``, logged, when it is not a manifest of that step."""
    where = store.url(bucket_key(job, step, MANIFEST))
    try:
        manifest = parse_manifest(raw, where)
        if (manifest["job"], manifest["step"]) != (job, step):
            raise FormatError(f"{where} describes job {manifest['job']} step {manifest['step']}")
    except FormatError as e:
        log.warning("step %s of job %s does not count as complete in the bucket: %s", step, job, e)
        return None
    return manifest


@dataclass(frozen=True)
class _Known:
    """What one version of a step's manifest in the bucket says."""

    tag: str | None  # its tag in the listing it was read after (None: read without one)
    at: int | None  # its committed_at; None: it is not a manifest of its step (it failed validation)
    folder: str | None  # where its files lie; None: only its head was read, not validated yet


# (bucket url, job, step) -> what its manifest says; a manifest changes only when a rollback re-save replaces its step,
# maybe by other nodes' daemons (or when someone writes over it): the tag of a listing tells
_known: dict[tuple[str, str, int], _Known] = {}


def forget_commit(store: ObjectStore, job: str, step: int) -> None:
    """This process deleted, replaced or completed the bucket's step: what was read of its manifest may be stale."""
    _known.pop((store.url(), job, step), None)


def _remember(store: ObjectStore, job: str, step: int, known: _Known) -> _Known:
    if len(_known) > 65536:
        _known.clear()
    _known[(store.url(), job, step)] = known
    return known


def manifest_facts(
    store: ObjectStore, job: str, step: int, tag: str | None = None, objects: Objects | None = None, ceiling: int = MAX_DOCUMENT_BYTES
) -> tuple[int, str] | None:
    """``(committed_at, folder of its files)`` of the bucket's manifest of step ``step`` once it validates; ``None`` if
    it does not (logged) or is gone (another node's retention). Read whole once per version, bounded by ``objects``
    (the step's, listed here if not given): ``tag``, the manifest's tag in a listing just made, tells a replaced
    manifest from the one read before; without it the value read before stands (this process forgets it when it
    deletes or uploads the step). A manifest whose head (:func:`commit_order`) told another commit time is no manifest."""
    known = _known.get((store.url(), job, step))
    if known is not None and (tag is None or known.tag == tag) and (known.at is None or known.folder is not None):
        return None if known.at is None or known.folder is None else (known.at, known.folder)
    if objects is None:
        objects = step_objects(store, job, step)
    if objects is not None:
        if MANIFEST not in objects:
            forget_commit(store, job, step)
            return None
        tag = objects[MANIFEST][0]  # the version about to be read
    head = known.at if known is not None and known.tag == tag else None  # what its head said, if that was read
    key = bucket_key(job, step, MANIFEST)
    try:
        raw = read_document(store, key, None if objects is None else objects.get(MANIFEST), manifest_limit(objects, ceiling))
    except FileNotFoundError:
        forget_commit(store, job, step)
        return None
    except FormatError as e:  # larger than a manifest of its step can be
        log.warning("step %s of job %s does not count as complete in the bucket: %s", step, job, e)
        _remember(store, job, step, _Known(tag, None, None))
        return None
    manifest = valid_manifest(store, job, step, raw)
    if manifest is not None and head is not None and commit_time(manifest) != head:  # a key given twice: not ckptd's
        log.warning("step %s of job %s does not count as complete in the bucket: its manifest's head says it was"
                    " committed at %s, the whole manifest at %s", step, job, head, commit_time(manifest))  # fmt: skip
        manifest = None
    if manifest is None:
        _remember(store, job, step, _Known(tag, None, None))
        return None
    _remember(store, job, step, _Known(tag, commit_time(manifest), objects_folder(manifest)))
    return commit_time(manifest), objects_folder(manifest)


def _head_pattern(job: str, step: int) -> re.Pattern[bytes]:
    """A manifest's envelope as :func:`ckptd.format.encode_manifest` writes it, up to ``committed_at`` (group 1)."""
    return re.compile(
        rb'\{"format_version":[12],"kind":"ckptd-manifest","job":"%s","step":%d,"world_size":[1-9][0-9]{0,6},'
        rb'"created_unix":[-+.eE0-9]{1,32},"committed_at":(0|[1-9][0-9]{0,18}),"' % (re.escape(job).encode(), step)
    )


def commit_order(store: ObjectStore, job: str, step: int, tag: str | None, objects: Objects | None = None) -> int | None:
    """When the bucket's manifest of step ``step`` says it was committed, to order steps by: from its first
    :data:`HEAD_BYTES` alone where the store reads heads (whatever the manifest's size; validated when it is the
    newest, by :func:`manifest_facts`), else from the whole manifest, validated. ``None``: gone, or known to be no
    manifest. A head not as this ckptd writes it (an older one's, a hostile one) is judged whole, bounded."""
    known = _known.get((store.url(), job, step))
    if known is not None and (tag is None or known.tag == tag):
        return known.at
    if not isinstance(store, SizedStore):
        facts = manifest_facts(store, job, step, tag, objects)
        return None if facts is None else facts[0]
    try:
        head, size = store.get_head(bucket_key(job, step, MANIFEST), HEAD_BYTES)
    except FileNotFoundError:
        forget_commit(store, job, step)
        return None
    m = _head_pattern(job, step).match(head)
    if size <= len(head) or m is None or int(m.group(1)) > I64_MAX:  # all of it read, or a head to read whole
        facts = manifest_facts(store, job, step, tag, objects)
        return None if facts is None else facts[0]
    return _remember(store, job, step, _Known(tag, int(m.group(1)), None)).at
