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
(as a fresh optimizer has), and :class:`Restored` lists both. A strict restore with torch.distributed
initialized and more than one rank is collective: one ``all_gather_object`` agrees which saved keys no
rank holds (every MoE rank holds only its own experts), unites the missing ones, and makes one rank's
failure every rank's; a second one, after the tensors were read, does so for read errors (a corrupt
file). ``strict=False`` makes no collective and lists what this rank saw. Nothing is read into the
caller's model or optimizer before the restore is judged: one refused leaves them as they were.
A saved tensor whose global shape differs from the target's is always an error.

An optimizer is given state to load into only when the checkpoint holds some: a checkpoint taken
before the first step restores an optimizer without state, as ``optim.state_dict()`` had it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ..errors import CheckpointError, FormatError
from ..format import dtype_from_name
from ..state import TAG, join_key, local_chunks, split_key, unflatten
from ..tools.verify import stale_check
from ..validate import gc_paused
from .capture import no_optimizer_init
from .plan import Arrivals
from .reader import CheckpointReader, Piece, resolve_step_dir

_MISSING = object()
_ARRIVALS = Arrivals("restore")  # one count per process: every rank restores as often as the others
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


def _sharded(value: Any) -> bool:
    """A DTensor or ShardedTensor (as :func:`..state.local_chunks` tells them)."""
    return (hasattr(value, "local_shards") and hasattr(value, "metadata")) or hasattr(value, "__create_chunk_list__")


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
        self.groups: list[dict[str, Any]] = []  # the saved param groups (tree nodes), from the first tree with some
        for t in self.trees:
            o = t.get("optim")
            if not isinstance(o, dict):
                continue
            st = o.get("state")
            if isinstance(st, dict) and TAG not in st:
                for fqn, entries in st.items():
                    self.optim_state.setdefault(fqn, entries)
            groups = [g for g in o.get("param_groups") or [] if isinstance(g, dict) and TAG not in g]
            self.groups = self.groups or groups
            for g in groups:
                self.optim_params.update(p for p in g.get("params") or [] if isinstance(p, str))

    def has(self, part: str) -> bool:
        return any(part in t for t in self.trees)

    def node(self, path: tuple[str, ...]) -> Any:
        for t in self.trees:
            node = _lookup(t, path)
            if node is not _MISSING:
                return node
        return _MISSING

    def entries(self, fqn: str) -> dict[str, Any]:
        have = self.optim_state.get(fqn)
        return have if isinstance(have, dict) and TAG not in have else {}


