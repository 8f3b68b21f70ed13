"""The in-process client: state → staging slot → commit, snapshot handles and the copy guard.

Who runs what, in a training process:

* ``snapshot()`` on the training thread: captures the state dicts (torch's ``get_state_dict``),
  plans which chunks this rank writes (one small collective, foreground only), leases a slot from
  the daemon, writes the shard header and copies every tensor the optimizer does not own.
* With ``blocking=False`` the tensors that only ``optimizer.step()`` mutates (parameters and
  optimizer state) are copied by a background thread, which then commits; an optimizer step
  pre-hook, the next ``snapshot()``, ``restore()`` and ``wait()`` all wait for that copy first.
  The background thread makes no collectives and touches nothing but the slot and the socket.
* ``SnapshotHandle.wait()`` / ``Client.wait()``: any thread; block on the daemon's answer.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from . import shm
from ._config import default_endpoint, default_job, env_float, validate_job
from .capture import StateCapture, local_tensor
from .errors import CheckpointError, DaemonUnavailable, ProtocolError
from .format import ShardLayout, build_layout, dtype_from_name
from .plan import WritePlan
from .protocol import decode_reply, encode, endpoint_answers, request
from .state import LocalChunk, flatten, replica_id, sample_digest

log = logging.getLogger("ckptd.client")

_MAPPINGS_KEPT = 4  # warm mappings per client: the slots a rank alternates between
PENDING_KEPT = 64  # snapshot handles wait() still answers for: the newest ones
EARLY_COPY_MIN_TENSORS = 1000  # below this the capture check costs little next to the copy


@dataclass
class _Early:
    """A blocking snapshot's copy started before its capture check finished (see ``_early_copy``)."""

    segment: str
    mapping: shm.Mapping
    stage: tuple[Any, ...]  # the cached stage it copied from: still current iff the capture held
    started: threading.Event
    thread: threading.Thread = None  # type: ignore[assignment]
    error: BaseException | None = None


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _local_world_size(world: int) -> int:
    """How many of the job's ranks share this node's daemon: torchrun's ``LOCAL_WORLD_SIZE``, else all."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(v) if v.isdigit() and 1 <= int(v) <= world else world


class SnapshotHandle:
    """One snapshot in flight. ``wait()`` blocks until the step is durable and returns its path."""

    def __init__(self, client: Client, step: int) -> None:
        self.client = client
        self.step = step
        self.job = client.job
        self._copied = threading.Event()
        self._error: BaseException | None = None
        self._path: str | None = None

    def copied(self) -> bool:
        """True once every byte is in the daemon's shared memory and committed (or the copy failed)."""
        return self._copied.is_set()

    def wait_copied(self, timeout: float | None = None) -> None:
        if not self._copied.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} still copying after {timeout} s")
        if self._error is not None:
            raise CheckpointError(f"snapshot of step {self.step} failed: {self._error}") from self._error

    def wait(self, timeout: float | None = None) -> str:
        """Block until step ``step`` is committed (manifest written); return its directory.

        Raises :class:`CheckpointError` if the copy failed or the daemon reported a failure, and
        ``TimeoutError`` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_copied(timeout)
        if self._path is not None:
            return self._path
        while True:
            left = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
            rep = self.client._call("wait", rpc_timeout=left + 10.0, job=self.job, step=self.step, timeout=left)
            if rep["state"] == "durable":
                self._path = rep["path"]
                return rep["path"]
            if rep["state"] == "failed":
                raise CheckpointError(f"step {self.step} of job {self.job} failed: {rep['error']}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"step {self.step} of job {self.job} not durable after {timeout} s")

    def __repr__(self) -> str:
        return f"SnapshotHandle(job={self.job!r}, step={self.step}, copied={self.copied()})"


class Client:
    """Talks to the node's daemon. Methods are safe to call from any thread.

    ``endpoint`` defaults to ``CKPTD_ENDPOINT`` (else a per-user ipc socket), ``job`` to
    ``CKPTD_JOB`` (else torchrun's run id, else ``default``). ``timeout`` bounds each request to
    the daemon except ``alloc``, which waits up to ``alloc_timeout`` while the daemon's
    shared-memory budget is full (``CKPTD_TIMEOUT``, ``CKPTD_ALLOC_TIMEOUT``).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        job: str | None = None,
        *,
        timeout: float | None = None,
        alloc_timeout: float | None = None,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.job = validate_job(job) if job is not None else default_job()
        self.timeout = timeout if timeout is not None else env_float("CKPTD_TIMEOUT", 30.0)
        self.alloc_timeout = alloc_timeout if alloc_timeout is not None else env_float("CKPTD_ALLOC_TIMEOUT", 600.0)
        self._ctx = zmq.Context()
        self._tls = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._sock_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._maps: OrderedDict[str, shm.Mapping] = OrderedDict()
        self._dst_cache: dict[str, tuple[ShardLayout, list[torch.Tensor]]] = {}
        self._json_memo: dict[int, tuple[Any, bytes]] = {}
        self._pinned: set[str] = set()  # mappings page-locked for device copies
        self._plan = WritePlan()
        self._capture = StateCapture()
        self._stage: tuple[Any, ...] | None = None  # the last plan and layout, reused while the state's shape holds
        self._guarded: tuple[Any, set[int]] = (None, set())  # optimizer-owned storages, for the stage they were computed for
        self._layout_key: Any = None
        self._layout: ShardLayout | None = None
        self._inflight: threading.Thread | None = None
        self._inflight_handle: SnapshotHandle | None = None
        self._pending: list[SnapshotHandle] = []
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._closed = False
        self.early_copies = 0  # blocking snapshots whose copy overlapped the capture check (and held)
        self.last_restore: dict[str, Any] | None = None  # {step, path, source: memory | disk}

    # ------------------------------------------------------------------ RPC

    def _socket(self) -> zmq.Socket:
        s = getattr(self._tls, "sock", None)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            try:
                s.connect(self.endpoint)
            except zmq.ZMQError as e:
                s.close(0)
                raise CheckpointError(f"cannot connect to {self.endpoint!r}: {e}") from None
            self._tls.sock = s
            with self._sock_lock:
                self._sockets.append(s)
        return s

    def _drop_socket(self) -> None:
        s = getattr(self._tls, "sock", None)
        if s is not None:
            self._tls.sock = None
            with self._sock_lock:
                if s in self._sockets:
                    self._sockets.remove(s)
            s.close(0)

    def _call(self, op: str, rpc_timeout: float | None = None, frames: tuple[bytes, ...] = (), **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raise on an error reply or no answer."""
        if self._closed:
            raise CheckpointError("client is closed")
        timeout = self.timeout if rpc_timeout is None else rpc_timeout
        req_id = next(self._ids)
        s = self._socket()
        s.send_multipart([request(op, req_id, **fields), *frames])
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            left = deadline - time.monotonic()
            # a long wait (alloc under backpressure) checks every `self.timeout` that the daemon lives
            slice_s = min(left, self.timeout)
            if left > 0 and not s.poll(int(slice_s * 1000) + 1) and slice_s < left and self._alive():
                continue
            if left <= 0 or not s.poll(0):
                # a late reply must not be read as the answer to a later request
                self._drop_socket()
                raise DaemonUnavailable(
                    f"no answer from the ckptd daemon at {self.endpoint} within {time.monotonic() - t0:.1f} s (op {op});"
                    " is `ckptd serve` running?"
                )
            rep = decode_reply(s.recv())
            if rep.get("id") not in (req_id, None):
                continue  # stale reply to an earlier, abandoned request
            if not rep["ok"]:
                raise ProtocolError(f"daemon refused {op}: {rep.get('error')}")
            return rep

    def _alive(self) -> bool:
        return endpoint_answers(self._ctx, self.endpoint, self.timeout)

    def hello(self) -> dict[str, Any]:
        return self._call("hello")

    def status(self) -> dict[str, Any]:
        return self._call("status")

    def latest(self) -> int | None:
        """The newest committed step of this job, or ``None``."""
        return self._call("latest", job=self.job)["step"]

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
        """Capture model and optimizer state as of this call and hand it to the daemon.

        Every rank of a distributed job must call it with the same ``step``. ``extra`` (JSON-able
        values and tensors) is this rank's own state, returned by :meth:`restore`.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._finish_inflight()  # the previous copy must end before we reuse the layout or slot
        rank, world = _dist_rank_world()
        early = self._early_copy(rank, world, step) if blocking else None
        try:
            tree, layout, srcs, replicas, any_cuda = self._stage_plan(model, optim, extra, rank)
        except BaseException:
            if early is not None:
                early.thread.join()
                self._release(early.segment)
            raise

        handle = SnapshotHandle(self, step)
        tree_json = None
        if early is not None:
            tree_json = self._tree_json(tree)  # while the early copy finishes: this thread would only wait
        segment = self._finish_early(early, layout, srcs, any_cuda) if early is not None else None
        if segment is not None:  # the capture held: the slot is filled
            later: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            event = None
        else:
            segment, later, event = self._fill(model, optim, rank, world, step, layout, srcs, any_cuda, blocking)
        commit = dict(
            job=self.job,
            rank=rank,
            world_size=world,
            local_world_size=_local_world_size(world),
            step=step,
            segment=segment,
            nbytes=layout.file_size,
            tree=tree,
            replicas=replicas,
            tree_json=tree_json,
        )
        if not later[0] and event is None:
            self._commit(handle, commit)
            if handle._error is not None:
                raise CheckpointError(f"snapshot of step {step} failed: {handle._error}") from handle._error
        else:
            self._hook(optim)  # type: ignore[arg-type]
            t = threading.Thread(target=self._background, args=(handle, later, commit, event), name=f"ckptd-copy-{step}", daemon=False)
            self._inflight, self._inflight_handle = t, handle
            t.start()
        self._pending.append(handle)
        # a client that never calls wait() must not grow without bound; the daemon remembers more
        # finished steps per job (TRACKS_KEPT) than this, so every kept handle can still be answered
        del self._pending[:-PENDING_KEPT]
        return handle

    def _alloc(self, rank: int, world: int, step: int, nbytes: int) -> str:
        rep = self._call(
            "alloc", rpc_timeout=self.alloc_timeout, job=self.job, rank=rank, world_size=world, step=step, nbytes=nbytes, pid=os.getpid()
        )
        return rep["segment"]

    def _early_copy(self, rank: int, world: int, step: int) -> _Early | None:
        """A blocking snapshot of a state with many tensors, whose last stage is cached: lease the slot and
        start copying the cached sources now, on a worker thread, while this thread checks that the
        capture still holds and runs the plan's collective (torch releases the GIL while it copies).
        If the capture changed, :meth:`_finish_early` throws the copy away."""
        st = self._stage
        if st is None or st[6] or len(st[4]) < EARLY_COPY_MIN_TENSORS:
            return None  # nothing cached, CUDA sources, or too few tensors for the check to matter
        layout, base_srcs, extra_slots = st[3], st[4], st[5]
        segment = self._alloc(rank, world, step, layout.file_size)
        try:
            m = self._mapping(segment)
            m.view[: layout.data_start] = layout.header
            dsts = self._destinations(m, layout)
        except BaseException:
            self._release(segment)
            raise
        if extra_slots:
            skip = {i for i, _ in extra_slots}
            pairs = ([d for i, d in enumerate(dsts) if i not in skip], [t for i, t in enumerate(base_srcs) if i not in skip])
        else:
            pairs = (dsts, base_srcs)
        early = _Early(segment, m, st, threading.Event())

        def run() -> None:
            early.started.set()
            try:
                _copy(*pairs)
            except BaseException as e:  # the main thread decides: it copies again, or raises
                early.error = e

        early.thread = threading.Thread(target=run, name=f"ckptd-early-copy-{step}", daemon=True)
        try:
            early.thread.start()
        except BaseException:
            self._release(segment)
            raise
        early.started.wait()  # let it take the GIL once, into the copy, before this thread goes on
        return early

    def _finish_early(self, early: _Early, layout: ShardLayout, srcs: list[torch.Tensor], any_cuda: bool) -> str | None:
        """The segment, filled, if the early copy used what the capture now says; else ``None`` (the
        segment is given back).

        ``_stage_plan`` keeps the stage tuple only when the capture cache's fingerprint held and the
        extras kept their shapes: then every cached source is a view of the live state and the
        early copy is this snapshot's copy. Any other stage (even one with an equal layout) means
        the copy may hold stale tensors, and it is discarded."""
        early.thread.join()
        if early.error is None and self._stage is early.stage and not any_cuda:
            try:
                extra_slots = early.stage[5]
                if extra_slots:  # this snapshot's own extra tensors
                    dsts = self._destinations(early.mapping, layout)
                    _copy([dsts[i] for i, _ in extra_slots], [srcs[i] for i, _ in extra_slots])
            except BaseException:
                self._release(early.segment)
                raise
            self.early_copies += 1
            return early.segment
        self._release(early.segment)
        return None

    def _fill(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None,
        rank: int,
        world: int,
        step: int,
        layout: ShardLayout,
        srcs: list[torch.Tensor],
        any_cuda: bool,
        blocking: bool,
    ) -> tuple[str, tuple[list[torch.Tensor], list[torch.Tensor]], Any]:
        """Lease a slot and copy into it what must be copied before ``snapshot()`` returns; return the
        segment, the pairs left for the background thread, and the CUDA event to wait for."""
        segment = self._alloc(rank, world, step, layout.file_size)
        try:
            m = self._mapping(segment)
            m.view[: layout.data_start] = layout.header
            dsts = self._destinations(m, layout)
            guarded = self._guarded_storages(model, optim) if (optim is not None and not blocking) else set()
            event = None
            if any_cuda:
                # GPU path: device-to-host copies on a side stream into the page-locked slot, now
                event, dsts, srcs = self._copy_cuda(m, dsts, srcs, guarded)
            now: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            later: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            if not guarded:
                now = (dsts, srcs)
            else:
                for dst, src in zip(dsts, srcs):
                    side = later if _storage(src) in guarded else now
                    side[0].append(dst)
                    side[1].append(src)
            _copy(*now)
            if blocking and event is not None:
                event.synchronize()
                event = None
        except BaseException:
            self._release(segment)
            raise
        return segment, later, event

    def _stage_plan(
        self, model: torch.nn.Module, optim: torch.optim.Optimizer | None, extra: dict[str, Any] | None, rank: int
    ) -> tuple[Any, ShardLayout, list[torch.Tensor], dict[str, str], bool]:
        """Capture the state and decide what this rank writes where: tree, layout, the source of
        each chunk in layout order, replica digests, whether any source is on CUDA. Runs the plan's
        collective: foreground, every rank."""
        tree, chunks, reused = self._capture.capture(model, optim)
        extra_chunks: list[LocalChunk] = []
        if extra is not None:
            if not isinstance(extra, dict):
                raise TypeError("extra must be a dict")
            extra_tree, extra_chunks = flatten({"extra": {str(rank): extra}})
            tree = {**tree, **extra_tree}
        extra_sig = tuple((c.key, c.tensor.dtype, c.sizes) for c in extra_chunks)
        st = self._stage
        if reused and st is not None and st[0] is chunks and st[1] == extra_sig:
            items, layout, base_srcs, extra_slots, base_cuda, _ = st[2:]
        else:
            for ch in chunks + extra_chunks:
                if ch.tensor.dtype not in _COPYABLE:
                    raise TypeError(f"tensor {ch.key!r} has dtype {ch.tensor.dtype}, which ckptd cannot store")
            items = [((c.key, c.offsets, c.sizes), c.nbytes) for c in chunks + extra_chunks]
            layout = None
        mine, shared = self._plan.mine(items)  # every rank, every snapshot: the plan's collective
        if layout is not None and st is not None and mine is not st[7]:
            layout = None  # another rank's layout changed and the plan with it: what this rank writes may differ
        # every holder of a replicated chunk reports a digest of its copy: the daemon refuses a step whose
        # "replicas" differ (FQNs that are not globally unique, e.g. per-group expert names)
        all_chunks = chunks + extra_chunks if shared else ()
        replicas = {replica_id(c): sample_digest(c.tensor) for c in all_chunks if (c.key, c.offsets, c.sizes) in shared}
        if layout is None:
            written = [c for c in chunks + extra_chunks if (c.key, c.offsets, c.sizes) in mine]
            layout = self._layout_for(written)
            by_name = {c.name: c for c in written}
            extra_names = {c.name for c in extra_chunks}
            base_srcs = [None if spec.name in extra_names else by_name[spec.name].tensor for spec in layout.chunks]
            extra_slots = [(i, spec.name) for i, spec in enumerate(layout.chunks) if spec.name in extra_names]
            base_cuda = any(t is not None and t.is_cuda for t in base_srcs)
            self._stage = (chunks, extra_sig, items, layout, base_srcs, extra_slots, base_cuda, mine)
        srcs = list(base_srcs)
        if extra_slots:
            fresh = {c.name: c.tensor for c in extra_chunks}
            for i, name in extra_slots:
                srcs[i] = fresh[name]
        any_cuda = base_cuda or any(c.tensor.is_cuda for c in extra_chunks)
        return tree, layout, srcs, replicas, any_cuda

    def prepare(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None = None, *, slots: int = 2) -> None:
        """Do the first snapshot's one-time work now, outside the training loop.

        Plans the layout (a collective: call on every rank), has the daemon create ``slots`` staging
        slots of the right size for this rank (two: one persisting while the next is filled) and maps
        them, then hands them back unused. The next snapshots reuse them at memory-copy speed.
        """
        self._finish_inflight()
        rank, world = _dist_rank_world()
        layout = self._stage_plan(model, optim, None, rank)[1]
        leased = []
        try:
            for _ in range(slots):
                leased.append(self._alloc(rank, world, 0, layout.file_size))
                self._mapping(leased[-1])
        finally:
            for seg in leased:
                self._release(seg)

    def _layout_for(self, chunks: list[LocalChunk]) -> ShardLayout:
        key = tuple((c.name, c.key, c.tensor.dtype, c.sizes, c.global_shape, c.offsets) for c in chunks)
        if key != self._layout_key:
            self._layout = build_layout(list(key))
            self._layout_key = key
        assert self._layout is not None
        return self._layout

    def _destinations(self, m: shm.Mapping, layout: ShardLayout) -> list[torch.Tensor]:
        """Typed views of the slot, one per chunk in layout order; built once per (slot, layout)."""
        cached = self._dst_cache.get(m.name)
        if cached is not None and cached[0] is layout:
            return cached[1]
        base = m.tensor
        assert base is not None
        start = layout.data_start
        dsts = [base[start + spec.begin : start + spec.end].view(dtype_from_name(spec.dtype)).view(spec.sizes) for spec in layout.chunks]
        self._dst_cache[m.name] = (layout, dsts)
        return dsts

    def _guarded_storages(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> set[int]:
        """The optimizer's storages, recomputed only when the stage is: a reused stage means the
        capture cache's fingerprint (which covers every parameter and optimizer-state tensor) held."""
        if self._guarded[0] is not self._stage or self._stage is None:
            self._guarded = (self._stage, _optimizer_storages(model, optim))
        return self._guarded[1]

    def _copy_cuda(
        self, m: shm.Mapping, dsts: list[torch.Tensor], srcs: list[torch.Tensor], guarded: set[int]
    ) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
        """Enqueue the CUDA sources' copies; return their event and the pairs left to copy on the CPU.

        Tensors the optimizer step does not own (buffers that forward mutates, extra state) are
        copied first, and the training stream waits for them on the GPU: the next forward's kernels
        queue behind those copies, the CPU does not block. Parameters and optimizer state are only
        mutated by optimizer.step(), which the pre-hook holds until the returned event."""
        from . import cuda

        if m.name not in self._pinned and m.tensor is not None and cuda.pin(m.tensor.data_ptr(), m.size):
            self._pinned.add(m.name)
        by_device: dict[Any, tuple[list[int], list[int]]] = {}
        for i, src in enumerate(srcs):
            if src.is_cuda:
                first, second = by_device.setdefault(src.device, ([], []))
                (second if _storage(src) in guarded else first).append(i)
        events = []
        for first, second in by_device.values():
            if first:
                ev = cuda.copy_async([dsts[i] for i in first], [srcs[i] for i in first])
                torch.cuda.current_stream(srcs[first[0]].device).wait_event(ev)
                events.append(ev)
            if second:
                events.append(cuda.copy_async([dsts[i] for i in second], [srcs[i] for i in second]))
        rest = [i for i, src in enumerate(srcs) if not src.is_cuda]
        return _EventGroup(events), [dsts[i] for i in rest], [srcs[i] for i in rest]

    def _unmap(self, name: str, m: shm.Mapping) -> None:
        self._dst_cache.pop(name, None)  # its views pin the mapping
        if name in self._pinned:
            from . import cuda

            if m.tensor is not None:
                cuda.unpin(m.tensor.data_ptr())
            self._pinned.discard(name)
        m.close()

    def _mapping(self, name: str) -> shm.Mapping:
        m = self._maps.get(name)
        if m is None:
            m = shm.Mapping(name)
            self._maps[name] = m
            while len(self._maps) > _MAPPINGS_KEPT:
                self._unmap(*self._maps.popitem(last=False))
        self._maps.move_to_end(name)
        return m

    def _release(self, segment: str) -> None:
        try:
            self._call("release", segment=segment)
        except CheckpointError as e:
            log.warning("could not release %s: %s", segment, e)

    def _tree_json(self, tree: dict[str, Any]) -> bytes:
        """JSON of a snapshot's tree, re-using the encoding of subtrees the capture cache re-used
        (the per-tensor references: ~0.6 us each to encode)."""
        memo = self._json_memo

        def enc(v: Any) -> bytes:
            hit = memo.get(id(v))
            if hit is not None and hit[0] is v:
                return hit[1]
            return encode(v)

        parts = []
        for k, v in tree.items():
            if k == "optim" and isinstance(v, dict):
                body = b",".join(encode(ik) + b":" + enc(iv) for ik, iv in v.items())
                parts.append(encode(k) + b":{" + body + b"}")
            else:
                parts.append(encode(k) + b":" + enc(v))
        # remember this capture's constant subtrees for the next snapshot
        self._json_memo = {
            id(v): (v, memo[id(v)][1] if id(v) in memo and memo[id(v)][0] is v else encode(v)) for v in _constant_subtrees(tree)
        }
        return b"{" + b",".join(parts) + b"}"

    def _commit(self, handle: SnapshotHandle, commit: dict[str, Any]) -> None:
        try:
            fields = {k: v for k, v in commit.items() if k not in ("tree", "tree_json")}
            self._call("commit", frames=(commit["tree_json"] or self._tree_json(commit["tree"]),), **fields)
        except BaseException as e:
            handle._error = e
            if not isinstance(e, DaemonUnavailable):
                self._release(commit["segment"])
        finally:
            handle._copied.set()

    def _background(
        self, handle: SnapshotHandle, later: tuple[list[torch.Tensor], list[torch.Tensor]], commit: dict[str, Any], event: Any = None
    ) -> None:
        # off the main thread: no collectives, only the copy and the socket. One intra-op thread for
        # this thread only, so the copy does not start a second OpenMP team beside the training step's
        torch.set_num_threads(1)
        try:
            _copy(*later)
            if event is not None:
                event.synchronize()  # the device-to-host copies have landed in the slot
        except BaseException as e:
            handle._error = e
            self._release(commit["segment"])
            handle._copied.set()
            return
        self._commit(handle, commit)

    def _finish_inflight(self) -> None:
        t, h = self._inflight, self._inflight_handle
        if t is not None:
            t.join()
            self._inflight = self._inflight_handle = None
            if h is not None and h._error is not None:
                raise CheckpointError(f"background copy of step {h.step} failed: {h._error}") from h._error

    def _hook(self, optim: torch.optim.Optimizer) -> None:
        if optim in self._hooked:
            return
        ref = weakref.ref(self)

        def pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            client = ref()
            if client is not None and client._inflight is not None:
                client._inflight.join()  # errors surface from wait() / the next snapshot

        optim.register_step_pre_hook(pre_step)
        self._hooked.add(optim)

    # ------------------------------------------------------------------ wait / restore

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait until the snapshots this client took (the newest 64) are durable; return their directories."""
        deadline = None if timeout is None else time.monotonic() + timeout
        paths = []
        while self._pending:
            h = self._pending[0]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                paths.append(h.wait(left))
            except CheckpointError:
                self._pending.pop(0)  # a failed step is reported once; a timeout keeps it pending
                raise
            self._pending.pop(0)
        return paths

    def restore(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None = None,
        *,
        step: int | None = None,
        path: str | None = None,
        hot: bool = True,
    ) -> dict[str, Any]:
        """Load the newest committed step (or ``step``, or the checkpoint at ``path``) in place.

        Returns this rank's ``extra``. With ``path`` no daemon is needed. Otherwise, if the daemon
        still holds every shard of that step in shared memory (a trainer restarted on the same node
        after a crash), the bytes come from there and no shard is read from disk (``hot=False``
        reads the disk anyway); else the daemon picks the newest complete step under its root or in
        its bucket, downloading it into the root first if only the bucket has it. :attr:`last_restore`
        says which it was: ``"memory"``, ``"disk"`` or ``"bucket"``.
        """
        from .reader import CheckpointReader, restore_state

        self._finish_inflight()
        rank, _ = _dist_rank_world()
        if path is not None:
            extra = restore_state(path, model, optim, rank)
            self.last_restore = {"step": None, "path": path, "source": "disk"}
            return extra
        held = self._call("hot_open", job=self.job, step=step, pid=os.getpid()) if hot else None
        if held is not None and held["step"] is not None:
            files = {f: shm.path_of(seg) for f, seg in held["segments"].items()}
            reader = CheckpointReader(held["path"], manifest=held["manifest"], files=files)
            try:
                extra = restore_state(held["path"], model, optim, rank, reader=reader)
            finally:
                self._call("hot_close", pid=os.getpid(), segments=list(held["segments"].values()))
            self.last_restore = {"step": held["step"], "path": held["path"], "source": "memory"}
            return extra
        if held is not None:
            log.info("restoring from disk: %s", held["reason"])
        rep = self._fetch(step)
        extra = restore_state(rep["path"], model, optim, rank)
        self.last_restore = {"step": rep["step"], "path": rep["path"], "source": "disk" if rep["source"] == "local" else "bucket"}
        return extra

    def _fetch(self, step: int | None) -> dict[str, Any]:
        """The daemon's answer to which step to restore, downloaded into its root if only the bucket
        had it (a download may take minutes: poll, the daemon is probed between polls)."""
        fid = self._call("fetch", job=self.job, step=step)["fetch"]
        while True:
            rep = self._call("fetch_wait", rpc_timeout=self.timeout + 30.0, fetch=fid, timeout=25.0)
            if rep["state"] == "done":
                return rep
            if rep["state"] == "failed":
                raise CheckpointError(rep["error"])

    def close(self) -> None:
        """Finish the background copy, then drop mappings and sockets. Pending durability is the daemon's."""
        if self._closed:
            return
        try:
            self._finish_inflight()
        except CheckpointError as e:
            warnings.warn(str(e), stacklevel=2)
        for name, m in list(self._maps.items()):
            self._unmap(name, m)
        self._maps.clear()
        with self._sock_lock:
            for s in self._sockets:
                s.close(0)
            self._sockets.clear()
        self._closed = True
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_COPYABLE = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
}


class _EventGroup:
    """The ends of the device-to-host copies of one snapshot (one event per device)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


def _constant_subtrees(tree: dict[str, Any]) -> list[Any]:
    """The parts of a tree that the capture cache hands back unchanged: model refs, optimizer state refs."""
    out = [tree["model"]] if "model" in tree else []
    optim = tree.get("optim")
    if isinstance(optim, dict) and "state" in optim:
        out.append(optim["state"])
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _optimizer_storages(model: torch.nn.Module, optim: torch.optim.Optimizer) -> set[int]:
    """Storages that only ``optim.step()`` mutates: its parameters and its state tensors."""
    out = set()
    for group in optim.param_groups:
        for p in group["params"]:
            out.add(_storage(local_tensor(p)))
    for st in optim.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.add(_storage(local_tensor(v)))
    out.discard(0)
    return out


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy each source into its slot view in one fused call (torch loops per tensor only where the
    tensors sit on different devices)."""
    if dsts:
        with torch.no_grad():  # parameters are sources: skip autograd's per-tensor bookkeeping
            torch._foreach_copy_(dsts, srcs)
