"""Whether a rank's commit may start or join a step, and what an admitted commit ends.

A step is one run's: its shards must all come from the same attempt, or a restored model would be
a chimera of two runs. Main thread only (the daemon's loop), with the step table.

* **Abandoned steps.** Every rank of a job commits its snapshots in order, and the write plan's
  collective makes every rank finish committing one snapshot before any rank commits the next. So
  when a rank commits step T, another step of the job still missing ranks can never complete: its
  other ranks crashed (or a previous run's did). It is failed as *abandoned*, its partial files
  removed and its waiters answered (:meth:`Admission.committed`).
* **A new run meets an old attempt of the same step** (the trainer died after some ranks committed
  step S; the relaunch resumes before S and reaches S again): a pending step begun by another run
  (commits name their launch, see below) is abandoned first and the step starts afresh. So does one
  that failed (a shard that could not be written) or was dropped from memory, once nothing of it is
  being written: a relaunch can always save a step number again; the run that failed it cannot.
* **Two runs, one job.** Every commit names its launch (``run``, agreed by all its ranks). A job
  saved by one run is refused to another while a process of the first that committed is alive (two
  runs sharing a job name would restore each other's models); once they are gone, the new run takes
  the job over (a relaunch). Unknown peers (tcp) are not checked.
* **Rollback.** A step number that is already complete may be saved again only by a client that
  restored an earlier step of the job (``after`` < step: ``restore(step=k)`` then saving ``k+1``...;
  the client itself refuses to save one number twice after a restore): the old step of that number
  belongs to the abandoned line, and the new one replaces it when it is complete
  (:func:`ckptd.storage.local.finalize_step`: a newer commit of a complete number), so a crash in
  between leaves the old one. Anything else is refused: a fresh run never overwrites a complete
  checkpoint by accident. A multi-node step is complete in the bucket, not here: one this daemon
  remembers complete is replaced the same way, and in the bucket the new attempt's manifest takes the
  place of the old step's once every node has uploaded its ranks into the attempt's own folder
  (:func:`ckptd.storage.remote.check_replaces`, :func:`ckptd.storage.remote.try_complete`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ..errors import DaemonBusy, ProtocolError
from ..layout import step_dir
from ..storage import local
from ..storage.local import committed_at
from .holdings import Holdings
from .slot import started
from .steps import StepKey, StepState, StepTable, StepTrack

log = logging.getLogger("ckptd.daemon")

MAX_COMMITTERS = 256  # processes remembered per job's run before those gone are forgotten (each is checked for liveness)


def _another(track: StepTrack, run: int | None) -> bool:
    """A commit naming launch ``run`` comes from another run than the one that began ``track``."""
    return run is not None and track.run != run


Settle = Callable[[StepKey, StepTrack], None]  # answer a step's waiters and clean it up once it left pending


class Admission:
    def __init__(
        self,
        root: str,
        steps: StepTable,
        holdings: Holdings,
        settle: Settle,
        *,
        writing: Callable[[str, int], int] = lambda job, step: 0,
        give_up: Callable[[str, int, int], None] | None = None,
        drop_memory: Callable[[StepKey, str], bool] = lambda key, why: False,
    ) -> None:
        """``settle(key, track)``: answer a step's waiters and clean up once it left pending; ``writing(job, step)``: the
        persister's count of the step's shards being written (a new attempt never writes beside an old one's straggler);
        ``give_up(job, step, attempt)``: the uploader's, for a dead run's multi-node step a relaunch takes over (None
        without a bucket); ``drop_memory(key, why)``: the memory tier's, for a step a rolled-back run saves again."""
        self.root, self.steps, self.holdings, self._settle = root, steps, holdings, settle
        self._runs: dict[str, tuple[int | None, set[tuple[int, float]]]] = {}  # job -> (its run, (pid, start time) of committers)
        self.drop_memory, self.give_up, self.writing = drop_memory, give_up, writing

    def admit(
        self, job: str, step: int, rank: int, ws: int, lws: int, peer: int | None, after: int | None, run: int | None = None
    ) -> StepTrack:
        """The track a commit of ``rank`` to ``step`` joins (a fresh one when it starts the step);
        ``ProtocolError`` saying why when it may not. ``peer``: the committing process (``None`` or 0:
        unknown); ``after``: the step the client restored; ``run``: its launch."""
        key = (job, step)
        self._check_run(job, run, peer)
        if after is not None and after < step:  # a rolled-back run replaces a memory-only step of this number
            self.drop_memory(key, "replaced: a run rolled back to an earlier step saves this number again")
        track = self.steps.get(key)
        if (
            track is not None
            and track.state is StepState.PENDING
            and run is not None
            and track.run != run
            and (track.recovered or track.run is not None)
        ):
            # begun by a run that is gone (_check_run let this one take the job over), or recovered after a daemon
            # crash from a record of another (or no named) run. The same run's missing ranks may still commit:
            # those that lease after the restart join the step
            # this node's whole part of a dead run's multi-node step, gone to the uploader in a directory of its own: the
            # run's other nodes will never complete it (the bucket would keep it a chimera of runs otherwise), given up
            handed = track.all_committed and track.local_world_size < track.world_size and not track.inflight
            if track.all_committed and (not handed or self.give_up is None):  # busy: the client asks again until it is durable
                raise DaemonBusy(
                    f"step {step} of job {job}, saved by a previous run, is still being made durable: restore it, or save it"
                    " again in a moment"
                )
            if handed and self.give_up is not None:
                self.give_up(job, step, track.attempt)
            why = "its run ended before every node's ranks committed" if handed else "its run ended before every rank committed"
            self.steps.abandon(key, f"abandoned: {why}; a new run (rank {rank}) saves it again")
            self._settle(key, track)
        track = self.steps.get(key)
        if track is not None and track.state in (StepState.FAILED, StepState.DROPPED) and (track.abandoned or _another(track, run)):
            # abandoned, or failed (a shard that could not be written) and saved again by a relaunch
            if track.inflight or self.writing(job, step):
                raise _busy(job, step)
            self.steps.drop(key)  # a new attempt starts afresh
        replacing = os.path.isdir(step_dir(self.root, job, step))
        old_at = committed_at(step_dir(self.root, job, step)) if replacing else 0
        done = self.steps.get(key)
        if not replacing and lws < ws and done is not None and done.state is StepState.DURABLE:
            # a multi-node step lives in the bucket, not here; this daemon remembers it complete
            replacing, old_at = True, done.committed_at
        if replacing:
            self._replace(job, step, after, old_at, multi_node=lws < ws)
        track = self.steps.check_commit(key, rank, ws, lws)
        if replacing and not track.replaces:  # the new line's commits are ordered after the old step's
            track.replaces, track.replaces_at = True, old_at
        return track

    def committed(self, job: str, step: int, rank: int, peer: int | None = None, run: int | None = None) -> None:
        """``rank`` committed ``step``: every other step of ``job`` still missing ranks is abandoned. The committing
        process is noted (pid and start time), whether or not the commit named its launch: once every one is gone,
        the run is (:meth:`run_gone`)."""
        owner = self._runs.setdefault(job, (run, set()))  # a commit without ``run`` joins the job's current run
        born = started(peer) if peer else None
        if born is not None and (peer, born) not in owner[1]:
            if len(owner[1]) >= MAX_COMMITTERS:  # launches that never name a run add up: those gone are forgotten
                owner[1].difference_update({(p, b) for p, b in owner[1] if started(p) != b})
            owner[1].add((peer, born))  # type: ignore[arg-type]
        for key, track in self.steps.abandon_others(job, step, rank):
            log.warning("job %s step %s abandoned: %s", key[0], key[1], track.error)
            self._settle(key, track)

    def run_gone(self, job: str) -> bool:
        """Every process known to have committed ``job``'s steps in its current run has exited (False
        when none is known: a client over tcp)."""
        owner = self._runs.get(job)
        return owner is not None and bool(owner[1]) and all(started(p) != born for p, born in owner[1])

    def _check_run(self, job: str, run: int | None, peer: int | None) -> None:
        owner = self._runs.get(job)
        if run is None or owner is None or owner[0] == run:
            return
        # a reused pid is another process; processes that named no launch (an older or a raw client) are not a run to refuse for
        alive = sorted(p for p, born in owner[1] if p != peer and started(p) == born) if owner[0] is not None else []
        if alive and peer not in {p for p, _ in owner[1]}:
            raise ProtocolError(
                f"job {job!r} is being saved by another run whose processes are alive (pids {alive[:8]}): two runs share"
                f" the job name and would restore each other's models; give each its own (CKPTD_JOB or Client(job=...))"
            )
        self._runs[job] = (run, set())  # the earlier run is gone (or this process ran it): a relaunch takes over

    def _replace(self, job: str, step: int, after: int | None, old_at: int, *, multi_node: bool) -> None:
        """A commit of ``step``, which is complete on disk: refused unless the client rolled back past it. The
        old step stays until the new one is complete (see the module's docstring), but for a multi-node
        step, whose local copy is only a cache of the bucket's: that goes at once."""
        if after is None or after >= step:
            since = "restored no step" if after is None else f"restored step {after}"
            raise ProtocolError(
                f"step {step} of job {job} is already committed and this client {since}: a complete checkpoint is"
                f" overwritten only by a run that rolled back (restore(step=k) with k < {step}); use another step or job"
            )
        track = self.steps.get((job, step))
        if track is not None and track.state is StepState.PENDING and track.replaces:
            if old_at == track.replaces_at:
                return  # another rank of the new attempt committed first: the old step is still the one it replaces
        if track is not None and track.state is StepState.MEMORY:
            return  # a re-save held in memory (its old step goes when it is sealed): check_commit refuses this
        if track is not None and self.writing(job, step):  # an earlier re-save that failed still writes into step-N.tmp
            raise _busy(job, step)
        self.steps.drop((job, step))  # the old step's track (or its attempt's, finalized, event not yet handled)
        self.holdings.forget(job, step)  # hot restores read the old step from disk until it is replaced
        if multi_node:
            local.retire_step(self.root, job, step, old_at)
        log.info("job %s: step %s is saved again by a run rolled back to step %s; it replaces the old one when complete", job, step, after)


def _busy(job: str, step: int) -> DaemonBusy:
    """A new attempt at ``step`` while a shard of an earlier one is still in flight: answered ``busy``, which the client asks again."""
    return DaemonBusy(f"step {step} of job {job}: an earlier attempt's shards are still being written; retry")
