"""Capture a model's and optimizer's state for a snapshot: torch's ``get_state_dict`` the first
time, then a validated cache.

``get_state_dict`` and flattening cost ~9 us per tensor (90 ms for 10,000 tensors), far more than
copying small tensors. When every chunk it produced is a view of a live tensor — a parameter, a
buffer or optimizer state, as for plain modules, DDP and FSDP2 — the same views keep showing the
current values, so later snapshots reuse them as long as a fingerprint of the live tensors (data
pointer and size of each, the optimizer's groups) and of the names they are saved under is unchanged.
Replacing a parameter (``p.data = ...``), resizing one, loading optimizer state, adding a parameter,
renaming a submodule, registering a parametrization or making a buffer non-persistent changes the
fingerprint and the next snapshot captures afresh. Chunks that are not live views (FSDP1's
sharded state dict clones them) disable the cache, as does non-tensor state outside the
optimizer's hyperparameters. Runs on the trainer's main thread.

A snapshot and a restore both refuse, naming it, state that has no key to go under (:func:`refuse_unnamed`: a
lazy module not initialized yet, an optimizer parameter outside the model) and a restore state with no memory to
load into (:func:`refuse_meta`).
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..state import TAG, LocalChunk, flatten, join_key

_no_init_lock = threading.Lock()
_no_init_depth = 0


@contextmanager
def no_optimizer_init() -> Iterator[None]:
    """Within this block torch's ``get_state_dict`` / ``set_state_dict`` leave an optimizer without
    state as it is.

    Both call ``torch.distributed.checkpoint.state_dict._init_optim_state``, which, for an optimizer
    that has no state yet and no gradients, creates gradients and runs ``optim.step()`` with a zero
    learning rate: AdamW then starts the real first step with ``step=1``, its hooks and an LR
    scheduler see a step, and training diverges from the same run without a checkpointer. ckptd
    never changes the training it protects, so it swaps that function for a no-op while it reads or
    loads state (process-wide, reference-counted: another thread's call in the same window keeps the
    optimizer as it is too). An optimizer without state is then saved, like ``optim.state_dict()``,
    with an empty ``state``.
    """
    global _no_init_depth
    import torch.distributed.checkpoint.state_dict as sd

    with _no_init_lock:
        if _no_init_depth == 0:
            sd._ckptd_init_optim_state = getattr(sd, "_init_optim_state", None)  # type: ignore[attr-defined]
            sd._init_optim_state = _leave_optimizer_alone  # type: ignore[attr-defined]
        _no_init_depth += 1
    try:
        yield
    finally:
        with _no_init_lock:
            _no_init_depth -= 1
            if _no_init_depth == 0:
                sd._init_optim_state = sd._ckptd_init_optim_state  # type: ignore[attr-defined]


def _leave_optimizer_alone(optim: torch.optim.Optimizer) -> None:
    return None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's local shard, without to_local()'s overhead


def _live(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> list[torch.Tensor] | None:
    """The tensors the state is made of, or ``None`` if some optimizer state is not a tensor."""
    out = [local_tensor(p) for p in model.parameters()]
    out += [local_tensor(b) for b in model.buffers()]
    if optim is not None:
        for st in optim.state.values():
            for v in st.values():
                if not isinstance(v, torch.Tensor):
                    return None
                out.append(local_tensor(v))
    return out


_PLAIN = {torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", torch.Tensor)}
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_STRIDE = torch.Tensor.stride
_DTYPE = operator.attrgetter("dtype")
_PARAMS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
_CHILDREN = operator.attrgetter("_modules")
_NON_PERSISTENT = operator.attrgetter("_non_persistent_buffers_set")
_KEYS = operator.methodcaller("keys")


def _fingerprint(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> list[Any] | None:
    """Size of each optimizer group and the identity of each parameter in it, the names each module gives its
    parameters, buffers and children and which buffers it does not save, then data pointer, element count,
    strides and dtype of every parameter, buffer and optimizer-state tensor (a DTensor's local shard), and the
    shapes of the empty ones (which all have data pointer 0). This runs on every snapshot, so it maps C methods
    over flat lists instead of looping in Python: ~0.4 us per tensor, ~0.4 us per module. ``None`` if some
    optimizer state is not a tensor."""
    mods = list(model.modules())
    ts = [t for m in mods for d in (m._parameters, m._buffers) for t in d.values() if t is not None]
    # the keys the state is saved under: a renamed submodule, a parametrization (``weight`` becomes
    # ``parametrizations.weight.original``, the same tensor) or a buffer made non-persistent keep every tensor
    # keys(): a scripted submodule's dicts are wrappers that tuple() cannot iterate
    fp: list[Any] = [*map(tuple, map(_KEYS, map(_PARAMS, mods))), *map(tuple, map(_KEYS, map(_BUFFERS, mods)))]
    fp += map(tuple, map(_KEYS, map(_CHILDREN, mods)))
    fp += map(frozenset, map(_NON_PERSISTENT, mods))
    if optim is not None:
        fp += [len(g["params"]) for g in optim.param_groups]
        fp += map(id, itertools.chain.from_iterable(g["params"] for g in optim.param_groups))  # groups reordered or regrouped
        for st in optim.state.values():
            ts += st.values()
    if any(type(t) not in _PLAIN for t in ts):
        if not all(isinstance(t, torch.Tensor) for t in ts):
            return None
        ts = [local_tensor(t) for t in ts]
    try:
        fp += map(_DATA_PTR, ts)
    except (RuntimeError, ValueError):  # a tensor without storage (sparse), or a lazy one not initialized: the capture names it
        return None
    numels = list(map(_NUMEL, ts))  # with the strides, the shape of every tensor but an empty one (torch.Size is 20x dearer)
    fp += numels
    fp += map(_STRIDE, ts)  # a transpose (``p.data = p.data.t()``)
    fp += map(_DTYPE, ts)  # a same-size view of another dtype
    if 0 in numels:  # empty tensors all have data pointer 0: their shapes tell them apart
        fp += [t.shape for t, n in zip(ts, numels) if n == 0]
    return fp


def _only_tensor_refs(node: Any, depth: int) -> bool:
    if depth == 0:
        return isinstance(node, dict) and node.get(TAG) == "tensor"
    return isinstance(node, dict) and TAG not in node and all(_only_tensor_refs(v, depth - 1) for v in node.values())


@dataclass
class _Cached:
    model: Any  # weak references: the cache never keeps a model or an optimizer alive
    optim: Any
    fingerprint: list[Any]
    tree: dict[str, Any]
    chunks: list[LocalChunk]
    params: list[Any]  # each param group's encoded "params" (FQN list)


class StateCapture:
    """Turns (model, optimizer) into a JSON tree and the local chunks it refers to, reusing the last
    capture while it provably still describes the live state."""

    def __init__(self) -> None:
        self._cached: _Cached | None = None
        self.hits = 0

    def forget(self) -> None:
        self._cached = None

    def capture(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> tuple[dict[str, Any], list[LocalChunk], bool]:
        """``(tree, chunks, reused)``; ``chunks`` is the same list object whenever ``reused``."""
        fp = _fingerprint(model, optim)
        c = self._cached
        if c is not None and fp is not None and c.model() is model and c.optim() is optim and c.fingerprint == fp:
            tree = dict(c.tree)
            groups = self._param_groups(optim, c.params) if optim is not None else None
            if optim is None or groups is not None:
                if groups is not None:
                    tree["optim"] = {**c.tree["optim"], "param_groups": groups}
                self.hits += 1
                return tree, c.chunks, True
        tree, chunks = self._full(model, optim)
        self._cached = None
        live = _live(model, optim) if fp is not None else None
        if live is not None and self._cacheable(tree, chunks, live, optim):
            params = [g["params"] for g in tree["optim"]["param_groups"]] if optim is not None else []
            self._cached = _Cached(weakref.ref(model), weakref.ref(optim) if optim is not None else lambda: None, fp, tree, chunks, params)
        return tree, chunks, False

    @staticmethod
    def _full(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> tuple[dict[str, Any], list[LocalChunk]]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        refuse_unnamed(model, optim, "snapshot")
        if optim is not None:
            with no_optimizer_init():
                msd, osd = get_state_dict(model, optim)
            return flatten({"model": msd, "optim": osd})
        return flatten({"model": get_model_state_dict(model)})

    @staticmethod
    def _cacheable(tree: dict[str, Any], chunks: list[LocalChunk], live: list[torch.Tensor], optim: torch.optim.Optimizer | None) -> bool:
        storages = {t.untyped_storage().data_ptr() for t in live}
        if not all(ch.tensor.untyped_storage().data_ptr() in storages for ch in chunks):
            return False  # some chunk is a copy (FSDP1), not a view of live state
        if not _only_tensor_refs(tree["model"], 1):
            return False  # e.g. a module's get_extra_state()
        if optim is None:
            return True
        o = tree["optim"]
        if set(o) != {"state", "param_groups"} or not _only_tensor_refs(o["state"], 2):
            return False
        return not any(isinstance(v, torch.Tensor) for g in optim.param_groups for k, v in g.items() if k != "params")

    @staticmethod
    def _param_groups(optim: torch.optim.Optimizer, params: list[Any]) -> list[Any] | None:
        """Current hyperparameters (a scheduler changes lr between snapshots) with the cached FQN lists;
        ``None`` when one became a tensor (a capturable ``lr``): it is state to copy, so a full capture."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
        enc, chunks = flatten({"g": groups})
        return None if chunks else [{**g, "params": p} for g, p in zip(enc["g"], params)]


def buffer_keys(model: torch.nn.Module) -> frozenset[str]:
    """The state keys of ``model``'s buffers (``model/<fqn>``, wrapper prefixes dropped as ``get_state_dict`` drops
    them). Ranks may hold different bytes under them legitimately: DDP broadcasts rank 0's buffers at each forward,
    then BatchNorm updates each rank's running statistics from its own batch; FSDP never syncs them."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return frozenset(join_key(("model", fqn)) for name, _ in model.named_buffers() for fqn in _get_fqns(model, name))


def refuse_unnamed(model: torch.nn.Module, optim: torch.optim.Optimizer | None, doing: str) -> None:
    """Raise :class:`CheckpointError` for state that has no key to be saved or restored under: a parameter or
    buffer of a lazy module not initialized yet (it has no shape; torch's own load would materialize it, which a
    restore refused later could not undo), or an optimizer parameter that is not one of the model's (SAC's
    ``log_alpha`` beside the model, or one made on the meta device before the model was materialized: torch's
    ``get_state_dict`` names state by model FQN and fails with a bare ``KeyError``). ``doing``: the verb for the
    message (``"snapshot"``, ``"restore into"``). Costs a pass over the model's tensors: run it on a full capture only."""
    from torch.nn.parameter import UninitializedTensorMixin

    if any(isinstance(t, UninitializedTensorMixin) for m in model.modules() for d in (m._parameters, m._buffers) for t in d.values()):
        name = next(
            n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if isinstance(t, UninitializedTensorMixin)
        )
        raise CheckpointError(
            f"cannot {doing} {join_key(('model', name))}: it belongs to a lazy module that is not initialized yet and has no shape."
            " Run one forward pass (a batch of the real input shape) first, then call this again"
        )
    if optim is None:
        return
    mine = set(map(id, itertools.chain(model.parameters(), model.buffers())))  # what get_state_dict can name
    for i, group in enumerate(optim.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in mine:
                on_meta = " It is on the meta device: create the optimizer after materializing the model." if p.is_meta else ""
                raise CheckpointError(
                    f"cannot {doing} the optimizer: parameter {j} of its param group {i} (shape {list(p.shape)}) is not a parameter"
                    f" of the model, so its state has no name to go under.{on_meta} An optimizer made before the model was wrapped"
                    " (fully_shard, FSDP) holds the parameters the wrapper replaced: make it after wrapping. Else register the"
                    " tensor on a module of the model (an nn.Parameter attribute), or give it an optimizer of its own and save"
                    " that one's state_dict() and the tensor in extra"
                )


def refuse_meta(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> None:
    """Raise :class:`CheckpointError` naming the first parameter, buffer or optimizer state of ``model``
    and ``optim`` on the ``meta`` device: it has no memory to load into (torch's own load would skip it
    with a warning, and the model would train from nothing)."""
    named = [(f"parameter {n!r}", t) for n, t in model.named_parameters()] + [(f"buffer {n!r}", t) for n, t in model.named_buffers()]
    if optim is not None:
        named += [(f"optimizer state {n!r}", v) for st in optim.state.values() for n, v in st.items() if isinstance(v, torch.Tensor)]
    for name, t in named:
        if local_tensor(t).is_meta:
            raise CheckpointError(
                f"cannot restore into {name}: it is on the meta device, which holds no data to load into. Materialize the"
                " model first (model.to_empty(device=...), then restore; FSDP2: after fully_shard), and create the optimizer after that"
            )
