"""``restore(..., rename=...)``: a checkpoint saved under other parameter names (a layer renamed, a wrapper added or
taken away) loaded into the model as it is named now.

``rename`` maps a *saved* name to the model's: a dict of prefixes (``{"encoder.layer": "encoder.layers"}``: every
saved name equal to a key, or starting with it followed by ``.``, gets the value in its place; the longest key
wins), or a callable taking a saved name and returning the model's name (or the same name). Names are the fully
qualified names ``model.state_dict()`` uses, and the optimizer's state follows its parameter.

How: the restore renames the *target's* keys to the saved names before it plans the reads (the tensors are the
target's own, so they are filled in place), and the loaded state back before ``set_state_dict``; the planner and
the reader never see another name. Two saved names renamed to the same model name are refused.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError
from .saved import Saved

Rename = Mapping[str, str] | Callable[[str], str]
LISTED = 20  # keys named in a message; the rest are counted


def listed(keys: list[str]) -> str:
    """The first :data:`LISTED` of ``keys``, and how many more."""
    more = f" and {len(keys) - LISTED} more" if len(keys) > LISTED else ""
    return ", ".join(keys[:LISTED]) + more


def saved_names(saved: Saved, rename: Rename | None) -> dict[str, str]:
    """Model name -> saved name, for every saved model name ``rename`` changes (empty without one)."""
    fn = as_function(rename)
    return {} if fn is None else target_to_saved(saved.model_keys(), fn)


def say_unmatched(missing: list[str], unexpected: list[str], rank: int) -> None:
    """A non-strict restore that left target state at its own values says so, on rank 0: a layer renamed since the
    save loads nothing and would otherwise train on from its initial values unnoticed."""
    if rank != 0 or not (missing or unexpected):
        return
    why = [f"{len(missing)} target key(s) not in the checkpoint kept their current values: {listed(missing)}"] if missing else []
    if unexpected:
        why.append(f"{len(unexpected)} saved key(s) matched nothing: {listed(unexpected)}")
    hint = "; if parameters were renamed, restore(..., rename={'old.prefix': 'new.prefix'}) maps them" if missing and unexpected else ""
    warnings.warn(f"restore(strict=False): {'; '.join(why)}{hint}", stacklevel=_outside())


def _outside() -> int:
    """The stack level, for a ``warnings.warn`` in this one's caller, of the first frame outside ckptd."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(2), 2  # (level 1: the caller of warnings.warn; 2: its caller)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def as_function(rename: Rename | None) -> Callable[[str], str] | None:
    """``rename`` as a function of a saved name (None: no renaming). A dict is a prefix map; anything else must be
    callable."""
    if rename is None:
        return None
    if isinstance(rename, Mapping):
        bad = [k for k, v in rename.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"restore(rename=...) maps saved names to model names (str to str), not {bad[0]!r}")
        prefixes = sorted(rename.items(), key=lambda kv: len(kv[0]), reverse=True)

        def by_prefix(name: str) -> str:
            for old, new in prefixes:
                if name == old or name.startswith(old + "."):
                    return new + name[len(old) :]
            return name

        return by_prefix
    if not callable(rename):
        raise TypeError(f"restore(rename=...) takes a dict of name prefixes or a callable, not {type(rename).__name__}")
    return rename


def target_to_saved(saved_names: set[str], fn: Callable[[str], str]) -> dict[str, str]:
    """Model name -> saved name, for every saved name ``fn`` renames; refuses two saved names made one."""
    out: dict[str, str] = {}
    for saved in sorted(saved_names):
        new = fn(saved)
        if not isinstance(new, str):
            raise TypeError(f"restore(rename=...) returned {new!r} for {saved!r}: a name (str) is needed")
        if new == saved:
            continue
        if new in out:
            raise CheckpointError(f"restore(rename=...) gives {out[new]!r} and {saved!r} the same name {new!r}")
        out[new] = saved
    return out


def rename_root(root: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """``root`` (``{"model": msd, "optim": osd}`` as ``get_state_dict`` gives them) with its parameter names mapped
    by ``mapping`` (names it does not hold are kept); the values are the same objects."""
    if not mapping:
        return root  # (every restore without rename: nothing copied)
    out = dict(root)
    if "model" in root:
        out["model"] = {mapping.get(k, k): v for k, v in root["model"].items()}
    if "optim" in root:
        osd = dict(root["optim"])
        if isinstance(osd.get("state"), dict):
            osd["state"] = {mapping.get(k, k) if isinstance(k, str) else k: v for k, v in osd["state"].items()}
        if isinstance(osd.get("param_groups"), list):
            osd["param_groups"] = [_group(g, mapping) for g in osd["param_groups"]]
        out["optim"] = osd
    return out


def _group(group: Any, mapping: dict[str, str]) -> Any:
    if not isinstance(group, dict) or not isinstance(group.get("params"), list):
        return group
    return {**group, "params": [mapping.get(p, p) if isinstance(p, str) else p for p in group["params"]]}


def rename_keys(keys: list[str], mapping: dict[str, str]) -> list[str]:
    """Restore keys (``model/<name>``, ``model/<name>._extra_state``, ``optim/state/<name>...``) with the parameter
    names in them mapped by ``mapping``."""
    out = []
    for key in keys:
        for head in ("model/", "optim/state/"):
            if key.startswith(head):
                rest = key[len(head) :]
                name = max((n for n in mapping if rest == n or rest.startswith(n + "/") or rest.startswith(n + ".")), key=len, default=None)
                if name is not None:
                    key = head + mapping[name] + rest[len(name) :]
                break
        out.append(key)
    return out
