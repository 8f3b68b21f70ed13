"""The in-process client: the facade a training script uses (``snapshot``, ``prepare``, ``wait``, ``restore``, ``latest``) and its handles.

One snapshot, in order, on the training thread: finish the previous background copy; stage the state (:mod:`.stage`: capture,
plan — a collective —, layout); lease a slot (``alloc``); copy into it (:mod:`.copy`); commit (``commit``, the tree a second frame).
With ``blocking=False`` and a state on a GPU (or ``overlap="always"``) the tensors only ``optimizer.step()`` mutates are copied by
a background thread, which then commits; an optimizer step pre-hook, the next ``snapshot()``, ``restore()`` and ``wait()`` wait for
it first. The ``wait()`` methods: any thread, blocking on the daemon's answer. Restores: :mod:`.restore`; requests: :mod:`.rpc`."""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from typing import Any

import torch

from ..config import ALLOC_TIMEOUT_S, CLIENT_TIMEOUT_S, MAX_PREPARED_SLOTS, default_endpoint, env_float
from ..errors import CheckpointError, DaemonUnavailable
from ..protocol import MAX_MESSAGE_BYTES
from .agree import collective, shared
from .calls import DaemonRequests
from .copy import Behind, CopyGuard, EarlyCopy, SlotMaps, fill, join_all
from .guarded import TornCopy, hookable, optimizer_storages, torch_optimizer
from .handle import Pending, SnapshotHandle
from .load import Rename, Restored, restore_state
from .options import JobName, check_not_saved, check_step, dist_rank_world, local_world_size, overlap_setting, tier_settings
from .restore import Source, restore_from_daemon, restored
from .ring import gather_ring, tell_ring
from .rpc import Channel
from .sizing import projected_items
from .spare import SpareWarmer, lease_many
from .stage import Staged, Stager, TreeEncoder

log = logging.getLogger("ckptd.client")


