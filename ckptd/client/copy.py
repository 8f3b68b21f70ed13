"""Copying a staged snapshot into a slot: the trainer's mappings of its slots, the copies (now, early,
in the background, from CUDA), and the guard that holds ``optimizer.step()`` until they are done.

Who runs what, in a training process:

* :class:`SlotMaps` and :func:`fill` — the training thread, inside ``snapshot()``: map the slot
  (once, kept warm), write the shard header, copy every tensor the optimizer step does not own (and,
  blocking, every tensor); CUDA sources are enqueued on a side stream.
* :class:`EarlyCopy` — a snapshot copied before it returns, of many tensors whose stage is cached, starts copying on a
  worker thread while the training thread checks the capture (torch releases the GIL while copying).
* :class:`CopyGuard` — the background thread that copies what only ``optimizer.step()`` mutates and
  then commits; an optimizer step pre-hook, the next snapshot, ``restore()`` and ``wait()`` join it
  first. The background thread makes no collectives and touches nothing but the slot and the socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import shm
from ..errors import CheckpointError
from ..format import ShardLayout, dtype_from_name
from .guarded import Watch, storage_of
from .stage import Stage, Staged

log = logging.getLogger("ckptd.client")
MAPPINGS_KEPT = 4  # warm mappings per client: the slots a rank alternates between
EARLY_COPY_MIN_TENSORS = 1000  # below this the capture check costs little next to the copy

Pairs = tuple[list[torch.Tensor], list[torch.Tensor]]  # (destinations, sources)


def copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy each source into its slot view in one fused call (torch loops per tensor only where the
    tensors sit on different devices)."""
    if dsts:
        with torch.no_grad():  # parameters are sources: skip autograd's per-tensor bookkeeping
            torch._foreach_copy_(dsts, srcs)


