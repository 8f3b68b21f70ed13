"""What fits the daemon's shared-memory budget: segments are made in whole :data:`~ckptd.shm.ALIGN` units.

A shard's segment is its size rounded up to those units, so a shard just under a budget that is not a
whole number of units needs more than the budget (a 7 MiB budget holds segments of 6 MiB at most): its
``alloc`` is refused at once, before a memory-only step is dropped for it or it waits for room that can
never be enough. The rest of such a budget is not lost: it holds commit trees, which count in it
(:meth:`.slots.SlotPool.bytes_held`). Any thread.
"""

from __future__ import annotations

import logging

from .. import shm
from ..errors import ProtocolError

log = logging.getLogger("ckptd.daemon")


def aligned(nbytes: int) -> int:
    """The size of the segment that holds ``nbytes``: whole units, at least one."""
    return max(shm.ALIGN, -(-nbytes // shm.ALIGN) * shm.ALIGN)


def for_segments(budget: int) -> int:
    """The part of ``budget`` that segments can use (whole units)."""
    return budget // shm.ALIGN * shm.ALIGN


def noted(budget: int) -> int:
    """``budget``, unchanged; logged at start-up when segments cannot use all of it."""
    if for_segments(budget) != budget:
        log.info(
            "shm budget of %d bytes: segments are made in %d MiB units and use at most %d bytes of it (the rest holds commit trees)",
            budget, shm.ALIGN >> 20, for_segments(budget),
        )  # fmt: skip
    return budget


def check_fits(nbytes: int, budget: int) -> None:
    """``ProtocolError`` for a shard whose segment can never fit ``budget``."""
    if aligned(nbytes) > budget:
        raise ProtocolError(
            f"a shard of {nbytes} bytes exceeds the shared-memory budget of {budget} bytes: its segment takes {aligned(nbytes)}"
            f" ({shm.ALIGN >> 20} MiB units), and segments use at most {for_segments(budget)} bytes of the budget"
        )
