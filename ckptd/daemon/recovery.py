"""Crash recovery at start-up: what a previous run of this daemon left in shared memory and under
the root, finished or cleaned up before the first request is served.

* A segment with a commit record holds a rank's committed shard: it is adopted and persisted again,
  unless its step is already complete (the previous run finalized it just before dying).
* A step retention was deleting when the daemon died (``step-N.del``) is deleted.
* A step a rolled-back run's re-save was replacing (``step-N.old``) is deleted once the new one is in
  place (finalized below), or moved back if that fails.
* A partial step (``step-N.tmp``) whose every fragment is present is finalized; this node's whole
  part of a multi-node step is moved into a directory of its own and handed to the uploader again (the
  other nodes wait for it); one that recovered shards can still complete is kept; any other is removed.
* This node's part of a multi-node step already handed over (``step-N.node-*``) is uploaded again,
  the newest attempt's only: one that a newer attempt at the number (recovered shards, a partial step)
  replaced is removed.

Main thread, before the loop starts: persist and upload threads only run what this hands them.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable

from .. import shm
from ..errors import CheckpointError, FormatError, ProtocolError
from ..format import commit_time
from ..layout import (
    fetch_dir,
    fetching_steps,
    fragments_present,
    is_complete,
    node_parts,
    partial_steps,
    replaced_steps,
    shard_name,
    step_dir,
)
from ..protocol import CommitRecord, validate_record
from ..storage import local
from .persister import Persister
from .slots import Slot, SlotPool, SlotState
from .steps import StepTable
from .uploader import Uploader

log = logging.getLogger("ckptd.daemon")


def adopt_segments(pool: SlotPool, steps: StepTable, root: str) -> None:
    """Adopt committed-but-not-durable segments of this daemon's directory; drop the rest. A file it
    cannot trust (not its own, a symlink, a record that does not check out) is logged and skipped,
    never adopted and never fatal."""
    segs = pool.segments
    found, strays = segs.names()
    for entry in strays:  # a torn record's temporary file, or something that is not ours to keep
        log.warning("removing %s/%s: not a segment of this daemon", segs.path, entry)
        segs.remove_stray(entry)
    for name in found:
        try:
            adopt_segment(pool, steps, root, name)
        except (shm.Untrusted, ProtocolError) as e:
            log.warning("ignoring segment %s: %s", name, e)
            if not isinstance(e, shm.Untrusted):
                segs.unlink(name)  # our own file with a record that does not check out: nothing to recover
        except OSError as e:
            log.warning("ignoring segment %s: %s", name, e)


def finished(root: str, rec: CommitRecord) -> bool:
    """The step of commit record ``rec`` is complete on disk, with this commit in it: a complete step of that
    number committed before it is the old line's, which a rolled-back run's re-save replaces once persisted."""
    path = step_dir(root, rec.job, rec.step)
    return is_complete(path) and local.committed_at(path) >= rec.committed_at


def _handed_over(root: str, rec: CommitRecord) -> bool:
    """The shard of commit record ``rec`` is in this node's part of its multi-node step, handed to the uploader (the
    crash came after the persist thread moved it, before the record was dropped)."""
    for d in node_parts(root, rec.job).get(rec.step, []):
        try:
            if commit_time(local.read_fragment(root, rec.job, rec.step, rec.rank, d)) == rec.committed_at:
                return True
        except (OSError, FormatError):
            continue
    return False


def adopt_segment(pool: SlotPool, steps: StepTable, root: str, name: str) -> None:
    """Adopt one segment if its commit record is sound and its step still needs it; else unlink it."""
    segs = pool.segments
    segs.take_over(name)  # Untrusted unless it is our own regular file; this run's mode and group from here on
    size = segs.size_of(name)
    got = segs.read_record(name)
    if got is None:
        segs.unlink(name)  # never committed (or the record is torn: never acknowledged)
        return
    rec = validate_record(*got)  # the disk edge: a record that does not check out is never adopted
    if rec.nbytes > size:
        raise ProtocolError(f"its record claims {rec.nbytes} bytes, the segment has {size}")
    if finished(root, rec):
        segs.unlink(name)  # finalized just before the crash: nothing left to do
        return
    if rec.rank in fragments_present(root, rec.job, rec.step) or _handed_over(root, rec):
        # its shard and fragment are durable (the crash came before the record was dropped): writing it
        # again would truncate a shard another rank's completion may publish; the partial step has it
        segs.unlink(name)
        return
    known = steps.get((rec.job, rec.step))
    sizes = (rec.world_size, rec.local_world_size)
    if known is not None and ((known.world_size, known.local_world_size) != sizes or rec.rank in known.committed):
        raise ProtocolError(f"its record (rank {rec.rank} of {rec.world_size}) contradicts another segment of step {rec.step}")
    track = steps.adopt((rec.job, rec.step), rec.world_size, rec.local_world_size)
    pool.adopt(name, size, rec)
    track.committed.add(rec.rank)
    track.run = track.run if track.run is not None else rec.run  # its ranks still to commit join it
    at = rec.committed_at  # its first commit's time orders the job's steps
    if at and (not track.committed_at or at < track.committed_at):
        track.committed_at = at
    log.info("recovered committed shard %s: job %s step %s rank %s", name, rec.job, rec.step, rec.rank)


def finish_partial_step(root: str, job: str, step: int, steps: StepTable, persister: Persister, uploader: Uploader | None) -> None:
    """Finalize, re-upload, keep or remove one ``step-N.tmp`` a previous run left."""
    present = fragments_present(root, job, step)
    track = steps.get((job, step))
    ws, lws = (track.world_size, track.local_world_size) if track else local.fragment_sizes(root, job, step, present)
    if ws and present >= set(range(ws)):
        try:
            path = local.finalize_step(root, job, step, ws)
            log.info("finalized step %s of job %s left complete by a previous run: %s", step, job, path)
        except (CheckpointError, OSError, ValueError) as e:
            log.error("cannot finalize leftover step %s of job %s: %s; removing it", step, job, e)
            local.remove_partial(root, job, step)
    elif track is None and ws and lws and lws < ws and len(present) == lws and uploader is not None:
        # this node's whole part of a multi-node step, durable here (the crash came before it was handed over)
        _upload_again(root, job, step, ws, lws, local.hand_over(root, job, step), steps, uploader)
    elif track is None and ws and (run := local.partial_run(root, job, step, present)) is not None:
        # every committed shard of it is durable here: the ranks of its run that had not committed yet may
        # still do so with this daemon; a later step of the job completing or committing abandons it
        log.info("keeping partial step %s of job %s (ranks %s of %s, run %s) for its other ranks", step, job, sorted(present), ws, run)
        track = steps.adopt((job, step), ws, lws)
        track.committed |= present
        track.run = run
    elif track is None:
        log.info("removing partial step %s of job %s (no staged shard can complete it)", step, job)
        local.remove_partial(root, job, step)
    else:
        track.committed |= present


def _upload_again(root: str, job: str, step: int, ws: int, lws: int, node: str, steps: StepTable, uploader: Uploader) -> None:
    """This node's whole part of a multi-node step, in ``node``: the previous run may have died before the bucket had
    it, and the other nodes wait for it (commit_timeout)."""
    present = fragments_present(root, job, step, node)
    log.info("uploading this node's part of step %s of job %s again (ranks %s)", step, job, sorted(present))
    track = steps.adopt((job, step), ws, lws)
    track.committed |= present
    uploader.submit(job, step, ws, sorted(present), node=node, attempt=track.attempt)


def finish_node_parts(root: str, job: str, steps: StepTable, uploader: Uploader | None) -> None:
    """The ``step-N.node-*`` directories of ``job``: the newest of a step uploaded again, unless a newer attempt at
    that number (recovered shards, a partial step) replaced it or there is no bucket; the others removed."""
    for d in (d for dirs in node_parts(root, job, gone=True).values() for d in dirs):
        log.info("removing %s: its attempt was given up (a relaunch saved the step again)", d)
        shutil.rmtree(d, ignore_errors=True)
    for step, dirs in node_parts(root, job).items():
        found = []
        for d in dirs:
            ranks = sorted(fragments_present(root, job, step, d))
            try:
                frag = local.read_fragment(root, job, step, ranks[0], d)
                ws, lws = int(frag["world_size"]), int(frag.get("local_world_size", 0))
                if len(ranks) == lws < ws and all(os.path.exists(os.path.join(d, shard_name(r))) for r in ranks):
                    found.append((commit_time(frag), d, ws, lws))
                    continue
            except (IndexError, OSError, FormatError, KeyError, TypeError, ValueError):
                pass
            log.warning("removing %s: not a whole part of a multi-node step", d)
            shutil.rmtree(d, ignore_errors=True)
        found.sort()
        # a newer attempt (recovered shards, a partial step) replaced them all; without a bucket none can complete
        newer = steps.get((job, step)) is not None or bool(fragments_present(root, job, step)) or uploader is None
        for _, d, _, _ in found if newer else found[:-1]:
            log.info("removing %s: a newer attempt at step %s of job %s replaced it, or no bucket is configured", d, step, job)
            shutil.rmtree(d, ignore_errors=True)
        if found and uploader is not None and not newer:
            _upload_again(root, job, step, found[-1][2], found[-1][3], found[-1][1], steps, uploader)


def recover(
    pool: SlotPool,
    steps: StepTable,
    persister: Persister,
    uploader: Uploader | None,
    root: str,
    jobs: list[str],
    persist: Callable[[Slot], None],
) -> None:
    """Everything above, then ``persist`` each adopted slot whose step is still incomplete; the slots of
    a step finalized just now from the fragments on disk are dropped and the step is durable."""
    adopt_segments(pool, steps, root)
    for job in jobs:
        for step in local.empty_trash(root, job):
            log.info("finished deleting step %s of job %s (retention was interrupted)", step, job)
        for step in fetching_steps(root, job):  # a download a crash cut short: none is under way before the daemon serves
            log.info("removing %s: its download was cut short", fetch_dir(root, job, step))
            shutil.rmtree(fetch_dir(root, job, step), ignore_errors=True)
        finish_node_parts(root, job, steps, uploader)
        for step in partial_steps(root, job):
            finish_partial_step(root, job, step, steps, persister, uploader)
        # a step moved aside for a rolled-back run's re-save: deleted if the new one is in place now, else back
        for step in replaced_steps(root, job):
            if local.settle_replaced(root, job, step):
                log.warning("step %s of job %s: its rolled-back re-save could not be finished; the old step is kept", step, job)
    for slot in pool:
        if slot.state is not SlotState.COMMITTED:
            continue
        rec = slot.committed()
        job, step = rec.job, rec.step
        path = step_dir(root, job, step)
        if finished(root, rec):  # every fragment was on disk: the previous run died just before finalizing
            steps.complete((job, step), path)
            pool.unlink(slot)
        else:
            persist(slot)
