"""The GPU path, kept small and apart: page-locked staging slots and device-to-host copies on a
side stream, guarded by an event. Everything here is a no-op without CUDA.

Who calls what (trainer process): the client pins a slot's mapping (``pin``) the first time a
snapshot has CUDA tensors to copy into it and unpins it before unmapping (``unpin``); ``copy_async``
runs on the training thread inside ``snapshot()`` and only enqueues work; the returned event is
synchronized by the thread that commits (the background thread, or ``snapshot()`` itself when
blocking) before the daemon is told the bytes are there.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("ckptd.cuda")

_side_streams: dict[int, Any] = {}
_warned = False


def available() -> bool:
    return torch.cuda.is_available()


def pin(ptr: int, size: int) -> bool:
    """Page-lock ``size`` bytes of mapped shared memory at ``ptr`` (``cudaHostRegister``) so device
    copies into it run at full PCIe/NVLink speed and can be asynchronous. False if it cannot be."""
    global _warned
    if not available() or size == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        code = int(getattr(err, "value", err))
    except (RuntimeError, AttributeError, TypeError) as e:
        code, err = -1, e
    if code != 0:
        if not _warned:
            log.warning("cudaHostRegister of the staging slot failed (%s): device copies fall back to pageable memory", err)
            _warned = True
        return False
    return True


def unpin(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except (RuntimeError, AttributeError) as e:
        log.warning("cudaHostUnregister failed: %s", e)


def copy_async(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
    """Enqueue device-to-host copies of CUDA ``srcs`` into ``dsts`` on a side stream; return the event
    that marks their end. The side stream first waits for the work already queued on the current
    stream, so the copy sees the state as of this call."""
    device = srcs[0].device
    stream = _side_streams.get(device.index or 0)
    if stream is None:
        stream = _side_streams[device.index or 0] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for dst, src in zip(dsts, srcs):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event
