"""``prepare()`` before the optimizer's first step: the size its slots need once the optimizer has state.

A training script calls ``prepare(model, optim)`` before its loop, when a fresh optimizer has no state yet
(torch optimizers make it lazily, in the first ``step()``). Slots sized for the parameters alone are too
small for every snapshot after that step (AdamW's state is twice the parameters), so the first snapshot
would make a segment on its own path: what ``prepare()`` is there to avoid. :func:`projected_items` finds
the state the first step will make without making it: a shadow optimizer of the same class and
hyperparameters steps meta-device stand-ins of the parameters (no memory, no computation, the real
optimizer untouched), and its state's shapes and dtypes become layout items beside each parameter's own.
Trainer's main thread, inside ``prepare()``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..state import join_key
from .capture import local_tensor

log = logging.getLogger("ckptd.client")

Item = tuple[str, str, torch.dtype, tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # format.build_layout's
_FLAGS_OFF = {"foreach": False, "fused": False, "capturable": False}  # the plain single-tensor path: meta tensors take it


def projected_items(items: list[Item], model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> list[Item]:
    """``items`` (this rank's layout) plus the optimizer state entries its first step will make for the
    parameters among them that have none yet (all of them before the first step; a new head's after a
    ``restore(strict=False)``); ``items`` alone when every parameter has state or the shadow cannot step."""
    if optim is None or not items:
        return items
    lacking = {id(p) for g in optim.param_groups for p in g["params"] if p.requires_grad and not optim.state.get(p)}
    if not lacking:
        return items
    if not type(optim).__module__.startswith("torch.optim"):  # its constructor or step may do anything (collectives)
        log.info(
            "prepare(): %s has no state yet; slots fit the parameters only (call prepare() after its first step)", type(optim).__name__
        )
        return items
    try:
        state = _shadow_state(optim)
    except Exception as e:  # an optimizer whose step needs real data (a closure, .item() on a gradient)
        log.warning("prepare(): could not foresee %s's state (%s): slots fit the parameters only", type(optim).__name__, e)
        return items
    from torch.distributed.checkpoint.state_dict import _get_fqns

    by_key: dict[str, list[tuple[str, str, torch.Tensor, tuple[int, ...]]]] = {}  # model key -> (fqn, name, meta value, local shape)
    for name, p in model.named_parameters():
        fqns = _get_fqns(model, name)
        if len(fqns) != 1 or id(p) not in lacking:  # a flat parameter (FSDP1 without use_orig_params): not foreseen here
            continue
        (fqn,) = fqns
        local = tuple(local_tensor(p).shape)
        by_key[join_key(("model", fqn))] = [(fqn, k, v, local) for k, v in state.get(id(p), {}).items()]
    out = list(items)
    scalars: set[str] = set()
    for name, key, _, sizes, gshape, offsets in items:
        for fqn, k, v, local in by_key.get(key, ()):
            skey = join_key(("optim", "state", fqn, k))
            # shaped like the parameter where this rank holds it (a chunk of it, or FSDP1's flat slice of one): saved
            # as the parameter is, a chunk beside each of its chunks
            if tuple(v.shape) in (sizes, local):
                out.append((name.replace(key, skey, 1), skey, v.dtype, sizes, gshape, offsets))
            elif skey not in scalars:  # a step counter: once
                scalars.add(skey)
                out.append((skey, skey, v.dtype, tuple(v.shape), tuple(v.shape), (0,) * v.dim()))
    return out


def _shadow_state(optim: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """id(real parameter) -> the tensors the first ``step()`` gives it, as a shadow on the meta device makes them."""
    real: dict[int, torch.Tensor] = {}
    groups = []
    for g in optim.param_groups:
        shadows = []
        for p in g["params"]:
            loc = local_tensor(p)
            sp = torch.nn.Parameter(torch.empty(loc.shape, dtype=loc.dtype, device="meta"), requires_grad=p.requires_grad)
            if p.requires_grad:  # a parameter that gets gradients gets state
                sp.grad = torch.empty_like(sp)
            real[id(sp)] = p
            shadows.append(sp)
        groups.append(
            {**{k: v for k, v in g.items() if k != "params"}, **{f: v for f, v in _FLAGS_OFF.items() if f in g}, "params": shadows}
        )
    shadow: Any = type(optim)(groups)
    step = getattr(type(shadow).step, "__wrapped__", type(shadow).step)  # without the step hooks: no hook sees a shadow's step
    with torch.no_grad():
        step(shadow)
    return {id(real[id(sp)]): {k: v for k, v in st.items() if isinstance(v, torch.Tensor)} for sp, st in shadow.state.items()}
