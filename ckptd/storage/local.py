"""The local-disk tier: make staged shards durable and complete steps atomically (layout in
:mod:`ckptd.layout`).

Order of calls: :func:`write_shard` once per rank (any thread; a :class:`ShardWrite` is the shard and what its fragment
records, a :class:`WritePolicy` how it is written), then :func:`finalize_step` by whoever
observes every rank's fragment (the daemon serializes it per job; across daemons the rename of
``step-N.tmp`` arbitrates), then :func:`apply_retention`. A step directory without ``manifest.json``
is never named by ``latest`` and is removed on restart. Blocking disk I/O: the daemon's persist
threads call the writers; :func:`latest_step` is also read by trainers and tools (no daemon needed).

**Which step is the latest**: the complete step *committed* last (the manifest's ``committed_at``),
not the highest step number. A user who rolls back (restores step 100 of 100, 200, 300) and trains
on saves 110, 120: those are the current line, ``latest`` names them, and retention keeps the
newest steps in commit order, so it drops 200 and 300 (the abandoned branch) before any step of the
new line. ``latest`` moves only forward in commit order; the steps of one line complete in any order.
Every writer of ``latest`` and every retention pass of a job holds :func:`job_lock`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import xxhash

from .. import format as fmt
from ..errors import CheckpointError, FormatError, write_failed
from ..files import create_new, fsync_dir, write_durable, write_json_durable
from ..format import MAX_HEADER_BYTES, ShardLayout, ShardOf, attempt_of, build_fragment, build_manifest, commit_time, digest, parse_header
from ..layout import (
    MANIFEST,
    complete_steps,
    fragment_name,
    is_complete,
    job_dir,
    latest_file,
    node_dir,
    replaced_dir,
    shard_name,
    step_dir,
    tmp_dir,
    trash_dir,
    trashed_steps,
)
from ..validate import parse_fragment, read_regular
from .direct import StreamWriter, reserve
from .retention import Protect, RetentionPolicy, doomed

log = logging.getLogger("ckptd.daemon")
_locks: dict[tuple[str, str], threading.RLock] = {}
_locks_guard = threading.Lock()
_order_cache: dict[tuple[str, int, int], int] = {}  # (manifest path, inode, mtime) -> committed_at


def job_lock(root: str, job: str) -> threading.RLock:
    """The one lock that serializes completing steps, moving ``latest`` and retention of a job in
    this process (persist, upload and fetch threads). Reentrant: completing a step moves ``latest``."""
    with _locks_guard:
        return _locks.setdefault((os.path.abspath(root), job), threading.RLock())


COPY_BLOCK = 8 << 20  # bytes written at a time (a multiple of direct.ALIGN: written direct)
PIECE_BYTES = 1 << 20  # bytes read and then hashed at a time, within a core's L2 cache (hashing a whole block after
# reading it took every byte from memory once more)


def _reader(source: Any) -> Callable[[memoryview, int], int]:
    """``read(into, pos)`` over a staged shard: a file descriptor (a daemon segment, read with ``pread``: a
    segment its lessee truncates is then a short read, not a SIGBUS in the daemon) or a buffer (tests, tools)."""
    if isinstance(source, int):
        return lambda into, pos: os.preadv(source, [into], pos)
    view = memoryview(source).cast("B")

    def read(into: memoryview, pos: int) -> int:
        n = max(0, min(len(into), len(view) - pos))
        into[:n] = view[pos : pos + n]
        return n

    return read


def _read_exactly(read: Callable[[memoryview, int], int], into: memoryview, pos: int, nbytes: int) -> None:
    got = 0
    while got < len(into):
        n = read(into[got:], pos + got)
        if n == 0:
            raise FormatError(f"the staged shard ends at byte {pos + got}, not {nbytes}: its segment was truncated")
        got += n


def read_header(source: Any, nbytes: int) -> bytes:
    """The header bytes of a staged shard of ``nbytes`` (``source`` as :func:`write_shard` takes it): its
    length first, bounded before the rest is read."""
    return _header(_reader(source), nbytes)


def _header(read: Callable[[memoryview, int], int], nbytes: int) -> bytes:
    head = bytearray(8)
    _read_exactly(read, memoryview(head), 0, nbytes)
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > nbytes:
        raise FormatError(f"shard header length {n} out of bounds (shard holds {nbytes} bytes)")
    buf = bytearray(8 + n)
    _read_exactly(read, memoryview(buf), 0, nbytes)
    return bytes(buf)


@dataclass(frozen=True)
class WritePolicy:
    """How the local tier writes shards: the daemon's settings, the same for every shard.

    Attributes:
        rate_limit: bytes per second at most (0: unlimited), so that training I/O is not starved.
        direct_io: write past the page cache (``O_DIRECT``) where the file system takes it (:mod:`ckptd.storage.direct`).
    """

    rate_limit: float = 0.0
    direct_io: bool = True

    def __post_init__(self) -> None:
        if not self.rate_limit >= 0:  # NaN too
            raise ValueError(f"write rate limit {self.rate_limit} is not a number of bytes per second >= 0 (0: unlimited)")


@dataclass(frozen=True)
class ShardWrite:
    """One rank's committed shard, for :func:`write_shard` to make durable in its step's ``step-N.tmp``.

    Built once, and checked then, by whoever holds the commit (a persist thread of the daemon, a test, a tool); the
    storage layer takes it as it is. The optional fields are keyword-only.

    Attributes:
        job: the job, as it names the job's directory.
        step: the step number.
        rank: which rank's shard (it names the shard's and the fragment's files).
        world_size: how many ranks the step has.
        source: the staged shard: a segment's file descriptor (read with ``pread``, never mapped) or a buffer.
        nbytes: how many bytes of ``source`` the shard is, header included.
        tree: the rank's non-tensor state, recorded in the fragment.
        local_world_size: how many of the step's ranks this node writes (``None``: all of them); fewer than
            ``world_size``: a multi-node step, completed through the bucket.
        replicas: chunk id -> sample digest of each chunk other ranks hold too.
        committed_at: when the daemon accepted the commit (ns since the epoch): it orders steps.
        run: the launch that saved it (``None``: not known); with ``after``, the step that launch last restored,
            it names the attempt (:func:`ckptd.format.build_fragment`).
        after: see ``run``.

    Raises:
        ValueError: a rank outside the world, a local world larger than the world, a negative step or size.
        TypeError: ``replicas`` not a dict.
    """

    job: str
    step: int
    rank: int
    world_size: int
    source: Any
    nbytes: int
    tree: dict[str, Any]
    _: KW_ONLY
    local_world_size: int | None = None
    replicas: dict[str, str] = field(default_factory=dict)
    committed_at: int = 0
    run: int | None = None
    after: int | None = None

    def __post_init__(self) -> None:
        what = f"shard of job {self.job!r} step {self.step} rank {self.rank}"
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{what}: rank {self.rank} is outside world_size {self.world_size}")
        if self.local_world_size is not None and not 1 <= self.local_world_size <= self.world_size:
            raise ValueError(f"{what}: local_world_size {self.local_world_size} is not within 1..world_size ({self.world_size})")
        if self.step < 0 or self.nbytes < 0:
            raise ValueError(f"{what}: a step number and a size are never negative (step {self.step}, {self.nbytes} bytes)")
        if not isinstance(self.replicas, dict):  # None was how the old signature said "none": a fragment no reader takes
            raise TypeError(f"{what}: replicas must be a dict (chunk id -> digest), not {type(self.replicas).__name__}")


def _copy_paced(
    read: Callable[[memoryview, int], int], fd: int, layout: ShardLayout, nbytes: int, policy: WritePolicy
) -> tuple[str, dict[str, str]]:
    """Write the header as parsed (the lessee may have changed the segment's copy since), then copy the
    chunks' bytes block by block into the writer's buffers, hashing each piece of a block right after it is read and
    before the block is written (what is hashed is what is written, whatever the lessee does to its segment meanwhile); return the
    header's and each chunk's XXH3-64 (as :func:`build_fragment` takes them). Written with direct I/O where the file
    system takes it and ``policy`` says so (:mod:`ckptd.storage.direct`), paced to ``policy.rate_limit`` (bytes/s, 0 = unlimited)
    so training I/O is not starved."""
    head, names = layout.header, [c.name for c in layout.chunks]
    ends = [layout.data_start + c.end for c in layout.chunks]
    hashers = [xxhash.xxh3_64() for _ in names]
    rate_limit = policy.rate_limit
    reserve(fd, nbytes)  # a full disk fails before the first byte
    t0, pos, part = time.monotonic(), 0, 0
    with StreamWriter(fd, COPY_BLOCK, nbytes, direct=policy.direct_io) as out:
        while pos < nbytes:
            with memoryview(out.block()) as whole, whole[: min(COPY_BLOCK, nbytes - pos)] as block:
                off = max(0, min(len(block), len(head) - pos))  # the header's bytes in this block
                block[:off] = head[pos : pos + off]
                while off < len(block):  # a piece at a time, hashed while it is in the core's cache
                    stop = min(len(block), off + PIECE_BYTES)
                    _read_exactly(read, block[off:stop], pos + off, nbytes)
                    while off < stop:
                        while ends[part] <= pos + off:  # an empty chunk ends where it begins
                            part += 1
                        take = min(stop, ends[part] - pos) - off
                        hashers[part].update(block[off : off + take])
                        off += take
                out.submit(len(block))
                pos += len(block)
            if rate_limit > 0 and (ahead := pos / rate_limit - (time.monotonic() - t0)) > 0:
                time.sleep(ahead)
        out.finish()
    return digest(layout.header), {name: h.hexdigest() for name, h in zip(names, hashers)}


def write_shard(root: str, shard: ShardWrite, policy: WritePolicy = WritePolicy()) -> None:
    """Write one staged shard (``shard.nbytes`` of ``shard.source``) and then its fragment into ``step-N.tmp`` under
    ``root`` durably, checksumming each chunk on the bytes written; written and paced as ``policy`` says.

    Raises :class:`CheckpointError` (full disk, bad header, a segment truncated); the partial files are removed.
    """
    read, nbytes, job, step = _reader(shard.source), shard.nbytes, shard.job, shard.step
    layout = parse_header(_header(read, nbytes), nbytes)
    if layout.file_size != nbytes:
        raise FormatError(f"staged shard is {nbytes} bytes but its header describes {layout.file_size}")
    d = tmp_dir(root, job, step)
    new_job = not os.path.isdir(job_dir(root, job))
    os.makedirs(d, exist_ok=True)
    if new_job:
        fsync_dir(root)  # the job's directory entry itself must survive a power loss
    path, frag_path = os.path.join(d, shard_name(shard.rank)), os.path.join(d, fragment_name(shard.rank))
    try:
        if os.path.exists(frag_path):
            os.unlink(frag_path)  # first: while the shard is rewritten, this rank does not count as durable
        fd = create_new(path)
        try:
            sums = _copy_paced(read, fd, layout, nbytes, policy)
            os.fsync(fd)
        finally:
            os.close(fd)
        frag = _fragment(shard, layout, sums)
        write_json_durable(frag_path, frag)  # last: a fragment present means its shard is durable
    except BaseException as e:  # whatever failed (a full disk, a truncated segment, no thread to write with): no partial files
        for p in (path, frag_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        if not isinstance(e, OSError):
            raise
        raise write_failed(path, e) from None


def _fragment(shard: ShardWrite, layout: ShardLayout, sums: tuple[str, dict[str, str]]) -> dict[str, Any]:
    """The fragment recording ``shard``, written as ``layout`` says, with the checksums :func:`_copy_paced` returned."""
    of = ShardOf(
        job=shard.job, step=shard.step, rank=shard.rank, world_size=shard.world_size,
        local_world_size=shard.local_world_size or shard.world_size, replicas=shard.replicas, tree=shard.tree,
        committed_at=shard.committed_at, run=shard.run, after=shard.after,
    )  # fmt: skip
    return build_fragment(of, layout.header, layout, sums=sums)


def read_fragment(root: str, job: str, step: int, rank: int, directory: str | None = None) -> dict[str, Any]:
    path = os.path.join(directory or tmp_dir(root, job, step), fragment_name(rank))
    return parse_fragment(read_regular(path), path)


def fragment_sizes(root: str, job: str, step: int, ranks: set[int]) -> tuple[int | None, int | None]:
    """World size and local world size recorded in a partial step's fragments, if one is readable."""
    for r in sorted(ranks):
        try:
            frag = read_fragment(root, job, step, r)
            ws = int(frag["world_size"])
            return ws, int(frag.get("local_world_size", ws))
        except (OSError, FormatError):
            continue
    return None, None


def partial_run(root: str, job: str, step: int, ranks: set[int]) -> int | None:
    """The run (launch) that wrote the fragments of partial step ``step`` when it can still complete: every
    one of ``ranks`` readable and naming that run, and no complete step of the job committed after them (its
    ranks moved on). ``None`` otherwise."""
    runs: set[int | None] = set()
    at = 0
    for r in ranks:
        try:
            frag = read_fragment(root, job, step, r)
        except (OSError, FormatError):
            return None
        runs.add((attempt_of(frag) or (None, None))[0])
        at = max(at, commit_time(frag))
    _, last = latest_step(root, job)
    if len(runs) != 1 or None in runs or (last is not None and committed_at(last) > at):
        return None
    return runs.pop()


def hand_over(root: str, job: str, step: int) -> str:
    """Move this node's whole part of a multi-node step out of ``step-N.tmp`` into a directory of its own (a new
    attempt at the number writes a fresh ``step-N.tmp``), for the upload thread; returns it. Under the job's lock."""
    os.rename(tmp_dir(root, job, step), d := node_dir(root, job, step, secrets.token_hex(4)))
    with contextlib.suppress(OSError):  # moved whatever the sync says (a crash that undoes it leaves a whole .tmp, moved again)
        fsync_dir(job_dir(root, job))
    return d


def finalize_step(root: str, job: str, step: int, world_size: int) -> str:
    """Merge all fragments into ``manifest.json``, rename ``step-N.tmp`` to ``step-N``, move ``latest``.

    Returns the complete step's directory. Call only when every rank's fragment is present.
    """
    d, final = tmp_dir(root, job, step), step_dir(root, job, step)
    frags = [read_fragment(root, job, step, r) for r in range(world_size)]
    manifest = build_manifest(job, step, world_size, frags)
    old = os.path.exists(final)
    if old and manifest["committed_at"] <= committed_at(final):
        raise CheckpointError(f"{final} already exists: a complete checkpoint is never overwritten")
    write_durable(os.path.join(d, MANIFEST), fmt.encode_manifest(manifest))
    if old:  # saved again by a run rolled back past it (admitted by the daemon): the newer commit replaces it
        _swap(root, job, step)
    else:
        os.rename(d, final)
        _sync_renamed(root, job, step)
    try:
        update_latest(root, job, step)
    except OSError as e:  # the step is complete and durable all the same; latest_step() finds it by its manifest
        log.error("step %s of job %s is complete but %s could not be updated: %s", step, job, latest_file(root, job), e)
    return final


def _swap(root: str, job: str, step: int) -> None:
    """Put the complete ``step-N.tmp`` in the place of the complete ``step-N`` it replaces. The old one is
    moved aside intact (``step-N.old``) and deleted only once the new one is in place: a failure in
    between moves it back, and a crash in between leaves it to recovery (:func:`settle_replaced`)."""
    d, final, old = tmp_dir(root, job, step), step_dir(root, job, step), replaced_dir(root, job, step)
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    try:
        os.rename(d, final)
    except OSError:
        os.rename(old, final)
        raise
    if _sync_renamed(root, job, step):  # else the old one stays aside until recovery settles it
        shutil.rmtree(old, ignore_errors=True)
    log.info("step %s of job %s replaced by a newer commit of the same number (a rollback)", step, job)


def _sync_renamed(root: str, job: str, step: int) -> bool:
    """fsync the job directory after ``step-N.tmp`` was renamed to ``step-N``. A failure is logged, not
    raised: every file of the step is durable already, and should the rename itself be lost, recovery
    finds ``step-N.tmp`` with its manifest and finalizes it again; reporting the step failed would be false.
    Returns whether the sync succeeded."""
    try:
        fsync_dir(job_dir(root, job))
    except OSError as e:
        log.error("step %s of job %s is complete, but syncing its rename into place failed: %s", step, job, e)
        return False
    return True


def settle_replaced(root: str, job: str, step: int) -> bool:
    """Recovery, after the partial steps were finished: a ``step-N.old`` whose replacement is in place is
    deleted; one whose replacement could not be finalized is moved back (returns True)."""
    old, final = replaced_dir(root, job, step), step_dir(root, job, step)
    if os.path.exists(final) or not is_complete(old):
        shutil.rmtree(old, ignore_errors=True)
        return False
    os.rename(old, final)
    fsync_dir(job_dir(root, job))
    return True


def _to_trash(root: str, job: str, step: int) -> str:
    """Rename complete step ``step`` to ``step-N.del`` (out of the committed namespace in one rename),
    finishing first a delete of that number still under way; returns the new path. Call with the job's
    lock held, and fsync the job directory."""
    if os.path.exists(trash := trash_dir(root, job, step)):
        shutil.rmtree(trash, ignore_errors=True)
    # an older step of this number kept aside when this one replaced it (its sync failed): it goes first, or
    # recovery would take it for an unfinished replacement and move the abandoned line's step back
    if os.path.lexists(aside := replaced_dir(root, job, step)):
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(step_dir(root, job, step), trash)
    return trash


def retire_step(root: str, job: str, step: int, committed: int) -> threading.Thread:
    """On a thread: take complete step ``step`` out of the committed namespace (renamed ``step-N.del``
    under the job's lock) and delete it, if it is still the one committed at ``committed`` (a rolled-back
    run's re-save of it is complete in memory, or is a multi-node step whose local copy is only a cache
    of the bucket's; a newer step of that number, in place by then, stays)."""

    def run() -> None:
        try:
            trash = retire_now(root, job, step, committed)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
        except OSError as e:  # a later replacement or retention removes it; restores of the number read the newer step
            log.error("could not remove the replaced step %s of job %s: %s", step, job, e)

    (t := threading.Thread(target=run, name=f"ckptd-retire-{step}", daemon=True)).start()
    return t


def retire_now(root: str, job: str, step: int, committed: int) -> str | None:
    """Under the job's lock: take complete step ``step`` out of the committed namespace if it is still the one
    committed at ``committed``; returns the directory it now is in, for the caller to delete (``None``: kept)."""
    d = step_dir(root, job, step)
    with job_lock(root, job):
        if not is_complete(d) or committed_at(d) != committed:
            return None
        trash = _to_trash(root, job, step)
        fsync_dir(job_dir(root, job))
    return trash


def read_latest(root: str, job: str) -> int | None:
    """The step number in ``latest``, or ``None`` (missing or unreadable). Not checked for completeness."""
    try:
        text = read_regular(latest_file(root, job), 64).decode("ascii").strip()
    except (OSError, UnicodeDecodeError, FormatError):
        return None  # missing, unreadable, a directory: latest_step() falls back to the manifests
    return int(text) if text.isdigit() else None


def committed_at(path: str) -> int:
    """When the complete step at ``path`` was committed (its manifest's ``committed_at``; 0 for a
    manifest written before ckptd recorded it, or one that cannot be read). Cached: manifests never change."""
    man = os.path.join(path, MANIFEST)
    try:
        st = os.stat(man)
    except OSError:
        return 0
    key = (man, st.st_ino, st.st_mtime_ns)
    if key not in _order_cache:
        try:
            value = commit_time(read_regular(man))
        except (OSError, FormatError):
            value = 0
        if len(_order_cache) > 65536:
            _order_cache.clear()
        _order_cache[key] = value
    return _order_cache[key]


def steps_by_commit(root: str, job: str) -> list[int]:
    """The complete local steps of ``job``, oldest commit first (ties, and old manifests, by step number)."""
    return sorted(complete_steps(root, job), key=lambda s: (committed_at(step_dir(root, job, s)), s))


def update_latest(root: str, job: str, step: int) -> None:
    """Point ``latest`` at the complete step ``step`` unless it names a complete step committed later."""
    with job_lock(root, job):
        cur = read_latest(root, job)
        if cur is not None and cur != step and is_complete(step_dir(root, job, cur)):
            if (committed_at(step_dir(root, job, cur)), cur) > (committed_at(step_dir(root, job, step)), step):
                return
        write_durable(latest_file(root, job), f"{step}\n".encode())


def latest_step(root: str, job: str) -> tuple[int | None, str | None]:
    """The latest complete local step of ``job`` and its directory, or ``(None, None)``: the complete
    step committed last, by the manifests. The ``latest`` file decides only among steps committed at
    the same time (manifests written before ckptd recorded ``committed_at``), so a ``latest`` that could
    not be written, or names a removed step, never hides the step committed last."""
    steps = steps_by_commit(root, job)
    if not steps:
        return None, None
    last = steps[-1]
    cur = read_latest(root, job)
    if cur is not None and cur != last and is_complete(step_dir(root, job, cur)):
        if committed_at(step_dir(root, job, cur)) >= committed_at(step_dir(root, job, last)):
            last = cur
    return last, step_dir(root, job, last)


def resolve_step_dir(path: str) -> str:
    """Accept a step directory, or a job directory (then its ``latest`` committed step). No torch: ``ckptd verify``
    and ``export`` resolve their argument with it."""
    if is_complete(path):
        return path
    if os.path.isdir(path):
        _, d = latest_step(os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path)))
        if d is not None:
            return d
    raise CheckpointError(f"{path} is neither a committed ckptd step directory nor a job directory with one")


