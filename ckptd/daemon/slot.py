"""A staging slot: one daemon-owned shared-memory segment, its state and who leased it (the pool that
hands them out is :mod:`.slots`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import CheckpointError

LEASE_FIELDS = ("job", "rank", "world_size", "step")


class SlotState(StrEnum):
    FREE = "free"
    LEASED = "leased"
    COMMITTED = "committed"
    HELD = "held"


@dataclass
class Slot:
    name: str
    size: int
    state: SlotState = SlotState.FREE
    owner: tuple[str, int] | None = None  # (job, rank) that used it last: reused first by them
    pid: int | None = None  # the lessee's process
    token: str | None = None  # leased: the secret only the lessee got; it must name it to commit or release
    leased_at: float = 0.0
    lease: dict[str, Any] | None = None  # leased: the lease's fields; committed: the commit record
    tree_bytes: int = 0  # committed: the tree the daemon holds in memory (counted in the budget)
    used_at: float = 0.0
    holds: tuple[str, int, int] | None = None  # (job, step, rank) a free slot still holds, persisted
    exposed: bool = False  # its name went to a hot restore's reader: renamed before it is leased again
    spare: bool = False  # made as a spare for ``owner`` and not leased since: its trainer may warm it
    pins: dict[str, tuple[int, float]] = field(default_factory=dict)  # pin token -> (reader pid, deadline)


Grant = Callable[[bytes, Any, "Slot | CheckpointError"], None]  # (ident, request, slot or refusal)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError, OSError):
        return False  # not a pid at all
    return True
