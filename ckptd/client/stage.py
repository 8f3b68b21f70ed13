"""Staging a snapshot: capture the state (:mod:`.capture`), decide which chunks this rank writes
(:mod:`.plan`), lay them out as a shard file (:func:`ckptd.format.build_layout`), and cache all of it
while the state keeps its shape; encode the non-tensor tree for the commit.

Runs on the trainer's main thread inside ``snapshot()`` and ``prepare()``: the plan makes a
collective, so every rank calls it, in the foreground, never from the background copy.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedState
from ..format import ShardLayout, build_layout
from ..protocol import MAX_MESSAGE_BYTES, encode
from ..state import LocalChunk, flatten, replica_id, sample_digest
from .capture import StateCapture, buffer_keys
from .plan import ChunkId, WritePlan

COPYABLE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
}  # fmt: skip
PREPARE_EXTRA_ROOM = 64 << 10  # prepare()'s slots: room beyond the planned state for extra's small tensors


MAX_EXTRA_BYTES = MAX_MESSAGE_BYTES - (16 << 20)  # the rest of the commit (model and optimizer refs) needs room too


@dataclass(frozen=True)
class Stage:
    """What the last snapshot planned: reused while the capture cache holds and the plan is unchanged."""

    chunks: list[LocalChunk]  # the capture's chunk list (the same object while the capture cache holds)
    extra_sig: tuple[Any, ...]  # (key, dtype, sizes) of each ``extra`` tensor
    items: list[tuple[ChunkId, int]]  # what the plan's collective exchanges
    layout: ShardLayout
    sources: list[torch.Tensor | None]  # the live source of each layout chunk; None where an extra tensor goes
    extra_slots: list[tuple[int, str]]  # (layout index, chunk name) of each extra tensor
    any_cuda: bool  # some cached source lives on a GPU
    mine: set[ChunkId]  # the plan's answer the layout was built for


@dataclass(frozen=True)
class Staged:
    """One snapshot, ready to copy: its tree, shard layout, the source of each chunk in layout order,
    replica digests and whether any source is on CUDA."""

    tree: dict[str, Any]
    layout: ShardLayout
    sources: list[torch.Tensor]
    replicas: dict[str, str]
    any_cuda: bool


def _forget_when_gone(stager: Stager, *objs: Any) -> None:
    """Have ``stager`` forget its caches once one of ``objs`` (the model, the optimizer) is collected."""
    ref = weakref.ref(stager)

    def forget() -> None:
        if (s := ref()) is not None:
            s.forget()

    for obj in objs:
        if obj is not None and obj not in stager._watched:
            stager._watched.add(obj)
            weakref.finalize(obj, forget)


class Stager:
    def __init__(self, job: str = "default") -> None:
        self.capture = StateCapture()
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()  # the models and optimizers whose end drops the caches
        self._plan = WritePlan(job)
        self.stage: Stage | None = None
        self.layout: ShardLayout | None = None  # the newest layout built
        self._layout_key: Any = None
        self._buffers: frozenset[str] = frozenset()  # the captured model's buffer keys (:func:`.capture.buffer_keys`)
        self._lowest: tuple[Any, frozenset[ChunkId]] = (None, frozenset())  # (items, the buffer chunks among them)
        self.saved: set[int] = set()  # steps committed since the last restore: saved again, they would replace this run's own

    @property
    def run_id(self) -> int:
        """This launch's id, the same on every rank once a snapshot or ``prepare`` planned."""
        return self._plan.run

    def forget(self) -> None:
        """Drop the cached capture and stage (their views keep the state they were made of alive), once the model
        or optimizer they describe is gone: a re-created optimizer's old state is freed then, not at the next snapshot."""
        self.capture.forget()
        self.stage = None

    @property
    def after(self) -> int | None:
        """The step this rank last restored (through the daemon, DCP or an integration), or ``None``."""
        return self._plan.after

    def restored(self, step: int) -> None:
        """This rank restored ``step``: a new attempt (:meth:`WritePlan.restored`), and no step saved since it."""
        self._plan.restored(step)
        self.saved = set()

    def run(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None,
        extra: dict[str, Any] | None,
        rank: int,
        step: int | None,
        prior: BaseException | None = None,
    ) -> Staged:
        """Capture and plan this snapshot (``step`` ``None``: ``prepare``). Collective: every rank, foreground.
        ``prior``: this rank's error from before (its previous background copy failed), raised here after the
        plan's collective told every rank, so that none waits for it."""
        tree: dict[str, Any] = {}
        chunks: list[LocalChunk] = []
        reused, error = False, prior
        if error is None:
            try:  # a state this rank cannot capture (a sparse tensor) is every rank's failure too
                tree, chunks, reused = self.capture.capture(model, optim)
                if not reused:
                    _forget_when_gone(self, model, optim)
                    self._buffers = buffer_keys(model)
            except (CheckpointError, TypeError, ValueError, RuntimeError) as e:
                error = e
        return self._staged(tree, chunks, reused, extra, rank, step, error=error)

    def run_state(
        self,
        state: dict[str, Any],
        extra: dict[str, Any] | None,
        rank: int,
        step: int | None,
        *,
        any_keys: bool = False,
        solo: bool = False,
        prior: BaseException | None = None,
    ) -> Staged:
        """Plan a snapshot of a state dict given as it is (``{"model": ..., "optim": ...}``; ``any_keys``:
        any string keys, ``extra`` if there is one a dict of each rank's, as a DCP state dict). Collective
        unless ``solo`` (a step this process saves alone, as rank 0 of 1). ``prior``: as for :meth:`run`."""
        error: BaseException | None = prior
        tree: dict[str, Any] = {}
        chunks: list[LocalChunk] = []
        try:  # this rank's mistake is every rank's: the plan's collective below must still run
            if error is None:
                _check_state_keys(state, any_keys)
                tree, chunks = flatten(state)
        except (CheckpointError, TypeError, ValueError) as e:
            error = e
        if error is not None:
            try:
                self._plan.mine([], step, failed=True, solo=solo)
            finally:
                raise error
        return self._staged(tree, chunks, False, extra, rank, step, solo)

    def _staged(
        self,
        tree: dict[str, Any],
        chunks: list[LocalChunk],
        reused: bool,
        extra: dict[str, Any] | None,
        rank: int,
        step: int | None,
        solo: bool = False,
        error: BaseException | None = None,
    ) -> Staged:
        extra_chunks: list[LocalChunk] = []
        cached: Stage | None = None
        items: list[tuple[ChunkId, int]] = []
        extra_sig: tuple[Any, ...] = ()
        try:  # what only this rank can get wrong (or got wrong before): every rank hears of it at the collective, none waits
            if error is None:
                if extra is not None:
                    tree, extra_chunks = _with_extra(tree, extra, rank)
                extra_sig = tuple((c.key, c.tensor.dtype, c.sizes) for c in extra_chunks)
                st = self.stage
                cached = st if reused and st is not None and st.chunks is chunks and st.extra_sig == extra_sig else None
                if cached is None:
                    _check_dtypes(chunks + extra_chunks)
                items = cached.items if cached is not None else [((c.key, c.offsets, c.sizes), c.nbytes) for c in chunks + extra_chunks]
        except (CheckpointError, TypeError, ValueError) as e:
            error = e
        try:
            if self._lowest[0] is not items:  # buffers: written by their lowest-rank holder, never compared across ranks
                self._lowest = (items, self._buffer_chunks(items))
            lowest = self._lowest[1]
            mine, shared = self._plan.mine(items, step, failed=error is not None, solo=solo, lowest=lowest)  # the collective
        except CheckpointError:
            if error is not None:
                raise error from None
            raise
        if error is not None:
            raise error
        if cached is not None and mine is not cached.mine:
            cached = None  # another rank's layout changed and the plan with it: what this rank writes may differ
        # every holder of a replicated chunk reports a digest of its copy: the daemon refuses a step whose
        # "replicas" differ (FQNs that are not globally unique, e.g. per-group expert names); not buffers, whose
        # holders may differ (BatchNorm statistics under DDP or FSDP)
        all_chunks = chunks + extra_chunks if shared else []
        replicas = {
            replica_id(c): sample_digest(c.tensor)
            for c in all_chunks
            if (cid := (c.key, c.offsets, c.sizes)) in shared and cid not in lowest
        }
        stage = cached or self._new_stage(chunks, extra_chunks, extra_sig, items, mine)
        srcs = list(stage.sources)
        if stage.extra_slots:
            fresh = {c.name: c.tensor for c in extra_chunks}
            for i, name in stage.extra_slots:
                srcs[i] = fresh[name]
        any_cuda = stage.any_cuda or any(c.tensor.is_cuda for c in extra_chunks)
        return Staged(tree, stage.layout, srcs, replicas, any_cuda)  # type: ignore[arg-type]

    def _new_stage(
        self,
        chunks: list[LocalChunk],
        extra_chunks: list[LocalChunk],
        extra_sig: tuple[Any, ...],
        items: list[tuple[ChunkId, int]],
        mine: set[ChunkId],
    ) -> Stage:
        written = [c for c in chunks + extra_chunks if (c.key, c.offsets, c.sizes) in mine]
        layout = self._layout_for(written)
        by_name = {c.name: c for c in written}
        extra_names = {c.name for c in extra_chunks}
        sources = [None if spec.name in extra_names else by_name[spec.name].tensor for spec in layout.chunks]
        extra_slots = [(i, spec.name) for i, spec in enumerate(layout.chunks) if spec.name in extra_names]
        any_cuda = any(t is not None and t.is_cuda for t in sources)
        self.stage = Stage(chunks, extra_sig, items, layout, sources, extra_slots, any_cuda, mine)
        return self.stage

    def _buffer_chunks(self, items: list[tuple[ChunkId, int]]) -> frozenset[ChunkId]:
        """Of ``items``, the chunks of the model's buffers: written by their lowest-rank holder, never compared."""
        return frozenset(cid for cid, _ in items if cid[0] in self._buffers) if self._buffers else frozenset()

    def projected_size(self, project: Callable[[list[Any]], list[Any]]) -> int:
        """``prepare()``: the shard size of what ``project`` makes of every chunk this rank holds (the state the
        optimizer's first step adds, :mod:`.sizing`), with the chunks it writes planned afresh over every rank's
        projection (a collective: replicated chunks, the new state among them, are spread again)."""
        st = self.stage
        assert st is not None, "staged before"
        held = [(c.name, c.key, c.tensor.dtype, c.sizes, c.global_shape, c.offsets) for c in st.chunks]
        items = project(held)
        planned = [((key, offs, sizes), math.prod(sizes) * dtype.itemsize) for _, key, dtype, sizes, _, offs in items]
        mine, _ = self._plan.mine(planned, lowest=self._buffer_chunks(planned))  # as snapshots plan
        slack = 4096 + 128 * (len(items) - len(held))  # the header's real names of the state to come may be longer
        # and room for small tensors in extra, which prepare() does not see (an RNG state: 5 KB per generator)
        room = PREPARE_EXTRA_ROOM + (slack if len(items) > len(held) else 0)
        return build_layout([it for it in items if (it[1], it[5], it[3]) in mine]).file_size + room

    def _layout_for(self, chunks: list[LocalChunk]) -> ShardLayout:
        key = tuple((c.name, c.key, c.tensor.dtype, c.sizes, c.global_shape, c.offsets) for c in chunks)
        if key != self._layout_key or self.layout is None:
            self.layout = build_layout(list(key))
            self._layout_key = key
        return self.layout


