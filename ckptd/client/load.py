"""Load a committed checkpoint into whatever layout the caller's model and optimizer have, and say
what did not match.

The target drives: torch's ``get_state_dict`` gives the caller's state in its current layout
(sharded or not); every tensor chunk this process holds is read from the intersecting saved chunks
(:class:`.reader.CheckpointReader`, so any world size, wrapper or sub-group sharding works); every
non-tensor value (and every container without a target tensor in it) is the saved one, as saved;
torch's ``set_state_dict`` loads the result.

Keys are ckptd state keys: ``model/<fqn>`` and ``optim/state/<fqn>`` (or ``.../<name>`` for one
entry). ``strict`` (the default), like ``load_state_dict``: a target tensor the checkpoint lacks
(*missing*) or a saved model tensor or optimizer entry that no rank's target has (*unexpected*) is a
:class:`CheckpointError` listing them. ``strict=False`` loads the intersection: a missing tensor
keeps the target's value (a new head), a parameter without saved optimizer state ends without state
(as a fresh optimizer has), and :class:`Restored` lists both. A strict restore with torch.distributed
initialized and more than one rank is collective: one ``all_gather_object`` agrees which saved keys no
rank holds (every MoE rank holds only its own experts), unites the missing ones, and makes one rank's
failure every rank's; a second one, after the tensors were read, does so for read errors (a corrupt
file); a failure before the first (:func:`restore_state`) is shared there too. ``strict=False`` makes no
collective and lists what this rank saw. Nothing is read into the caller's model or optimizer before
the restore is judged, and no ``optimizer.step()`` runs: one refused leaves them as they were. A saved
tensor whose global shape differs from the target's is always an error; a model on the meta device too.

An optimizer without state is given buffers to load into (:meth:`_Loader._fresh_entries`) only when the
checkpoint holds state for it: a checkpoint taken before the first step restores an optimizer without
state, as ``optim.state_dict()`` had it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import CheckpointError, FormatError
from ..format import dtype_from_name
from ..state import TAG, join_key, key_names, keys_tagged, local_chunks, split_key, unflatten
from ..storage.local import resolve_step_dir
from ..storage.verify import stale_check
from ..validate import gc_paused
from .agree import agree, collective, fail_early, failed, gather, raise_failure
from .capture import local_tensor, no_optimizer_init, refuse_meta, refuse_unnamed
from .reader import CheckpointReader, Piece
from .rename import Rename, listed, rename_keys, rename_root, saved_names, say_unmatched
from .saved import MISSING, Saved, children, holds_tensor

log = logging.getLogger("ckptd.client")
_EXTRA_STATE = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX  # "_extra_state"


class Restored(dict):  # type: ignore[type-arg]
    """What :func:`ckptd.restore` returns: this rank's ``extra`` (a dict), plus ``step`` (the step
    restored), ``source`` (where it was read from: ``"memory"``, ``"disk"`` or ``"bucket"``), ``missing_keys``
    (target state the checkpoint lacks) and ``unexpected_keys`` (saved state no rank's target has); both lists
    are empty after a ``strict`` restore."""

    source = "disk"  # a restore from the daemon says otherwise (restore_from_daemon)

    def __init__(self, extra: dict[str, Any], step: int, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(extra)
        self.step = step
        self.missing_keys = missing
        self.unexpected_keys = unexpected


def _items(v: Any) -> dict[str, Any]:
    """A target container's items by the path part ``flatten`` names them with."""
    if isinstance(v, dict):
        return dict(zip(key_names(v), v.values()))
    return {str(i): x for i, x in enumerate(v)} if isinstance(v, (list, tuple)) else {}


def _sharded(value: Any) -> bool:
    """A DTensor or ShardedTensor (as :func:`..state.local_chunks` tells them)."""
    return (hasattr(value, "local_shards") and hasattr(value, "metadata")) or hasattr(value, "__create_chunk_list__")


class _Loader:
    """Fills one target root from the checkpoint, collecting what is missing and unexpected.

    The target's keys rule at the keyed levels (model FQNs, a parameter's optimizer entries: :meth:`keyed`);
    below them a value is the saved one, as saved (a module's extra state, L-BFGS's history lists), its
    tensors read into the target's own where the target has one at the same place (:meth:`_merge`)."""

    def __init__(self, reader: CheckpointReader, saved: Saved, cast: torch.dtype | None, flat: int | None = None) -> None:
        self.reader, self.saved, self.cast, self.flat = reader, saved, cast, flat  # flat: an L-BFGS target's parameters' size
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.pieces: list[Piece] = []  # what the tensors take, read in one pass once every region is checked

    def _tensor(self, v: torch.Tensor, path: tuple[str, ...], key: str | None = None) -> torch.Tensor:
        """The target's tensor ``v``, to be filled from the saved one at ``path`` (``key``: the saved tree's
        reference to it; missing: kept as it is)."""
        key = key or join_key(path)
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

    def _fits(self, saved: torch.dtype, target: torch.dtype) -> bool:
        """Whether a saved tensor of dtype ``saved`` is read into a target's of dtype ``target`` (``dtype=`` converts)."""
        return saved == target or (self.cast == target and saved.is_floating_point and target.is_floating_point)

    def _fresh(self, key: str) -> torch.Tensor:
        """A new CPU tensor for saved tensor ``key``, read with the others (``load_state_dict`` moves it)."""
        ent = self.saved.tensors.get(key)
        if ent is None:
            raise FormatError(f"the checkpoint at {self.reader.path} names tensor {key!r} in its saved state, but its manifest has none")
        out = torch.empty(ent["shape"], dtype=dtype_from_name(ent["dtype"]))
        self.pieces += self.reader.pieces(key, out, (0,) * len(ent["shape"]))
        return out

    def _as_saved(self, node: Any) -> Any:
        """The value a saved tree node describes, as saved; its tensors new (``bytes`` read now: they are copied out)."""
        now = keys_tagged(node, "bytes")
        return unflatten(node, lambda key: self.reader.read_full(key) if key in now else self._fresh(key))

    def keyed(self, target: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        """A keyed level: the target's keys, each with its value (:meth:`value`)."""
        return {k: self.value(x, path + (str(k),)) for k, x in target.items()}

    def value(self, v: Any, path: tuple[str, ...]) -> Any:
        """What the target's ``v`` at ``path`` becomes: the saved value (:meth:`_merge`), or ``v`` where nothing
        is saved there (its tensors then missing, unless saved under their own keys)."""
        if isinstance(v, torch.Tensor):
            return self._tensor(v, path)
        node = self.saved.node(path)
        if node is not MISSING:
            return self._merge(v, node, path)
        if isinstance(v, dict):
            return {k: self.value(x, path + (str(k),)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            out = [self.value(x, path + (str(i),)) for i, x in enumerate(v)]
            return tuple(out) if isinstance(v, tuple) else out
        return v

    def _merge(self, v: Any, node: Any, path: tuple[str, ...]) -> Any:
        """Saved ``node`` as saved, in its own structure (items the target lacks are kept, items only the
        target has go, as ``load_state_dict`` would have it); a saved tensor where ``v`` has a tensor of its
        shape and dtype at the same place is read into ``v``'s (else into a new one, as saved)."""
        if isinstance(v, torch.Tensor) and isinstance(node, dict) and node.get(TAG) == "tensor":
            ent = self.saved.tensors.get(node.get("key"))
            if ent is not None and ent["shape"] == list(v.shape) and self._fits(dtype_from_name(ent["dtype"]), v.dtype):
                return self._tensor(v, path, node["key"])
        items = children(node) if holds_tensor(v) else None
        if items is None:  # no tensor of the target's to fill here: the saved value whole
            return self._as_saved(node)
        mine = _items(v)
        got = [(k, self._merge(mine[p], x, path + (p,)) if p in mine else self._as_saved(x)) for p, k, x in items]
        if isinstance(node, list):
            return [x for _, x in got]
        if TAG not in node:
            return dict(got)
        if node[TAG] == "tuple":
            return tuple(x for _, x in got)
        made = {f"\0{i}": x for i, (_, x) in enumerate(got)}  # a tagged dict: its keys decoded as saved, its values these
        shell = {TAG: node[TAG], "items": [[k, {TAG: "tensor", "key": f"\0{i}"}] for i, (k, _) in enumerate(got)]}
        return unflatten(shell, lambda key: made[key] if key in made else self._fresh(key))

    def model(self, msd: dict[str, Any]) -> dict[str, Any]:
        out = {k: self._extra_state(x, ("model", k)) if _is_extra_state(k) else self.value(x, ("model", k)) for k, x in msd.items()}
        tensors = [(k, split_key(k)[1]) for k in self.saved.tensors if k.startswith("model/")]
        self.unexpected += [k for k, fqn in tensors if fqn not in msd]
        held = {fqn for _, fqn in tensors}  # a saved value without tensors (a module's extra state) is unexpected whole
        self.unexpected += [join_key(("model", k)) for k in self.saved.model_keys() if k not in msd and k not in held]
        return out

    def _extra_state(self, v: Any, path: tuple[str, ...]) -> Any:
        """A module's extra state (``get_extra_state``): the saved value as saved, whatever its size (TransformerEngine's
        FP8 metadata, a uint8 tensor of pickled state, empty on a fresh module), read into the target's tensor only
        where that has its shape and dtype (:meth:`_merge`); missing when nothing is saved there, tensor or not, as
        ``load_state_dict`` has it."""
        node = self.saved.node(path)
        if node is MISSING:
            self.missing.append(join_key(path))
            return v
        return self._merge(v, node, path)

    def optim(self, osd: dict[str, Any], msd: dict[str, Any]) -> dict[str, Any]:
        saved = self.saved
        params = [p for g in osd.get("param_groups", []) for p in g.get("params", [])]
        targets = set(params)
        state = {}
        for fqn in dict.fromkeys([*osd.get("state", {}), *params]):  # the target's order
            entries = osd.get("state", {}).get(fqn)
            if fqn in saved.optim_state and self.flat is not None and self._misfit(fqn):
                continue
            if fqn in saved.optim_state:
                if entries is None:  # no state in the target yet (never stepped: ckptd never has torch step it)
                    entries = self._fresh_entries(fqn, msd.get(fqn))
                left = [join_key(("optim", "state", fqn, n)) for n in saved.entries(fqn) if n not in entries]
                self.unexpected += [k for k in left if k not in self.missing]  # a saved entry without a target is missing
                state[fqn] = self.keyed(entries, ("optim", "state", fqn))
            elif fqn not in saved.optim_params and (entries is not None or saved.optim_state):
                self.missing.append(join_key(("optim", "state", fqn)))  # a new parameter: it starts without state
        # a saved parameter without state (it never had a gradient) gets none: left out of ``state``
        for f in saved.optim_state:
            if f not in targets:  # entry by entry: on another rank (MoE) the parameter may be there with other entries
                self.unexpected += [join_key(("optim", "state", f, n)) for n in saved.entries(f)] or [join_key(("optim", "state", f))]
        groups = [self._group(i, g) for i, g in enumerate(osd.get("param_groups", []))]
        return {**{k: v for k, v in osd.items() if k not in ("state", "param_groups")}, "state": state, "param_groups": groups}

    def _misfit(self, fqn: str) -> bool:
        """L-BFGS history saved for another model's parameters: unexpected, left out (the optimizer starts without it)."""
        size = self.saved.flat_size(fqn, self.flat or 0)
        if size is not None:
            self.unexpected += [join_key(("optim", "state", fqn, n)) for n in self.saved.entries(fqn)]
            warnings.warn(
                f"the L-BFGS history saved under {fqn} spans {size} elements, the optimizer's parameters {self.flat}: left out",
                stacklevel=2,
            )
        return size is not None

    def _fresh_entries(self, fqn: str, param: Any) -> dict[str, Any]:
        """Target buffers for the saved state of a parameter that has none yet: zeros of the saved dtype,
        shaped (and sharded) like the parameter where the saved entry is, else of the saved shape on the
        parameter's device (factored state: Adafactor's ``row_var``); ``None`` for the other entries, which
        :meth:`value` takes from the saved tree as saved (scalars, L-BFGS's history lists)."""
        out: dict[str, Any] = {}
        for name, node in self.saved.entries(fqn).items():
            ent = self.saved.tensors.get(node.get("key")) if isinstance(node, dict) and node.get(TAG) == "tensor" else None
            if ent is None:
                out[name] = None
                continue
            dtype, shape = dtype_from_name(ent["dtype"]), ent["shape"]
            if self.cast is not None and dtype.is_floating_point and shape:  # not a step counter: it counts in its own dtype
                dtype = self.cast  # the buffer the restore converts into (torch would copy one of another dtype again)
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
                    "which has no optimizer state yet to take its layout from (ckptd never steps an optimizer to make some): "
                    "take one optimizer step before restoring (the restore overwrites what it made)"
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
        out = {k: self._as_saved(v) for k, v in node.items() if k not in own}
        return {**target, **out, **{k: target[k] for k in own if k in target}}


def _is_extra_state(fqn: str) -> bool:
    """Whether model key ``fqn`` is a module's extra state (torch's ``get_state_dict`` takes every key so named for one)."""
    return fqn.rpartition(".")[2] == _EXTRA_STATE


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
        why.append(f"missing from the checkpoint: {listed(missing)}")
    if unexpected:
        why.append(f"in the checkpoint but not in the model or optimizer: {listed(unexpected)}")
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
    flat: int | None = None,
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Fill ``target_root`` (``model`` and optionally ``optim`` state dicts in the caller's layout)
    from the checkpoint, in place; return it with the missing and unexpected keys. ``also``: more reading
    (the rank's ``extra``), done with the tensors' so that its errors are agreed on like theirs.

    Nothing is read into the target (its tensors are the live parameters and optimizer state) until the
    whole restore is planned and judged: a strict restore that does not match raises with the target
    untouched. Any rank's failure is every rank's (strict, distributed): no rank goes on alone into a
    collective ``set_state_dict``; a read that failed on some rank (a corrupt or truncated file) is agreed
    on once more, and the target may then be partly overwritten."""
    loader: _Loader | None = None
    out: dict[str, Any] = {}
    error: BaseException | None = None
    with gc_paused():  # until read: the pieces stay alive
        try:
            loader = _Loader(reader, Saved(reader.manifest, reader.path, rank), cast, flat)
            out = _plan(loader, target_root, strict)
        except Exception as e:  # any error (an EIO, an out-of-memory): the other ranks hear of it rather than wait
            error = e
        hot = reader.hot
        missing, unexpected, failures = agree(loader.missing if loader else [], loader.unexpected if loader else [], error, strict, hot)
        raise_failure(error, failures, "nothing was loaded on this rank", hot=hot)
        assert loader is not None  # else this rank's error was raised
        unexpected = loader.saved.collapse(unexpected)
        if strict:
            _refuse_mismatch(reader.path, missing, unexpected)
        try:
            reader.read_many(loader.pieces)
            if also is not None:
                also()
        except Exception as e:  # any error (an EIO from the disk too): the other ranks hear of it rather than wait
            error = e
    if collective(strict):
        failures = failed(gather(error, hot=hot))
    raise_failure(error, failures, "this rank's model and optimizer may be partly overwritten: restore again", mine_too=True, hot=hot)
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


def _target_root(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The target's state dicts in its current layout, as ``get_state_dict`` gives them, an optimizer
    without state left without (torch would run a zero-lr ``optimizer.step()`` to give it some:
    ``_fresh_entries`` builds its buffers instead, so a refused restore leaves it as it was)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optim is None:
        return {"model": get_model_state_dict(model)}
    with no_optimizer_init():
        msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _stale(pending: Callable[[], str | None]) -> None:
    try:
        stale = pending()
    except Exception as e:  # a warning only: never a failure of this rank's alone after the others went on
        log.debug("stale-data check: %s", e)
        return
    if stale:
        warnings.warn(stale, stacklevel=4)


def restore_state(
    path: str,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None,
    rank: int,
    *,
    opener: Callable[[], CheckpointReader] | None = None,
    strict: bool = True,
    dtype: torch.dtype | None = None,
    rename: Rename | None = None,
) -> Restored:
    """Load ``path`` (or what the reader ``opener`` opens reads) into ``model`` (and ``optim``) in place, in
    whatever layout they have now; ``dtype``: saved floating-point tensors are converted into targets of
    this dtype (never otherwise); ``rename``: saved parameter names to the model's (:mod:`.rename`). Returns this
    rank's ``extra`` (rank 0's when the checkpoint had fewer ranks) as a :class:`Restored`. Whatever fails before
    the ranks check in (a model on the meta device, no checkpoint at ``path``, a malformed manifest) fails every
    rank of a collective restore there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    reader: CheckpointReader | None = None
    try:
        refuse_unnamed(model, optim, "restore into")
        refuse_meta(model, optim)
        target_root = _target_root(model, optim)
        reader = opener() if opener is not None else CheckpointReader(resolve_step_dir(path))
        pending = stale_check(reader.path, reader.manifest)  # reads the step before's manifest beside the copies
        named = saved_names(Saved(reader.manifest, reader.path, rank), rename)  # model name -> saved name, where renamed
        target_root = rename_root(target_root, named)
    except Exception as e:  # every rank hears of it at the check-in it would have made
        if reader is not None:
            reader.close()
        fail_early(e, strict, hot=opener is not None)
    with reader:
        got: dict[str, Any] = {}

        def read_extra() -> None:  # its tensors too: a corrupt one is every rank's failure (all fall back to disk)
            saved_rank, tree = reader.tree_for(rank)
            extra_tree = (tree.get("extra") or {}).get(str(saved_rank))
            got["extra"] = unflatten(extra_tree, reader.read_full) if extra_tree is not None else {}

        flat = sum(local_tensor(p).numel() for p in optim.param_groups[0]["params"]) if isinstance(optim, torch.optim.LBFGS) else None
        loaded, missing, unexpected = load_into(reader, target_root, rank, strict=strict, cast=dtype, also=read_extra, flat=flat)
        _stale(pending)
        extra = got["extra"]
    back = {v: k for k, v in named.items()}
    loaded, missing = rename_root(loaded, back), rename_keys(missing, back)
    say_unmatched(missing, unexpected, rank)
    # the match was checked above; torch's own strictness would refuse a parameter left without state
    opts = StateDictOptions(strict=False)
    if optim is not None and "optim" in loaded:
        with no_optimizer_init(), _thawed(optim):
            set_state_dict(model, optim, model_state_dict=loaded.get("model", {}), optim_state_dict=loaded["optim"], options=opts)
    elif "model" in loaded:
        set_model_state_dict(model, loaded["model"], options=opts)
    return Restored(extra, reader.manifest["step"], missing, unexpected)