def remove_partial(root: str, job: str, step: int) -> None:
    shutil.rmtree(tmp_dir(root, job, step), ignore_errors=True)


def apply_retention(root: str, job: str, policy: RetentionPolicy | Callable[[], RetentionPolicy]) -> list[int]:
    """Remove the complete steps of ``job`` that ``policy`` (a callable: asked under the job's lock) does not keep
    (given them in commit order), never the one ``latest`` names; returns them. Each is renamed to ``step-N.del``
    under the job's lock, then deleted outside it. Partial steps are left to the daemon."""
    with job_lock(root, job):
        policy = policy() if callable(policy) else policy
        latest, _ = latest_step(root, job)
        keep_latest = Protect(frozenset([latest] if latest is not None else []))
        removed = [s for s in doomed(policy, steps_by_commit(root, job)) if not keep_latest.keeps([s])]
        for s in removed:
            _to_trash(root, job, s)
        if removed:
            fsync_dir(job_dir(root, job))
    for s in removed:
        shutil.rmtree(trash_dir(root, job, s), ignore_errors=True)
    return sorted(removed)


def empty_trash(root: str, job: str) -> list[int]:
    """Finish deleting the steps a crash left half-deleted by retention (``step-N.del``); returns them."""
    steps = trashed_steps(root, job)
    for s in steps:
        shutil.rmtree(trash_dir(root, job, s), ignore_errors=True)
    return steps