class EventGroup:
    """The ends of the device-to-host copies of one snapshot (one event per device)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


class SlotMaps:
    """The trainer's mappings of the slots it was leased: mapped once (``MAP_POPULATE``) and kept
    (least recently used dropped beyond :data:`MAPPINGS_KEPT`), with typed views per layout and, for
    CUDA sources, page-locked. Training thread, and the background thread for a mapping it was given."""

    def __init__(self) -> None:
        self._maps: OrderedDict[str, shm.Mapping] = OrderedDict()
        self._views: dict[str, tuple[ShardLayout, list[torch.Tensor]]] = {}
        self.pinned: set[str] = set()  # mappings page-locked for device copies
        self.made_on_path = 0  # slots first mapped by a snapshot (not by prepare() or a spare's warming)
        self._lock = threading.Lock()  # the training thread and a spare's warming both add mappings
        self.closed = False

    def names(self) -> set[str]:
        with self._lock:
            return set(self._maps)

    def mapping(self, name: str) -> shm.Mapping:
        with self._lock:
            m = self._maps.get(name)
            if m is None:
                # a new slot: first let go of mappings whose segment is gone (a restarted daemon unlinked the old
                # one's, or renamed a slot): never used again, their pages would stay allocated outside any budget
                for old in [n for n in self._maps if not os.path.exists(shm.path_of(n))]:
                    self._unmap(old, self._maps.pop(old))
                m = shm.Mapping(name)
                self.made_on_path += 1
                self._maps[name] = m
                while len(self._maps) > MAPPINGS_KEPT:
                    self._unmap(*self._maps.popitem(last=False))
            self._maps.move_to_end(name)
            return m

    def warm(self, names: list[str], pin: bool, device: int | None = None) -> None:
        """Map the segments ``names`` side by side (and page-lock them for GPU ``device``, by default the
        current one, ``pin``): ``prepare()`` takes the one-time cost of each slot at once, off the
        training loop (and :mod:`.spare` that of a spare slot, on a thread of its own). Segments already
        mapped are kept as they are; at most :data:`MAPPINGS_KEPT` are warmed. The pages are faulted in
        outside the GIL (:func:`.shm.populate_write`)."""
        with self._lock:
            for name in names:
                if name in self._maps:
                    self._maps.move_to_end(name)
            fresh = [n for n in names[-MAPPINGS_KEPT:] if n not in self._maps]
        if pin:
            device = torch.cuda.current_device() if device is None else device  # a new thread's device is 0

        def on_device() -> Any:  # (un)pinning on the trainer's GPU, from any thread
            return torch.cuda.device(device) if pin else contextlib.nullcontext()

        def one(name: str) -> tuple[shm.Mapping, bool]:
            m = shm.Mapping(name, populate=False)
            assert m.tensor is not None
            if not shm.populate_write(m.tensor.data_ptr(), m.size):
                log.debug("slot %s mapped without its pages (no MADV_POPULATE_WRITE): they fault on its first copy", name)
            if not pin:
                return m, False
            from . import cuda

            with on_device():
                return m, cuda.pin(m.tensor.data_ptr(), m.size)

        with ThreadPoolExecutor(max(1, len(fresh))) as pool:
            futures = [(name, pool.submit(one, name)) for name in fresh]
        errors = []
        with self._lock, on_device():
            for name, f in futures:  # every mapping made is kept (and so closed later), whichever failed
                try:
                    m, pinned = f.result()
                except Exception as e:
                    errors.append(e)
                    continue
                if name in self._maps or self.closed:  # mapped meanwhile by the other thread, or the client closed
                    self._drop(m, pinned)
                    continue
                self._maps[name] = m
                if pinned:
                    self.pinned.add(name)
            while len(self._maps) > MAPPINGS_KEPT:
                self._unmap(*self._maps.popitem(last=False))
        if errors:
            raise errors[0]

    def destinations(self, m: shm.Mapping, layout: ShardLayout) -> list[torch.Tensor]:
        """Typed views of the slot, one per chunk in layout order; built once per (slot, layout)."""
        cached = self._views.get(m.name)
        if cached is not None and cached[0] is layout:
            return cached[1]
        base = m.tensor
        assert base is not None
        start = layout.data_start
        dsts = [base[start + spec.begin : start + spec.end].view(dtype_from_name(spec.dtype)).view(spec.sizes) for spec in layout.chunks]
        self._views[m.name] = (layout, dsts)
        return dsts

    def prepared(self, name: str, layout: ShardLayout) -> tuple[shm.Mapping, list[torch.Tensor]]:
        """The slot mapped, the shard header written, and its destination views."""
        m = self.mapping(name)
        m.view[: layout.data_start] = layout.header
        return m, self.destinations(m, layout)

    def pin(self, m: shm.Mapping) -> None:
        """Page-lock a mapping for device-to-host copies (once; a no-op where it cannot be)."""
        from . import cuda

        if m.name not in self.pinned and m.tensor is not None and cuda.pin(m.tensor.data_ptr(), m.size):
            self.pinned.add(m.name)

    def _unmap(self, name: str, m: shm.Mapping) -> None:
        self._views.pop(name, None)  # its views pin the mapping
        self._drop(m, name in self.pinned)
        self.pinned.discard(name)

    @staticmethod
    def _drop(m: shm.Mapping, pinned: bool) -> None:
        if pinned and m.tensor is not None:
            from . import cuda

            cuda.unpin(m.tensor.data_ptr())
        m.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True  # a warming that ends later drops what it mapped
            for name, m in list(self._maps.items()):
                self._unmap(name, m)
            self._maps.clear()


def copy_cuda(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], guarded: list[bool]
) -> tuple[EventGroup, list[torch.Tensor], list[torch.Tensor], list[bool]]:
    """Enqueue the CUDA sources' copies; return their event, the pairs left to copy on the CPU and their marks.

    Tensors the optimizer step does not own (buffers that forward mutates, extra state) are copied
    first, and the training stream waits for them on the GPU: the next forward's kernels queue behind
    those copies, the CPU does not block. Parameters and optimizer state are only mutated by
    optimizer.step(), which the pre-hook holds until the returned event."""
    from . import cuda

    by_device: dict[Any, tuple[list[int], list[int]]] = {}
    for i, src in enumerate(srcs):
        if src.is_cuda:
            first, second = by_device.setdefault(src.device, ([], []))
            (second if guarded and guarded[i] else first).append(i)
    events = []
    for first, second in by_device.values():
        if first:
            ev = cuda.copy_async([dsts[i] for i in first], [srcs[i] for i in first])
            torch.cuda.current_stream(srcs[first[0]].device).wait_event(ev)
            events.append(ev)
        if second:
            events.append(cuda.copy_async([dsts[i] for i in second], [srcs[i] for i in second]))
    rest = [i for i, src in enumerate(srcs) if not src.is_cuda]
    return EventGroup(events), [dsts[i] for i in rest], [srcs[i] for i in rest], [guarded[i] for i in rest] if guarded else []


@dataclass
class Behind:
    """What a snapshot leaves for its background thread: pairs to copy, device copies to wait for, sources to watch."""

    pairs: Pairs = field(default_factory=lambda: ([], []))
    event: EventGroup | None = None
    watch: Watch | None = None

    @property
    def pending(self) -> bool:
        return bool(self.pairs[0]) or self.event is not None

    def run(self, step: int | None) -> None:
        """Finish the copy (background thread: no collectives); raise if a watched source moved meanwhile."""
        # one intra-op thread for this thread only, so the copy does not start a second OpenMP team beside the
        # training step's; put back after: the setting is also the default of threads made later
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            copy_tensors(*self.pairs)
            if self.event is not None:
                self.event.synchronize()  # the device-to-host copies have landed in the slot
        finally:
            torch.set_num_threads(threads)
        if self.watch is not None:
            self.watch.check(step)  # nothing wrote them meanwhile: the copy is of the snapshot's moment


def fill(maps: SlotMaps, segment: str, staged: Staged, guarded: set[int], blocking: bool) -> Behind:
    """Write the header and copy into ``segment`` what must be copied before ``snapshot()`` returns;
    return what is left for the background thread."""
    m, dsts = maps.prepared(segment, staged.layout)
    srcs = staged.sources
    marks = [storage_of(s) in guarded for s in srcs] if guarded else []  # copied behind the next step
    watch = None
    if any(marks):
        picked = [i for i, g in enumerate(marks) if g]
        watch = Watch([staged.layout.chunks[i].key for i in picked], [srcs[i] for i in picked])
    event = None
    if staged.any_cuda:
        # GPU path: device-to-host copies on a side stream into the page-locked slot, now
        maps.pin(m)
        event, dsts, srcs, marks = copy_cuda(dsts, srcs, marks)
    now: Pairs = ([], [])
    later: Pairs = ([], [])
    if not marks:
        now = (dsts, srcs)
    else:
        for dst, src, g in zip(dsts, srcs, marks):
            side = later if g else now
            side[0].append(dst)
            side[1].append(src)
    copy_tensors(*now)
    if blocking and event is not None:
        event.synchronize()
        event = None
    return Behind(later, event, watch)


class EarlyCopy:
    """The copy of a snapshot copied before it returns, started before its capture check finished.

    :meth:`start` copies the cached stage's sources on a worker thread; :meth:`finish` keeps the copy
    only if the capture held (the stager kept the same :class:`Stage` object: every cached source is a
    view of the live state) and adds this snapshot's ``extra`` tensors; else the copy is thrown away.
    """

    def __init__(self, maps: SlotMaps, segment: str, stage: Stage) -> None:
        self.maps, self.segment, self.stage = maps, segment, stage
        self.error: BaseException | None = None
        m, dsts = maps.prepared(segment, stage.layout)
        self.mapping = m
        self._pairs: Pairs = (dsts, stage.sources)  # type: ignore[assignment]
        if stage.extra_slots:  # those are this snapshot's: copied by finish()
            skip = {i for i, _ in stage.extra_slots}
            self._pairs = ([d for i, d in enumerate(dsts) if i not in skip], [t for i, t in enumerate(stage.sources) if i not in skip])  # type: ignore[misc]
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-early-copy", daemon=True)

    @staticmethod
    def worth_it(stage: Stage | None) -> bool:
        """Only for a cached, CPU-only stage with many tensors (else the capture check costs little)."""
        return stage is not None and not stage.any_cuda and len(stage.sources) >= EARLY_COPY_MIN_TENSORS

    def start(self) -> None:
        self._thread.start()
        self._started.wait()  # let it take the GIL once, into the copy, before this thread goes on

    def _run(self) -> None:
        self._started.set()
        try:
            copy_tensors(*self._pairs)
        except BaseException as e:  # the training thread decides: it copies again, or raises
            self.error = e

    def join(self) -> None:
        self._thread.join()

    def finish(self, current: Stage | None, staged: Staged) -> bool:
        """After the capture check: True if the slot is filled for ``staged`` (the caller commits it),
        False if the copy is stale or failed (the caller gives the segment back and copies afresh)."""
        self.join()
        if self.error is not None or current is not self.stage or staged.any_cuda:
            return False
        if self.stage.extra_slots:  # this snapshot's own extra tensors
            dsts = self.maps.destinations(self.mapping, staged.layout)
            copy_tensors([dsts[i] for i, _ in self.stage.extra_slots], [staged.sources[i] for i, _ in self.stage.extra_slots])
        return True


_GUARDS: weakref.WeakSet[CopyGuard] = weakref.WeakSet()  # every client's, in this process
_GUARDS_LOCK = threading.Lock()  # a client made on another thread while a restore lists them


def join_all() -> None:
    """Wait for every client's background copy in flight (a restore writes into tensors another client of this
    process may still be copying; their errors stay theirs)."""
    with _GUARDS_LOCK:
        guards = list(_GUARDS)
    for guard in guards:
        guard.join()


class CopyGuard:
    """At most one background copy per client, and the optimizer pre-hook that waits for it."""

    def __init__(self) -> None:
        with _GUARDS_LOCK:
            _GUARDS.add(self)
        self._thread: threading.Thread | None = None
        self._error: Callable[[], BaseException | None] = lambda: None
        self._step: int | None = None
        self._hooked: Any = None  # the handle of the process-wide optimizer step pre-hook

    def start(self, step: int, run: Callable[[], None], error: Callable[[], BaseException | None]) -> None:
        """Run ``run`` on a background thread; ``error()`` tells afterwards whether it failed."""
        t = threading.Thread(target=run, name=f"ckptd-copy-{step}", daemon=False)
        self._thread, self._error, self._step = t, error, step
        t.start()

    def join(self) -> None:
        """Wait for the copy in flight, if any (errors surface from :meth:`finish`)."""
        t = self._thread
        if t is not None:
            t.join()

    def finish(self) -> None:
        """Wait for the copy in flight, forget it, and raise its error once."""
        err = self.settle()
        if err is not None:
            raise err

    def settle(self) -> CheckpointError | None:
        """Wait for the copy in flight, forget it, and return its error (once) rather than raise it: a
        collective snapshot hands it to the plan, so that every rank fails together instead of this one alone."""
        t = self._thread
        if t is None:
            return None
        t.join()
        err, step = self._error(), self._step
        self._thread, self._error, self._step = None, lambda: None, None
        if err is None:
            return None
        out = CheckpointError(f"background copy of step {step} failed: {err}")
        out.__cause__ = err
        return out

    def hook(self) -> None:
        """Make every ``torch.optim`` optimizer's ``step()`` wait for the copy in flight: the one passed to
        ``snapshot()``, and one re-created since that steps the same parameters (a new training phase)."""
        if self._hooked is not None:
            return
        ref = weakref.ref(self)

        def pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            guard = ref()
            if guard is not None:
                guard.join()

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hooked = register_optimizer_step_pre_hook(pre_step)
        # first of the global pre-hooks: one registered before it (a projection, a clamp inside the step) would
        # otherwise write the parameters while the copy reads them (torch runs them in registration order)
        with contextlib.suppress(AttributeError, KeyError, TypeError):
            from torch.optim import optimizer as _optimizer

            _optimizer._global_optimizer_pre_hooks.move_to_end(self._hooked.id, last=False)
        weakref.finalize(self, self._hooked.remove)  # a client never closed leaves no hook behind either

    def unhook(self) -> None:
        """Remove the pre-hook (the client is closing: nothing of ckptd stays on the optimizers)."""
        if self._hooked is not None:
            self._hooked.remove()
            self._hooked = None
