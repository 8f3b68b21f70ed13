"""A staging slot: one daemon-owned shared-memory segment, its state and who leased it (the pool that
hands them out is :mod:`.slots`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import psutil

from ..errors import CheckpointError
from ..protocol import CommitRecord

LEASE_FIELDS = ("job", "rank", "world_size", "step")
ADOPTED = -1  # in Slot.uids: the segment comes from an earlier run, whose readers are unknown


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
    born: float | None = None  # its start time (a pid is reused: the lessee is (pid, born)); None where unknown
    token: str | None = None  # leased: the secret only the lessee got; it must name it to commit or release
    leased_at: float = 0.0
    lease: dict[str, Any] | None = None  # leased: the lease's fields (LEASE_FIELDS), what a commit must match
    record: CommitRecord | None = None  # committed or held: the commit record (the shard it holds, until persisted)
    tree_bytes: int = 0  # committed: the tree the daemon holds in memory (counted in the budget)
    used_at: float = 0.0
    holds: tuple[str, int, int] | None = None  # (job, step, rank) a free slot still holds, persisted
    exposed: bool = False  # its name went to a hot restore's reader: renamed before it is leased again
    # the users whose processes learned its name (lessees, hot restores' readers; ADOPTED: a daemon before this
    # one's): with a group, an fd one of them kept open is writable again whenever the segment is (0660)
    uids: set[int | None] = field(default_factory=set)
    spare: bool = False  # made as a spare for ``owner`` and not leased since: its trainer may warm it
    pins: dict[str, tuple[int, float | None, float]] = field(default_factory=dict)  # pin token -> (reader pid, born, deadline)

    def committed(self) -> CommitRecord:
        """The commit record of a committed or held slot; ``LookupError`` for a slot that holds none (a caller's bug)."""
        if self.record is None:
            raise LookupError(f"slot {self.name} ({self.state.value}) holds no committed shard")
        return self.record


Grant = Callable[[bytes, Any, "Slot | CheckpointError"], None]  # (ident, request, slot or refusal)


def foreign(slot: Slot, msg: dict[str, Any]) -> bool:
    """With a group (segments 0660 while leased), a free slot that must be retired rather than leased for ``msg``: it
    was another job's, or its name went to a process of another user than the lessee's (one that leased it under this
    job's name, or read it). Such a process may still hold a writable mapping of it, or an fd it can reopen for
    writing (``/proc/self/fd``) once it is 0660 again, which no mode or name change takes back."""
    return (slot.owner is not None and slot.owner[0] != msg["job"]) or bool(slot.uids - {msg.get("uid")})


_PROC = os.path.exists("/proc/self/stat")


def started(pid: int) -> float | None:
    """When live process ``pid`` started (its identity with the pid: pids are reused), or ``None`` if it is gone or a
    zombie (a dead worker nobody reaped). Linux: the kernel's start time in clock ticks since boot, which no change
    of the wall clock moves (psutil's ``create_time`` adds the boot time, re-read from the wall clock each call: an
    NTP step would make every live trainer look dead)."""
    if not _PROC:
        try:
            p = psutil.Process(pid)
            return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
        except (psutil.Error, ValueError, OverflowError):
            return None
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except (OSError, ValueError, OverflowError):
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name, which may hold anything: state, ...
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return float(fields[19])  # field 22, starttime


def is_running(pid: int, born: float | None) -> bool:
    """Process ``pid`` that started at ``born`` is still running: a pid since reused by another process is
    not (a lease or pin of a dead trainer would otherwise stay held until it lapses). ``born`` None (the
    start time could not be read when the pid was recorded): the pid alone."""
    return pid_alive(pid) if born is None else started(pid) == born


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
