"""What the slot pool's slots still hold once their lease is over, and who reads it.

A slot that is not leased may still hold a complete shard, ``(job, step, rank)`` in :attr:`.slot.Slot.holds`: a
persisted one (free, reusable: a hot restore reads it while it lasts), one being persisted (committed), or the only
copy of a memory-tier step's shard (held, :mod:`.memtier`). :class:`Holdings` is the one place that reads and changes
that, for the memory tier, completion and hot restores; the pool (:mod:`.slots`) makes one over its slots and
leases a slot only when no hot restore pins it. Main thread only (the daemon's loop).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from .. import shm
from ..config import HOT_PIN_MAX_S, MAX_PINS_PER_READER, MAX_PINS_UNNAMED
from ..errors import CheckpointError
from .slot import Slot, SlotState, started


class Holdings:
    """The complete shards the pool's slots hold, by (job, step, rank), and the hot-restore pins on those slots."""

    def __init__(
        self,
        slots: dict[str, Slot],
        segments: shm.SegmentDir,
        *,
        reset: Callable[[Slot], None],
        freed: Callable[[], None],
        clock: Callable[[], float],
        alive: Callable[[int, float | None], bool],
    ) -> None:
        """``slots``: the pool's (read here, never added to or removed from); ``reset(slot)``: the pool's, to make a
        slot free; ``freed()``: the pool's, to try its deferred requests again once a pin is gone."""
        self._slots, self._segments, self._reset, self._freed = slots, segments, reset, freed
        self._clock, self._alive = clock, alive

    # ------------------------------------------------------------------ what slots hold

    def of(self, job: str, step: int) -> dict[int, Slot]:
        """The slots that still hold a complete shard of ``step`` of ``job``, by rank.

        Args:
            job: the job.
            step: the step.

        Returns:
            rank -> slot: persisted, held in the memory tier, or being persisted from it (the newest, should an
            abandoned attempt have left one too).
        """
        hold = [s for s in self._slots.values() if s.state is not SlotState.LEASED and s.holds is not None and s.holds[:2] == (job, step)]
        return {s.holds[2]: s for s in sorted(hold, key=lambda s: s.used_at)}  # type: ignore[index]

    def memory_only(self, job: str, step: int) -> list[Slot]:
        """Of :meth:`of`, the slots in state HELD: a memory-tier step's, not being persisted or freed."""
        return [s for s in self.of(job, step).values() if s.state is SlotState.HELD]

    def steps(self) -> set[tuple[str, int]]:
        """(job, step) of every complete shard a slot still holds."""
        return {(s.holds[0], s.holds[1]) for s in self._slots.values() if s.holds is not None and s.state is not SlotState.LEASED}

    def hold(self, slot: Slot, holds: tuple[str, int, int]) -> None:
        """A committed slot holds the only copy of a memory-tier step's shard: kept, with its commit record
        (a daemon that crashes persists it on restart), until :meth:`release` or :meth:`drop`."""
        slot.state, slot.holds = SlotState.HELD, holds

    def release(self, slot: Slot) -> None:
        """A held slot's step is persisted after all: committed again, for a persist thread."""
        slot.state = SlotState.COMMITTED

    def drop(self, job: str, step: int) -> int:
        """Free the held slots of ``step`` of ``job`` (the step is dropped from memory).

        Args:
            job: the job.
            step: the step dropped.

        Returns:
            How many slots were freed. Deferred requests are not retried here: this may run inside a lease (reclaim).
        """
        dropped = [s for s in self._slots.values() if s.state is SlotState.HELD and s.holds is not None and s.holds[:2] == (job, step)]
        for slot in dropped:
            self._segments.drop_record(slot.name)
            slot.holds = None
            self._reset(slot)
        return len(dropped)

    def forget(self, job: str, step: int) -> None:
        """Step ``step`` of ``job`` is gone (replaced): no slot serves its shards to a hot restore any more."""
        for s in self._slots.values():
            if s.holds is not None and s.holds[:2] == (job, step):
                s.holds = None

    # ------------------------------------------------------------------ hot restores' pins

    def pin(self, slots: list[Slot], pid: int, uid: int | None = None) -> str:
        """Keep ``slots`` from reuse while process ``pid`` reads them.

        A pin lasts until :meth:`unpin` with the returned token, the reader's death, or HOT_PIN_MAX_S. A reader holds at
        most ``MAX_PINS_PER_READER`` pins on a slot (a client that opens and never closes would pile up pins, each
        checked every housekeeping pass); pid 0 (unnamed) shares ``MAX_PINS_UNNAMED``.

        Args:
            slots: the slots read.
            pid: the reader's process (0: outside this PID namespace).
            uid: the reader's user, when known.

        Returns:
            The pin's token.
        """
        limit = MAX_PINS_PER_READER if pid else MAX_PINS_UNNAMED
        for slot in slots:
            if sum(1 for p, _, _ in slot.pins.values() if p == pid) >= limit:
                who = f"process {pid}" if pid else "processes outside this PID namespace"
                raise CheckpointError(f"{who} already holds {limit} open hot restores of {slot.name}: close them (hot_close) first")
        token, deadline, born = secrets.token_hex(16), self._clock() + HOT_PIN_MAX_S, started(pid) if pid else None
        for slot in slots:
            slot.pins[token] = (pid, born, deadline)
            slot.exposed = True
            slot.uids.add(uid)
        return token

    def unpin(self, names: list[Any], token: str, peer: int | None = None) -> None:
        """Drop pin ``token`` (taken by process ``peer``, when the transport tells) from the slots
        ``names``; another reader's pins are untouched."""
        for name in names:
            slot = self._slots.get(name) if isinstance(name, str) else None
            if slot is not None and token in slot.pins and (not peer or slot.pins[token][0] == peer):
                slot.pins.pop(token)
        self._freed()

    def lapse_pins(self, slot: Slot, now: float) -> bool:
        """Drop the pins on ``slot`` of readers that died or held it longer than any restore takes; True if any went."""
        lapsed = False
        for token, (pid, born, deadline) in list(slot.pins.items()):
            if deadline < now or (pid and not self._alive(pid, born)):
                slot.pins.pop(token)
                lapsed = True
        return lapsed