def _check_state_keys(state: Any, any_keys: bool) -> None:
    if not isinstance(state, dict) or not state or not all(isinstance(k, str) for k in state):
        raise CheckpointError(f"a state to snapshot is a dict with string keys, got {type(state).__name__} {str(state)[:80]}")
    if any_keys:
        if "extra" in state and not (isinstance(state["extra"], dict) and all(k.isdigit() for k in state["extra"])):
            raise CheckpointError("the state's 'extra' entry is ckptd's per-rank extra ({'<rank>': {...}}): rename that entry")
    elif "model" not in state or set(state) - {"model", "optim"}:
        raise CheckpointError('a state to snapshot is {"model": <state dict>, "optim": <optimizer state dict>} (optim optional)')


def _with_extra(tree: dict[str, Any], extra: Any, rank: int) -> tuple[dict[str, Any], list[LocalChunk]]:
    if not isinstance(extra, dict):
        raise UnsupportedState(f"extra must be a dict, got {type(extra).__name__}")
    extra_tree, extra_chunks = flatten({"extra": {str(rank): extra}}, ordered=True)
    _check_extra_size(extra_tree)
    return {**tree, **extra_tree}, extra_chunks


def _check_dtypes(chunks: list[LocalChunk]) -> None:
    for ch in chunks:
        if ch.tensor.layout is not torch.strided:
            raise UnsupportedState(
                f"tensor {ch.key!r} is {str(ch.tensor.layout).removeprefix('torch.')}: ckptd stores dense tensors"
                " (save t.to_dense() and convert it back after the restore)"
            )
        if ch.tensor.dtype not in COPYABLE:
            raise UnsupportedState(
                f"tensor {ch.key!r} has dtype {ch.tensor.dtype}, which ckptd cannot store"
                f" (it stores {', '.join(sorted(str(d).removeprefix('torch.') for d in COPYABLE))})"
            )