class Client(DaemonRequests):
    """Talks to the node's daemon for one job; its methods, safe from any thread, are the module-level functions with explicit settings.

    Args:
        endpoint: The daemon's endpoint, ``ipc://`` or ``tcp://`` (default: ``CKPTD_ENDPOINT``, else a per-user ipc socket).
        job: The job, a directory name under the root (default: ``CKPTD_JOB``, else one stable across relaunches: :doc:`/api`).
        timeout: Seconds a request may go unanswered before :class:`DaemonUnavailable` (``CKPTD_TIMEOUT``, 30).
        alloc_timeout: Seconds ``snapshot()`` waits for a slot while the daemon's memory budget is full (``CKPTD_ALLOC_TIMEOUT``).
        persist_every: This job's own :doc:`memory tier </memory-tier>`: persist one snapshot in N (``CKPTD_PERSIST_EVERY``).
        persist_interval: Or the first one T seconds after the last (``CKPTD_PERSIST_INTERVAL``); both default to the daemon's.
        overlap: When the default mode copies behind the next step: ``auto``, ``always`` or ``never`` (``CKPTD_OVERLAP``).
    Raises:
        CheckpointError: The endpoint is not ``ipc://`` or ``tcp://``, or no job name is given and none can be derived."""

    def __init__(
        self,
        endpoint: str | None = None,
        job: str | None = None,
        *,
        timeout: float | None = None,
        alloc_timeout: float | None = None,
        persist_every: int | None = None,
        persist_interval: float | None = None,
        overlap: str | None = None,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        self._name = JobName(job)  # a name ckptd derived is said at the first latest() or snapshot(), on rank 0
        self.job = self._name.name
        self.timeout = timeout if timeout is not None else env_float("CKPTD_TIMEOUT", CLIENT_TIMEOUT_S)
        self.alloc_timeout = alloc_timeout if alloc_timeout is not None else env_float("CKPTD_ALLOC_TIMEOUT", ALLOC_TIMEOUT_S)
        self._tiering = tier_settings(persist_every, persist_interval)
        self.overlap = overlap_setting(overlap)
        self._rpc = Channel(self.endpoint, self.timeout)
        self._stager = Stager(self.job)
        self._maps = SlotMaps()
        self._spare = SpareWarmer(self._maps, lambda r, w, n: self._alloc(r, w, 0, n, wait=False, warm=True, spare=True), self._release)
        self._leases: dict[str, str] = {}  # segment -> the lease token the daemon gave this client for it
        self._trees = TreeEncoder()
        self._guard = CopyGuard()
        self._guarded: tuple[Any, set[int]] = (lambda: None, set())  # optimizer-owned storages, for the stage (weakly) they are of
        self._pending = Pending(self.job)  # a DCP writer's thread adds to it too
        self._snapping = threading.RLock()  # one snapshot() / prepare() / staging at a time: the guard follows one copy
        self._closed = False
        self.early_copies = 0  # snapshots copied before returning whose copy overlapped the capture check (and held)
        self.last_restore: dict[str, Any] | None = None  # {step, path, source: memory | disk | bucket}
        self._ring: list[str] | None = None  # the daemons of a job that spans nodes (:mod:`.ring`), once gathered
        self._ring_gathered = False
        self._torn = False  # a background copy saw its sources written outside optimizer.step(): copy before returning

    # ------------------------------------------------------------------ snapshot

    def snapshot(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None = None,
        *,
        step: int,
        extra: dict[str, Any] | None = None,
        blocking: bool = False,
    ) -> SnapshotHandle:
        """Capture model and optimizer state as of this call and hand it to the daemon, as :func:`ckptd.snapshot` (its errors).

        Args:
            model: The module to save.
            optim: Its optimizer, or ``None``.
            step: The step number, the same on every rank.
            extra: This rank's own state (JSON-able values and tensors), returned by :meth:`restore`.
            blocking: Return once every byte is in the daemon's shared memory and the commit is recorded.
        Returns:
            The step's :class:`SnapshotHandle`."""
        check_step(step)
        self._name.announce(self._rpc)
        with self._snapping:
            return self._snapshot(model, optim, step, extra, blocking)

    def _snapshot(
        self, model: torch.nn.Module, optim: torch.optim.Optimizer | None, step: int, extra: dict[str, Any] | None, blocking: bool
    ) -> SnapshotHandle:
        optim = torch_optimizer(optim)
        prior = self._guard.settle()  # the previous copy must end before we reuse the layout or slot; its error goes to the plan
        try:
            check_not_saved(self, step)
        except CheckpointError as e:
            if prior is None:
                raise
            raise CheckpointError(f"{e}; and before it: {prior}") from prior  # the copy's failure is not lost with it
        rank, world = dist_rank_world()
        early = self._early_copy(rank, world, step) if prior is None and (blocking or self.overlap != "always") else None
        try:
            staged = self._stager.run(model, optim, extra, rank, step, prior)
        except BaseException:
            if early is not None:
                early.join()
                self._release(early.segment)
            raise
        self._name_ring(world)
        handle = SnapshotHandle(self, step)
        segment, tree_json = None, None
        if early is not None:
            try:  # while the early copy finishes: this thread would only wait
                tree_json = self._trees.encode(staged.tree)
            except Exception:  # refused again by the commit, which gives the slot back and says why
                tree_json = None
            segment = self._finish_early(early, staged)
        behind = Behind()
        if segment is None:  # no early copy, or it did not hold (an optimizer that cannot be hooked: copied now)
            segment, behind = self._fill(
                optim, rank, world, step, staged, blocking or self._torn or not self._overlaps(staged) or not hookable(optim), model
            )
        try:
            commit = self._commit_fields(rank, world, step, segment, staged)
        except BaseException:
            self._release(segment)
            raise
        if not behind.pending:
            self._commit_now(handle, commit, tree_json or staged.tree)
        else:
            self._guard.hook()
            self._guard.start(step, lambda: self._background(handle, behind, commit, staged.tree), handle._unreported)
        self._pending.track(handle)
        self._spare.start(torch.cuda.current_device() if staged.any_cuda else None)  # a spare announced: mapped ahead
        return handle

    def _name_ring(self, world: int) -> None:
        """A job that spans nodes tells its daemon the job's daemons (:mod:`.ring`): gathered once (a collective, as the
        plan before it: every rank is here), told at every snapshot (a restarted daemon learns it again)."""
        if not self._ring_gathered and world > 1:
            self._ring_gathered = True
            self._ring = gather_ring(self._rpc)
        if self._ring:
            tell_ring(self._rpc, self.job, self._ring)

    def _overlaps(self, staged: Staged) -> bool:
        """Whether the default mode copies ``staged`` behind the next step (:func:`.options.overlap_setting`)."""
        return self.overlap == "always" or (self.overlap == "auto" and staged.any_cuda)

    def snapshot_state(self, state: dict[str, Any], *, step: int, extra: dict[str, Any] | None = None) -> SnapshotHandle:
        """Checkpoint a state dict as it is, blocking (``ckptd import`` uses it); collective like :meth:`snapshot`.

        Args:
            state: ``{"model": <state dict>, "optim": <optimizer state dict as get_state_dict gives it>}`` (``optim`` may be left out).
            step: The step number; :meth:`restore` loads it into any layout.
            extra: This rank's own state, as for :meth:`snapshot`.
        Returns:
            The step's :class:`SnapshotHandle`, already committed."""
        from .staged import commit_staged, stage_state

        return commit_staged(stage_state(self, state, step=step, extra=extra))

    def _commit_fields(self, rank: int, world: int, step: int | None, segment: str, staged: Staged) -> dict[str, Any]:
        return dict(
            job=self.job, rank=rank, world_size=world, local_world_size=local_world_size(world), step=step,
            segment=segment, nbytes=staged.layout.file_size, replicas=staged.replicas, after=self._stager.after,
            run=self._stager.run_id, **self._tiering,
        )  # fmt: skip

    def _commit_now(self, handle: SnapshotHandle, commit: dict[str, Any], tree: bytes | dict[str, Any]) -> None:
        self._commit(handle, commit, tree)
        if handle._error is not None:
            handle._reported = True
            raise CheckpointError(f"snapshot of step {commit['step']} failed: {handle._error}") from handle._error

    def prepare(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None = None, *, slots: int | None = None) -> None:
        """Do the first snapshot's one-time work now, outside the training loop, as :func:`ckptd.prepare` (its errors).

        Args:
            model: The module ``snapshot()`` will save.
            optim: Its optimizer, or ``None``.
            slots: How many staging slots, an int in 0..16 (default: two; three with a memory tier)."""
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= MAX_PREPARED_SLOTS):
            raise ValueError(f"prepare(slots=...) takes an int in 0..{MAX_PREPARED_SLOTS}, got {slots!r}")
        with self._snapping:
            self._prepare(model, torch_optimizer(optim), slots)

    def _prepare(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None, slots: int | None) -> None:
        prior = self._guard.settle()  # raised by the plan below, with every rank
        if slots is None:
            try:
                slots = 3 if self._memory_tier() else 2
            except CheckpointError as e:  # this rank's daemon is down: every rank fails at the plan, none waits for it
                prior, slots = prior or e, 0
        rank, world = dist_rank_world()
        staged = self._stager.run(model, optim, None, rank, None, prior)
        nbytes = self._stager.projected_size(lambda items: projected_items(items, model, optim))  # a collective too
        leased: list[str] = []
        try:  # the slots are asked for, made, mapped (and page-locked for CUDA) side by side
            short = lease_many(lambda: self._alloc(rank, world, 0, nbytes, wait=False, warm=True), slots, leased)
            if short:
                log.warning("prepare(): %d of %d slots fit now; %s", len(leased), slots, str(short[0]).split(": ", 1)[-1])
            self._maps.warm(leased, pin=staged.any_cuda)
        finally:
            for seg in leased:
                self._release(seg)

    def _memory_tier(self) -> bool:
        """Whether this job's snapshots may stay in the daemon's memory tier only."""
        policy = {**self._rpc.call("hello").get("tiering", {}), **{k: v for k, v in self._tiering.items() if v is not None}}
        return policy.get("persist_every", 1) > 1 or policy.get("persist_interval", 0) > 0 or policy.get("lagging") == "memory"

    def _alloc(
        self, rank: int, world: int, step: int | None, nbytes: int, *, wait: bool = True, warm: bool = False, spare: bool = False
    ) -> str:
        """A slot leased for ``nbytes``; the daemon refuses one it cannot grant within the alloc timeout (or at once,
        ``wait`` false) rather than grant it later to a client that gave up. ``warm``: prepare(); ``spare``: :mod:`.spare`."""
        rpc_timeout = self.alloc_timeout + 5.0 if wait else self.timeout
        held = self.timeout / 2 if spare else (self.alloc_timeout if self.alloc_timeout < 1e9 else 0)
        flags = {k: True for k, on in (("warm", warm), ("spare", spare)) if on}  # only when true: as before to any daemon
        rep = self._rpc.call(
            "alloc", rpc_timeout=rpc_timeout, job=self.job, rank=rank, world_size=world, step=step, nbytes=nbytes,
            pid=os.getpid(), wait=wait, timeout=held, **flags,
        )  # fmt: skip
        self._leases[rep["segment"]] = rep["lease"]  # the secret that lets this client, and no other, commit or release it
        if rep.get("spare"):
            self._spare.due(rank, world, nbytes)
        return rep["segment"]

    def _release(self, segment: str) -> None:
        lease = self._leases.pop(segment, None)
        if lease is None:
            return
        try:
            self._rpc.call("release", segment=segment, lease=lease)
        except CheckpointError as e:
            log.warning("could not release %s: %s", segment, e)

    def _early_copy(self, rank: int, world: int, step: int) -> EarlyCopy | None:
        """Lease a slot and start copying a cached stage of many tensors, while this thread checks the capture and runs the collective."""
        stage = self._stager.stage
        if stage is None or not EarlyCopy.worth_it(stage):
            return None
        try:  # not waiting: this comes before the plan's collective, which the other ranks would wait in
            segment = self._alloc(rank, world, step, stage.layout.file_size, wait=False)
        except CheckpointError:
            return None  # the copy after the collective leases the slot (and raises there, on every rank)
        try:
            early = EarlyCopy(self._maps, segment, stage)
            early.start()
        except BaseException:
            self._release(segment)
            raise
        return early

    def _finish_early(self, early: EarlyCopy, staged: Staged) -> str | None:
        """The segment, filled, if the early copy used what the capture now says; else ``None`` (the segment is given back)."""
        try:
            held = early.finish(self._stager.stage, staged)
        except BaseException:
            self._release(early.segment)
            raise
        if not held:
            self._release(early.segment)
            return None
        self.early_copies += 1
        return early.segment

    def _fill(
        self, optim: Any, rank: int, world: int, step: int | None, staged: Staged, blocking: bool, model: Any = None
    ) -> tuple[str, Behind]:
        """Lease a slot, copy into it what must be copied before ``snapshot()`` returns; return it and what the background has left."""
        segment = self._alloc(rank, world, step, staged.layout.file_size)
        try:
            guarded = self._guarded_storages(optim, model) if (optim is not None and not blocking) else set()
            behind = fill(self._maps, segment, staged, guarded, blocking)
        except BaseException:
            self._release(segment)
            raise
        return segment, behind

    def _guarded_storages(self, optim: torch.optim.Optimizer, model: Any) -> set[int]:
        """The optimizer's storages, recomputed only with the stage (a stage reused: the fingerprint of every parameter and state held)."""
        stage = self._stager.stage
        if self._guarded[0]() is not stage or stage is None:
            self._guarded = (weakref.ref(stage) if stage is not None else lambda: None, optimizer_storages(optim, model))
        return self._guarded[1]

    def _commit(self, handle: SnapshotHandle, commit: dict[str, Any], tree: bytes | dict[str, Any]) -> None:
        """Commit the filled slot; any failure is the handle's error and gives the slot back; the handle is marked copied."""
        try:
            tree_json = tree if isinstance(tree, bytes) else self._trees.encode(tree)  # a value JSON refuses fails here
            if len(tree_json) > MAX_MESSAGE_BYTES:  # the daemon would drop it unanswered
                raise CheckpointError(
                    f"the state's non-tensor values take {len(tree_json)} bytes as JSON, over the {MAX_MESSAGE_BYTES}-byte"
                    " limit of a commit message"
                )
            self._rpc.call("commit", frames=(tree_json,), lease=self._leases[commit["segment"]], **commit)
            self._leases.pop(commit["segment"], None)
            self._stager.saved.add(commit["step"])
        except BaseException as e:
            handle._error = e
            if not isinstance(e, DaemonUnavailable):
                self._release(commit["segment"])
        finally:
            handle._copied.set()

    def _background(self, handle: SnapshotHandle, behind: Behind, commit: dict[str, Any], tree: dict[str, Any]) -> None:
        # off the main thread: no collectives, only the copy and the socket
        try:
            behind.run(commit["step"])
        except BaseException as e:
            handle._error = e
            if isinstance(e, TornCopy):  # the loop writes outside optimizer.step(): copy before returning from now on
                self._torn, handle._reported = True, True  # training goes on; only this step's own wait() raises
                log.warning("%s", e)
            self._release(commit["segment"])
            handle._copied.set()
            return
        self._commit(handle, commit, tree)

    # ------------------------------------------------------------------ wait / restore

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait until the snapshots this client took (the newest 64) are durable, as :func:`ckptd.wait` (its errors).

        Args:
            timeout: Seconds to wait in all, or ``None``.
        Returns:
            The durable steps' directories."""
        return self._pending.wait(timeout)

    def restore(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None = None,
        *,
        step: int | None = None,
        path: str | None = None,
        hot: bool = True,
        strict: bool = True,
        dtype: torch.dtype | None = None,
        rename: Rename | None = None,
    ) -> Restored:
        """Load the newest committed step (or ``step``, or the checkpoint at ``path``) in place, as :func:`ckptd.restore` (its errors).

        Args:
            model: The module to load into.
            optim: Its optimizer, or ``None``.
            step: The step to load (default: the latest).
            path: A step directory, or a job directory meaning its newest step: read without the daemon.
            hot: Read the daemon's shared memory while it holds the step; ``False`` reads the disk. :attr:`last_restore` says which.
            strict: State missing on one side is an error naming it; ``False`` loads what matches.
            dtype: Convert saved floating-point tensors into targets of this dtype; otherwise dtypes must match.
            rename: Saved parameter names to the model's: a dict of name prefixes, or a callable on a saved name.
        Returns:
            This rank's ``extra``, a :class:`Restored` (``step``, ``source``, ``missing_keys``, ``unexpected_keys``)."""
        shared(strict, self._guard.finish)  # a failed earlier copy fails every rank together (alone, the others would time out)
        join_all()  # and another client's (a second job's) copy of these tensors
        rank, _ = dist_rank_world()
        optim = shared(strict, torch_optimizer, optim)
        how = {"strict": strict, "dtype": dtype, "rename": rename}
        if path is not None:
            extra, self.last_restore = restore_state(path, model, optim, rank, **how), restored(None, path, Source.DISK)
        else:
            if collective(strict):  # a job that spans nodes: its daemons find its steps in each other's memory
                self._name_ring(dist_rank_world()[1])
            extra, self.last_restore = restore_from_daemon(self._rpc, self.job, model, optim, rank, step=step, hot=hot, how=how)
            self.restored_at(extra.step)
        return extra

    def tier(self, persist_every: int | None, persist_interval: float | None) -> None:
        """Internal, for ``ckptd.dcp.Writer`` and the Lightning plugin: this job's memory tier from here on.

        As ``Client(persist_every=..., persist_interval=...)`` would set it; the job's own setting rides on its commits.

        Args:
            persist_every: Persist one snapshot in N (``None``: the environment's, else the daemon's).
            persist_interval: Or the first one T seconds after the last persisted one (``None`` likewise).
        Raises:
            ValueError: A value out of the daemon's bounds."""
        self._tiering = tier_settings(persist_every, persist_interval)

    def restored_at(self, step: int) -> None:
        """Internal, for ``ckptd.dcp.Reader`` and the integrations: this process restored a step itself, as :meth:`restore` does.

        Args:
            step: The step read: saving the steps after it again starts a new line (a rollback), as a new attempt."""
        self._stager.restored(step)

    def close(self) -> None:
        """Finish the background copy, then drop mappings and sockets. Pending durability is the daemon's."""
        if self._closed:
            return
        try:
            self._guard.finish()
        except CheckpointError as e:
            warnings.warn(str(e), stacklevel=2)
        self._guard.unhook()
        if self._spare.close(self.timeout + 5.0):  # else a warming still waits on the daemon: the channel closes once
            self._rpc.close()  # collected, after it ends (the mappings go now: a warming ending later drops its own)
        self._maps.close()
        self._closed = True

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