class _Loader:
    """Fills one target root from the checkpoint, collecting what is missing and unexpected."""

    def __init__(self, reader: CheckpointReader, saved: _Saved, cast: torch.dtype | None) -> None:
        self.reader, self.saved, self.cast = reader, saved, cast
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.pieces: list[Piece] = []  # what the tensors take, read in one pass once every region is checked

    def build(self, v: Any, path: tuple[str, ...]) -> Any:
        if isinstance(v, torch.Tensor):
            key = join_key(path)
            ent = self.saved.tensors.get(key)
            if ent is None:
                self.missing.append(key)  # the target keeps its own value
                return v
            for ch in local_chunks(key, v):
                if list(ch.global_shape) != ent["shape"]:
                    want = list(ch.global_shape)
                    raise CheckpointError(f"size mismatch for {key}: the checkpoint holds {ent['shape']}, the target {want}")
                self.pieces += self.reader.pieces(key, ch.tensor, ch.offsets, cast=self.cast)
            return v
        if isinstance(v, dict):
            return {k: self.build(x, path + (str(k),)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            out = [self.build(x, path + (str(i),)) for i, x in enumerate(v)]
            return tuple(out) if isinstance(v, tuple) else out
        node = self.saved.node(path)
        return v if node is _MISSING else unflatten(node, self.reader.read_full)

    def model(self, msd: dict[str, Any]) -> dict[str, Any]:
        out = self.build(msd, ("model",))
        self.unexpected += [k for k in self.saved.tensors if k.startswith("model/") and split_key(k)[1] not in msd]
        return out

    def optim(self, osd: dict[str, Any], msd: dict[str, Any]) -> dict[str, Any]:
        saved = self.saved
        params = [p for g in osd.get("param_groups", []) for p in g.get("params", [])]
        targets = set(params)
        state = {}
        for fqn in dict.fromkeys([*osd.get("state", {}), *params]):  # the target's order
            entries = osd.get("state", {}).get(fqn)
            if fqn in saved.optim_state:
                if entries is None:  # no state in the target yet (never stepped, or torch did not make it)
                    entries = self._fresh_entries(fqn, msd.get(fqn))
                left = [join_key(("optim", "state", fqn, n)) for n in saved.entries(fqn) if n not in entries]
                self.unexpected += [k for k in left if k not in self.missing]  # a saved entry without a target is missing
                state[fqn] = self.build(entries, ("optim", "state", fqn))
            elif fqn not in saved.optim_params and entries is not None:
                self.missing.append(join_key(("optim", "state", fqn)))  # a new parameter: it starts without state
        # a saved parameter without state (it never had a gradient) gets none: left out of ``state``
        for f in saved.optim_state:
            if f not in targets:  # entry by entry: on another rank (MoE) the parameter may be there with other entries
                self.unexpected += [join_key(("optim", "state", f, n)) for n in saved.entries(f)] or [join_key(("optim", "state", f))]
        groups = [self._group(i, g) for i, g in enumerate(osd.get("param_groups", []))]
        return {**{k: v for k, v in osd.items() if k not in ("state", "param_groups")}, "state": state, "param_groups": groups}

    def _fresh_entries(self, fqn: str, param: Any) -> dict[str, Any]:
        """Target buffers for the saved state of a parameter that has none yet: zeros of the saved dtype,
        shaped (and sharded) like the parameter where the saved entry is, else of the saved shape on the
        parameter's device (factored state: Adafactor's ``row_var``); scalars as saved."""
        out: dict[str, Any] = {}
        for name, node in self.saved.entries(fqn).items():
            ent = self.saved.tensors.get(node.get("key")) if isinstance(node, dict) and node.get(TAG) == "tensor" else None
            if ent is None:
                out[name] = unflatten(node, self.reader.read_full)
                continue
            dtype, shape = dtype_from_name(ent["dtype"]), ent["shape"]
            key = join_key(("optim", "state", fqn, name))
            if not shape:
                out[name] = torch.zeros((), dtype=dtype)
            elif isinstance(param, torch.Tensor) and list(param.shape) == shape:
                try:
                    out[name] = torch.zeros_like(param, dtype=dtype)
                except (TypeError, RuntimeError, NotImplementedError):
                    self.missing.append(key)  # no buffer like this parameter can be made
            elif _sharded(param):
                raise CheckpointError(
                    f"cannot restore {key} (saved shape {shape}) into sharded parameter {fqn} of shape {list(param.shape)}, "
                    "which has no optimizer state yet to take its layout from: restore before the first backward or "
                    "optimizer step, or into an optimizer that has state"
                )
            else:
                out[name] = torch.zeros(shape, dtype=dtype, device=param.device if isinstance(param, torch.Tensor) else None)
        return out

    def _group(self, i: int, target: dict[str, Any]) -> dict[str, Any]:
        """Target group ``i`` with the hyperparameters of the saved group that holds its parameters
        (by index when none does), as ``load_state_dict`` gives them: keys only the saved group has too
        (``initial_lr``, which an LR scheduler added), keys only the target has kept. Which parameters
        it holds (``params``, ``param_names``) stays the target's."""
        mine = set(target.get("params", []))
        groups = self.saved.groups
        best = max(range(len(groups)), key=lambda j: len(mine & set(groups[j].get("params") or [])), default=None)
        if best is None or not mine & set(groups[best].get("params") or []):
            best = i if i < len(groups) else None
        if best is None:
            return target
        own = ("params", "param_names")
        node = groups[best]
        out = {k: unflatten(v, self.reader.read_full) for k, v in node.items() if k not in own}
        return {**target, **out, **{k: target[k] for k in own if k in target}}


Failure = tuple[int, str, bool]  # a failed rank, its error, and whether that was a FormatError (a bad file)


def _collective(strict: bool) -> bool:
    """Whether a restore agrees with the other ranks: strict, with torch.distributed running more than one."""
    import torch.distributed as dist

    return strict and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather(error: BaseException | None, *more: Any) -> list[Any]:
    """Every rank's ``(error, *more)``, the error as ``(text, is a FormatError)`` or ``None``."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (None if error is None else (str(error), isinstance(error, FormatError)), *more))
    return every


def _failed(every: list[Any]) -> list[Failure]:
    return [(r, *mine[0]) for r, mine in enumerate(every) if mine[0] is not None]


def _agree(
    missing: list[str], unexpected: list[str], error: BaseException | None, strict: bool
) -> tuple[list[str], list[str], list[Failure]]:
    """Every rank's view, when the restore is :func:`_collective`: the union of missing keys, the saved
    keys no rank's target has (those every rank found unexpected), and the ranks that failed. One
    ``all_gather_object``, after every rank checked in (a restore on some ranks only is an error, not a
    hang); the only check-in of the restore."""
    if not _collective(strict):
        return missing, unexpected, []
    _ARRIVALS.check("ckptd.restore()")
    every = _gather(error, sorted(missing), sorted(unexpected))
    all_missing = sorted({k for _, m, _ in every for k in m})
    common = set(every[0][2]).intersection(*(u for _, _, u in every[1:]))
    return all_missing, [k for k in unexpected if k in common], _failed(every)


def _raise_failure(error: BaseException | None, failed: list[Failure], then: str, *, mine_too: bool = False) -> None:
    """Raise this rank's error, or (it had none) one naming the ranks that failed and saying ``then``
    (``mine_too``: this rank's own error says it as well, its type kept). A FormatError only where every
    failure was one, on every rank alike: a hot restore then reads the step from disk on every rank
    together, or on none."""
    if error is None and not failed:
        return
    bad_file = all(f for _, _, f in failed)
    if error is not None and (bad_file or not isinstance(error, FormatError)):
        if not mine_too:
            raise error
        said = type(error) if isinstance(error, CheckpointError) else CheckpointError
        raise said(f"{error}; {then}") from error
    first = failed[0][1] if len(failed[0][1]) <= 300 else failed[0][1][:300] + "..."
    exc = (FormatError if bad_file else CheckpointError)(f"restore failed on rank(s) {[r for r, _, _ in failed][:8]} ({first}); {then}")
    raise exc from error


def _collapse(keys: list[str], saved: _Saved) -> list[str]:
    """``optim/state/<fqn>`` for a parameter all of whose saved entries are listed, else the entries."""
    out, listed = [], set(keys)
    for k in keys:
        parts = split_key(k)
        if parts[:2] == ["optim", "state"] and len(parts) == 4:
            whole = join_key(("optim", "state", parts[2]))
            if all(join_key(("optim", "state", parts[2], n)) in listed for n in saved.entries(parts[2])):
                if whole not in out:
                    out.append(whole)
                continue
        out.append(k)
    return out


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - LISTED} more" if len(keys) > LISTED else ""
    return ", ".join(keys[:LISTED]) + more


def _plan(loader: _Loader, target_root: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The state ``set_state_dict`` takes, its tensors the target's own, not yet read (``loader.pieces``)."""
    out: dict[str, Any] = {}
    for part, sd in target_root.items():
        if not loader.saved.has(part):
            if strict:
                path = loader.reader.path
                raise CheckpointError(f"the checkpoint at {path} holds no {part} state (restore with strict=False to skip it)")
            loader.missing.append(part)
            continue
        out[part] = loader.model(sd) if part == "model" else loader.optim(sd, target_root.get("model", {}))
    return out


def _refuse_mismatch(path: str, missing: list[str], unexpected: list[str]) -> None:
    if not (missing or unexpected):
        return
    why = []
    if missing:
        why.append(f"missing from the checkpoint: {_listed(missing)}")
    if unexpected:
        why.append(f"in the checkpoint but not in the model or optimizer: {_listed(unexpected)}")
    raise CheckpointError(
        f"the checkpoint at {path} does not match the model: {'; '.join(why)}. "
        "restore(..., strict=False) loads what matches and returns the lists"
    )


def load_into(
    reader: CheckpointReader,
    target_root: dict[str, Any],
    rank: int,
    *,
    strict: bool = True,
    cast: torch.dtype | None = None,
    also: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Fill ``target_root`` (``model`` and optionally ``optim`` state dicts in the caller's layout)
    from the checkpoint, in place; return it with the missing and unexpected keys. ``also``: more reading
    (the rank's ``extra``), done with the tensors' so that its errors are agreed on like theirs.

    Nothing is read into the target (its tensors are the live parameters and optimizer state) until the
    whole restore is planned and judged: a strict restore that does not match raises with the target
    untouched. Any rank's failure is every rank's (strict, distributed): no rank goes on alone into a
    collective ``set_state_dict``; a read that failed on some rank (a corrupt or truncated file) is agreed
    on once more, and the target may then be partly overwritten."""
    saved = _Saved(reader, rank)
    loader = _Loader(reader, saved, cast)
    out: dict[str, Any] = {}
    error: BaseException | None = None
    with gc_paused():  # until read: the pieces stay alive
        try:
            out = _plan(loader, target_root, strict)
        except Exception as e:  # any error (an EIO, an out-of-memory): the other ranks hear of it rather than wait
            error = e
        missing, unexpected, failed = _agree(loader.missing, loader.unexpected, error, strict)
        _raise_failure(error, failed, "nothing was loaded on this rank")
        unexpected = _collapse(unexpected, saved)
        if strict:
            _refuse_mismatch(reader.path, missing, unexpected)
        try:
            reader.read_many(loader.pieces)
            if also is not None:
                also()
        except Exception as e:  # any error (an EIO from the disk too): the other ranks hear of it rather than wait
            error = e
    if _collective(strict):
        failed = _failed(_gather(error))
    _raise_failure(error, failed, "this rank's model and optimizer may be partly overwritten: restore again", mine_too=True)
    return out, missing, unexpected


@contextmanager
def _thawed(optim: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer's frozen parameters (``requires_grad=False``, kept in it for staged unfreezing)
    require gradients inside this block: torch's ``set_state_dict`` loads optimizer state only for
    parameters that do, and would drop theirs without a word. Each flag is put back on the way out."""
    frozen = [p for g in optim.param_groups for p in g["params"] if not p.requires_grad and (p.is_floating_point() or p.is_complex())]
    try:
        for p in frozen:
            p.requires_grad_(True)
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


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
        got: dict[str, Any] = {}

        def read_extra() -> None:  # its tensors too: a corrupt one is every rank's failure (all fall back to disk)
            saved_rank, tree = reader.tree_for(rank)
            extra_tree = (tree.get("extra") or {}).get(str(saved_rank))
            got["extra"] = unflatten(extra_tree, reader.read_full) if extra_tree is not None else {}

        pending = stale_check(reader.path, reader.manifest)  # reads the step before's manifest beside the copies
        loaded, missing, unexpected = load_into(reader, target_root, rank, strict=strict, cast=dtype, also=read_extra)
        stale = pending()
        if stale:
            warnings.warn(stale, stacklevel=3)
        extra = got["extra"]
    # the match was checked above; torch's own strictness would refuse a parameter left without state
    opts = StateDictOptions(strict=False)
    if optim is not None and "optim" in loaded:
        with no_optimizer_init(), _thawed(optim):
            set_state_dict(model, optim, model_state_dict=loaded.get("model", {}), optim_state_dict=loaded["optim"], options=opts)
    elif "model" in loaded:
        set_model_state_dict(model, loaded["model"], options=opts)
    return Restored(extra, reader.manifest["step"], missing, unexpected)
