"""Load a committed checkpoint into whatever layout the caller's model and optimizer have, and say
what did not match.

The target drives: torch's ``get_state_dict`` gives the caller's state in its current layout
(sharded or not); every tensor chunk this process holds is read from the intersecting saved chunks
(:class:`.reader.CheckpointReader`, so any world size, wrapper or sub-group sharding works); every
non-tensor leaf takes the saved value at the same path; torch's ``set_state_dict`` loads the result.

Keys are ckptd state keys: ``model/<fqn>`` and ``optim/state/<fqn>`` (or ``.../<name>`` for one
entry). ``strict`` (the default), like ``load_state_dict``: a target tensor the checkpoint lacks
(*missing*) or a saved model tensor or optimizer entry that no rank's target has (*unexpected*) is a
:class:`CheckpointError` listing them. ``strict=False`` loads the intersection: a missing tensor
keeps the target's value (a new head), a parameter without saved optimizer state ends without state
(as a fresh optimizer has), and :class:`Restored` lists both. With torch.distributed initialized and
more than one rank, which saved keys are unexpected is agreed with one ``all_gather_object`` (every
MoE rank holds only its own experts): a restore is then collective, every rank calls it.

An optimizer is given state to load into only when the checkpoint holds some: a checkpoint taken
before the first step restores an optimizer without state, as ``optim.state_dict()`` had it.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

import torch

from ..errors import CheckpointError
from ..state import TAG, join_key, local_chunks, split_key, unflatten
from ..tools.verify import stale_warning
from .capture import no_optimizer_init
from .reader import CheckpointReader, resolve_step_dir

_MISSING = object()
LISTED = 20  # keys named in an error message; the rest are counted


class Restored(dict):  # type: ignore[type-arg]
    """What :func:`ckptd.restore` returns: this rank's ``extra`` (a dict), plus ``step`` (the step
    restored), ``missing_keys`` (target state the checkpoint lacks) and ``unexpected_keys`` (saved
    state no rank's target has); both lists are empty after a ``strict`` restore."""

    def __init__(self, extra: dict[str, Any], step: int, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(extra)
        self.step = step
        self.missing_keys = missing
        self.unexpected_keys = unexpected


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
    """The saved tree node at ``path`` (keys as ``flatten`` names them), or ``_MISSING``."""
    node = tree
    for part in path:
        if isinstance(node, dict) and TAG in node:
            if node[TAG] == "tuple":
                node = node["items"]
            elif node[TAG] in ("dict", "odict"):
                node = {str(unflatten(k, lambda key: key)): v for k, v in node["items"]}
            else:
                return _MISSING
        if isinstance(node, dict):
            if part not in node:
                return _MISSING
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return _MISSING
            node = node[int(part)]
        else:
            return _MISSING
    return node


class _Saved:
    """What the checkpoint holds, seen from one rank: its trees (this rank's first), tensor keys, and
    which parameters had optimizer state and which were in the optimizer at all."""

    def __init__(self, reader: CheckpointReader, rank: int) -> None:
        ranks = sorted(reader.manifest["ranks"], key=lambda r: (r["rank"] != rank, r["rank"]))
        self.trees = [r["tree"] for r in ranks]
        self.tensors = reader.manifest["tensors"]
        self.optim_state: dict[str, Any] = {}  # fqn -> its saved state entries (a tree node)
        self.optim_params: set[str] = set()
        for t in self.trees:
            o = t.get("optim")
            if not isinstance(o, dict):
                continue
            st = o.get("state")
            if isinstance(st, dict) and TAG not in st:
                for fqn, entries in st.items():
                    self.optim_state.setdefault(fqn, entries)
            for g in o.get("param_groups") or []:
                ps = g.get("params") if isinstance(g, dict) else None
                self.optim_params.update(p for p in ps or [] if isinstance(p, str))

    def has(self, part: str) -> bool:
        return any(part in t for t in self.trees)

    def node(self, path: tuple[str, ...]) -> Any:
        for t in self.trees:
            node = _lookup(t, path)
            if node is not _MISSING:
                return node
        return _MISSING


class _Loader:
    """Fills one target root from the checkpoint, collecting what is missing and unexpected."""

    def __init__(self, reader: CheckpointReader, saved: _Saved, cast: torch.dtype | None) -> None:
        self.reader, self.saved, self.cast = reader, saved, cast
        self.missing: list[str] = []
        self.unexpected: list[str] = []

    def build(self, v: Any, path: tuple[str, ...]) -> Any:
        if isinstance(v, torch.Tensor):
            key = join_key(path)
            if key not in self.saved.tensors:
                self.missing.append(key)  # the target keeps its own value
                return v
            for ch in local_chunks(key, v):
                self.reader.read_into(key, ch.tensor, ch.offsets, cast=self.cast)
            return v
        if isinstance(v, dict):
            return {k: self.build(x, path + (str(k),)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            if path[:2] == ("optim", "param_groups") and path[-1] == "params":
                return v  # which parameters a group holds stays the target's
            out = [self.build(x, path + (str(i),)) for i, x in enumerate(v)]
            return tuple(out) if isinstance(v, tuple) else out
        node = self.saved.node(path)
        return v if node is _MISSING else unflatten(node, self.reader.read_full)

    def model(self, msd: dict[str, Any]) -> dict[str, Any]:
        out = self.build(msd, ("model",))
        self.unexpected += [k for k in self.saved.tensors if k.startswith("model/") and split_key(k)[1] not in msd]
        return out

    def optim(self, osd: dict[str, Any]) -> dict[str, Any]:
        saved = self.saved
        state = {}
        for fqn, entries in osd.get("state", {}).items():
            if fqn in saved.optim_state:
                have = saved.optim_state[fqn]
                for name in have if isinstance(have, dict) and TAG not in have else ():
                    if name not in entries:
                        self.unexpected.append(join_key(("optim", "state", fqn, name)))
                state[fqn] = self.build(entries, ("optim", "state", fqn))
            elif fqn not in saved.optim_params:
                self.missing.append(join_key(("optim", "state", fqn)))  # a new parameter: it starts without state
        # a saved parameter without state (it never had a gradient) gets none: dropped from ``state``
        targets = {p for g in osd.get("param_groups", []) for p in g.get("params", [])}
        self.unexpected += [join_key(("optim", "state", f)) for f in saved.optim_state if f not in targets]
        groups = self.build(osd.get("param_groups", []), ("optim", "param_groups"))
        return {**{k: v for k, v in osd.items() if k not in ("state", "param_groups")}, "state": state, "param_groups": groups}


def _agree_unexpected(local: list[str]) -> list[str]:
    """The keys no rank's target has: those every rank found unexpected (collective when distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(local))
    common = set(every[0]).intersection(*every[1:])
    return [k for k in local if k in common]


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - LISTED} more" if len(keys) > LISTED else ""
    return ", ".join(keys[:LISTED]) + more


def load_into(
    reader: CheckpointReader, target_root: dict[str, Any], rank: int, *, strict: bool = True, cast: torch.dtype | None = None
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Fill ``target_root`` (``model`` and optionally ``optim`` state dicts in the caller's layout)
    from the checkpoint, in place; return it with the missing and unexpected keys."""
    saved = _Saved(reader, rank)
    loader = _Loader(reader, saved, cast)
    out: dict[str, Any] = {}
    for part, sd in target_root.items():
        if not saved.has(part):
            if strict:
                raise CheckpointError(f"the checkpoint at {reader.path} holds no {part} state (restore with strict=False to skip it)")
            loader.missing.append(part)
            continue
        out[part] = loader.model(sd) if part == "model" else loader.optim(sd)
    unexpected = _agree_unexpected(loader.unexpected)
    if strict and (loader.missing or unexpected):
        why = []
        if loader.missing:
            why.append(f"missing from the checkpoint: {_listed(loader.missing)}")
        if unexpected:
            why.append(f"in the checkpoint but not in the model or optimizer: {_listed(unexpected)}")
        raise CheckpointError(
            f"the checkpoint at {reader.path} does not match the model: {'; '.join(why)}. "
            "restore(..., strict=False) loads what matches and returns the lists"
        )
    return out, loader.missing, unexpected


def restore_state(
    path: str,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None,
    rank: int,
    *,
    reader: CheckpointReader | None = None,
    strict: bool = True,
    dtype: torch.dtype | None = None,
) -> Restored:
    """Load ``path`` (or what ``reader`` reads) into ``model`` (and ``optim``) in place, in whatever
    layout they have now; ``dtype``: saved floating-point tensors are converted into targets of this
    dtype (never otherwise). Returns this rank's ``extra`` (rank 0's when the checkpoint had fewer
    ranks) as a :class:`Restored`."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    with reader or CheckpointReader(resolve_step_dir(path)) as reader:
        saved = _Saved(reader, rank)
        # torch gives an optimizer without state some (a zero-lr step) so that there is something to
        # load into: wanted only when the checkpoint has optimizer state to load
        init = nullcontext() if saved.optim_state else no_optimizer_init()
        if optim is not None:
            with init:
                msd, osd = get_state_dict(model, optim)
            target_root: dict[str, Any] = {"model": msd, "optim": osd}
        else:
            target_root = {"model": get_model_state_dict(model)}
        loaded, missing, unexpected = load_into(reader, target_root, rank, strict=strict, cast=dtype)
        stale = stale_warning(reader.path, reader.manifest)
        if stale:
            warnings.warn(stale, stacklevel=3)
        saved_rank, tree = reader.tree_for(rank)
        extra_tree = (tree.get("extra") or {}).get(str(saved_rank))
        extra = unflatten(extra_tree, reader.read_full) if extra_tree is not None else {}
    # the match was checked above; torch's own strictness would refuse a parameter left without state
    opts = StateDictOptions(strict=False)
    if optim is not None and "optim" in loaded:
        with no_optimizer_init():
            set_state_dict(model, optim, model_state_dict=loaded.get("model", {}), optim_state_dict=loaded["optim"], options=opts)
    elif "model" in loaded:
        set_model_state_dict(model, loaded["model"], options=opts)
    return Restored(extra, reader.manifest["step"], missing, unexpected)
