"""What a checkpoint holds, as one rank's restore sees it: the saved trees (this rank's first), the
optimizer state and parameter groups they name, and the way down a tree to one value.

:mod:`.load` reads through :class:`Saved` on the trainer's thread. The trees were validated with the
manifest (:mod:`ckptd.validate`: depth, tags); what a restore relies on beyond that (the optimizer's
``param_groups`` listing parameter names) is checked here, a :class:`FormatError` naming the rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import FormatError
from ..state import TAG, join_key, key_names, keys_tagged, split_key, unflatten

MISSING = object()  # no value at that path in any saved tree
LBFGS_FLAT = ("d", "prev_flat_grad", "old_dirs", "old_stps")  # L-BFGS's vectors: all of its parameters, flattened


def lookup(tree: Any, path: tuple[str, ...]) -> Any:
    """The saved tree node at ``path`` (keys as ``flatten`` names them), or :data:`MISSING`."""
    node = tree
    for part in path:
        if isinstance(node, dict) and TAG in node:
            if node[TAG] == "tuple":
                node = node["items"]
            elif node[TAG] in ("dict", "odict"):
                node = dict(zip(key_names(unflatten(k, lambda key: key) for k, _ in node["items"]), (v for _, v in node["items"])))
            else:
                return MISSING
        if isinstance(node, dict):
            if part not in node:
                return MISSING
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return MISSING
            node = node[int(part)]
        else:
            return MISSING
    return node


def children(node: Any) -> list[tuple[str, Any, Any]] | None:
    """The items of a saved container node as ``(path part, key as saved, child node)`` (keys of a tagged
    dict still encoded), or ``None`` for a leaf (a scalar, a tensor reference, a tagged scalar)."""
    if isinstance(node, list):
        return [(str(i), i, x) for i, x in enumerate(node)]
    if not isinstance(node, dict):
        return None
    if TAG not in node:
        return [(k, k, x) for k, x in node.items()]
    if node[TAG] == "tuple":
        return [(str(i), i, x) for i, x in enumerate(node["items"])]
    if node[TAG] in ("dict", "odict"):
        names = key_names(unflatten(k, lambda key: key) for k, _ in node["items"])
        return [(n, k, x) for n, (k, x) in zip(names, node["items"])]
    return None


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` (a target's state) is a tensor or a container with one somewhere inside."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            return True
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return False


def _group_names(params: Any) -> bool:
    return params is None or (isinstance(params, list) and all(isinstance(p, str) for p in params))


class Saved:
    """What the checkpoint holds, seen from one rank: its trees (this rank's first), tensor keys, and
    which parameters had optimizer state and which were in the optimizer at all."""

    def __init__(self, manifest: dict[str, Any], path: str, rank: int) -> None:
        ranks = sorted(manifest["ranks"], key=lambda r: (r["rank"] != rank, r["rank"]))
        self.trees = [r["tree"] for r in ranks]
        self.tensors = manifest["tensors"]
        self.optim_state: dict[str, Any] = {}  # fqn -> its saved state entries (a tree node)
        self.optim_params: set[str] = set()
        self.groups: list[dict[str, Any]] = []  # the saved param groups (tree nodes), from the first tree with some
        for r, t in zip(ranks, self.trees):
            o = t.get("optim")
            if not isinstance(o, dict):
                continue
            st = o.get("state")
            if isinstance(st, dict) and TAG not in st:
                for fqn, entries in st.items():
                    self.optim_state.setdefault(fqn, entries)
            found = o.get("param_groups", [])
            if not isinstance(found, list) or not all(_group_names(g.get("params")) for g in found if isinstance(g, dict) and TAG not in g):
                raise FormatError(
                    f"{path}: the optimizer state rank {r['rank']} saved has param_groups that do not list their parameters"
                    " by name (a list of groups, each with params: a list of strings): the checkpoint is corrupt or was altered"
                )
            groups = [g for g in found if isinstance(g, dict) and TAG not in g]
            self.groups = self.groups or groups
            for g in groups:
                self.optim_params.update(g.get("params") or [])

    def model_keys(self) -> set[str]:
        """The model state keys (FQNs) any saved tree holds, tensors or not (a module's extra state)."""
        return {k for t in self.trees if isinstance(m := t.get("model"), dict) and TAG not in m for k in m}

    def collapse(self, keys: list[str]) -> list[str]:
        """``keys`` with ``optim/state/<fqn>`` for a parameter all of whose saved entries are listed, else the entries."""
        out, listed = [], set(keys)
        for k in keys:
            parts = split_key(k)
            if parts[:2] == ["optim", "state"] and len(parts) == 4:
                whole = join_key(("optim", "state", parts[2]))
                if all(join_key(("optim", "state", parts[2], n)) in listed for n in self.entries(parts[2])):
                    if whole not in out:
                        out.append(whole)
                    continue
            out.append(k)
        return out

    def has(self, part: str) -> bool:
        return any(part in t for t in self.trees)

    def node(self, path: tuple[str, ...]) -> Any:
        for t in self.trees:
            node = lookup(t, path)
            if node is not MISSING:
                return node
        return MISSING

    def entries(self, fqn: str) -> dict[str, Any]:
        have = self.optim_state.get(fqn)
        return have if isinstance(have, dict) and TAG not in have else {}

    def flat_size(self, fqn: str, numel: int) -> int | None:
        """The size of the L-BFGS vectors saved under ``fqn`` where one is not ``numel`` (the target optimizer's
        parameters, flattened: another model's history, which its next step cannot use), else ``None``."""
        entries = self.entries(fqn)
        for name in LBFGS_FLAT:
            for key in sorted(keys_tagged(entries.get(name), "tensor")):
                ent = self.tensors.get(key)
                if ent is not None and math.prod(ent["shape"]) != numel:
                    return math.prod(ent["shape"])
        return None