def _check_extra_size(extra_tree: dict[str, Any]) -> None:
    """``extra``'s non-tensor values travel in the commit message: refuse them, naming the sizes, when
    they cannot fit (its tensors and numpy arrays go to shared memory and do not count)."""
    n = len(encode(extra_tree))
    if n > MAX_EXTRA_BYTES:
        raise CheckpointError(
            f"extra's non-tensor values take {n / 2**20:.1f} MiB as JSON, over the {MAX_EXTRA_BYTES / 2**20:.0f} MiB limit"
            " of a commit message: keep large data in tensors or numpy arrays (stored in shared memory, no limit)"
        )


def _constant_subtrees(tree: dict[str, Any]) -> list[Any]:
    """The parts of a tree that the capture cache hands back unchanged: model refs, optimizer state refs."""
    out = [tree["model"]] if "model" in tree else []
    optim = tree.get("optim")
    if isinstance(optim, dict) and "state" in optim:
        out.append(optim["state"])
    return out


class TreeEncoder:
    """The JSON of a snapshot's tree for its commit, re-using the encoding of the subtrees the capture
    cache re-used (the per-tensor references: ~0.6 us each to encode). Any one thread at a time."""

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Any, bytes]] = {}

    def encode(self, tree: dict[str, Any]) -> bytes:
        memo = self._memo

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
        self._memo = {id(v): (v, memo[id(v)][1] if id(v) in memo and memo[id(v)][0] is v else encode(v)) for v in _constant_subtrees(tree)}
        return b"{" + b",".join(parts) + b"}"
