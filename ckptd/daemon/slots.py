"""The slot pool: the daemon's shared-memory staging segments, who leases them, and what they hold.

A slot is ``free`` (reusable; it may still hold a persisted shard that a hot restore can read), ``leased`` to a
trainer rank that is filling it, ``committed``: it holds a rank's complete shard that a persist thread is writing to
disk (or a seal thread is reading the header of), or ``held``: it holds the only copy of a memory-tier step's shard
(:mod:`.memtier`), kept until that step is dropped or persisted. Leasing prefers the rank's own previous slot (the
trainer keeps a warm mapping of it), then creates a segment if the budget allows, evicting free slots least recently
used first, else reuses the smallest free slot that fits; when nothing fits the request is deferred (backpressure) and
granted as soon as a slot frees up, unless ``reclaim`` can drop a memory-tier step of the job to make room. A request
that a seal under way will serve in milliseconds (``soon``: the step it completes makes an older memory-only step
stale) waits for it rather than for a new segment. A rank that took its last free slot while the disk lags gets a
spare made off the loop (:mod:`.growth`, like every new segment), which its trainer maps ahead before a snapshot of
that rank may take it. What a slot holds once its lease is over, and the pins of hot restores that read it, are
:attr:`SlotPool.holdings` (:mod:`.holdings`).

Main thread only (the daemon's loop). Deferred grants go out through ``on_grant`` (a test passes a list's ``append``).
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import shm
from ..config import LEASE_TIMEOUT_S, MAX_DEFERRED_ALLOCS
from ..errors import CheckpointError, ProtocolError
from ..protocol import CommitRecord
from .budget import aligned, check_fits, noted
from .holdings import Holdings
from .slot import ADOPTED, LEASE_FIELDS, Grant, Slot, SlotState, foreign, is_running, started

log = logging.getLogger("ckptd.daemon")
_UNSAFE = (SlotState.COMMITTED, SlotState.HELD)  # what a crash of the node would lose: shards being persisted, memory-only ones


@dataclass(frozen=True)
class Room:
    """What the pool asks the memory tier when it is short of room (the daemon passes calls through itself, the tier
    being made after the pool). ``reclaim(job, step)``: drop a memory-tier step of ``job`` (not ``step``) to make room;
    True if it freed slots. ``soon(job, step)``: a seal under way will complete a memory-tier step of the job and so drop
    an older one, freeing its slots in milliseconds (a request short of a slot waits for that, not for a new segment).
    ``want_spare(job)``: the job queues every due step for disk (``lagging = "wait"``): when its disk lags, a rank that
    takes its last free slot gets a spare made off the loop, not on its next snapshot's path."""

    reclaim: Callable[[str, int | None], bool] = lambda job, step: False
    soon: Callable[[str, int | None], bool] = lambda job, step: False
    want_spare: Callable[[str], bool] = lambda job: False


class SlotPool:
    def __init__(
        self,
        segments: shm.SegmentDir,
        budget: int,
        *,
        on_grant: Grant | None = None,
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[int, float | None], bool] = is_running,
        lease_timeout: float = LEASE_TIMEOUT_S,
        grow: Callable[[int, int], None] | None = None,
        room: Room = Room(),
    ) -> None:
        """``grow(need, token)``: make a segment off the loop and report it to :meth:`created`; without it (unit tests)
        segments are made in place. ``room``: the memory tier's answers when the pool is short (none: no memory tier)."""
        self.segments, self.budget, self.lease_timeout = segments, noted(budget), lease_timeout
        self._on_grant = on_grant or (lambda ident, msg, result: None)
        self._clock, self._alive, self._grow = clock, alive, grow
        self.reclaim, self.soon, self.want_spare = room.reclaim, room.soon, room.want_spare
        self.slots: dict[str, Slot] = {}
        self.deferred: list[tuple[bytes, dict[str, Any]]] = []  # (ident, alloc request) waiting for memory
        self.growing: dict[int, int] = {}  # grow token -> bytes being made off the loop (counted in the budget)
        self.spares: dict[int, tuple[str, int]] = {}  # grow token -> (job, rank) a spare is made for, on no request's path
        self.allocs_waited = 0  # snapshot allocations that had to wait (for memory, or for a segment to be made)
        self.holdings = Holdings(  # clock and alive through the pool: one answer for leases and pins
            self.slots, segments, reset=self._reset, freed=self.retry_deferred,
            clock=lambda: self._clock(), alive=lambda pid, born: self._alive(pid, born),
        )  # fmt: skip

    def __iter__(self) -> Iterator[Slot]:
        return iter(list(self.slots.values()))

    def get(self, name: str) -> Slot | None:
        return self.slots.get(name)

    # ------------------------------------------------------------------ leasing

    def request(self, ident: bytes, msg: dict[str, Any]) -> Slot | None:
        """An ``alloc``: a leased slot now, or ``None`` and the request deferred until memory frees up."""
        check_fits(msg["nbytes"], self.budget)  # its segment, in whole units: refused before anything is dropped for it
        msg["_born"] = started(msg["pid"]) if msg["pid"] else None  # who asks: see _take
        slot = self.lease(msg)
        if slot is None:
            if not msg.get("wait", True) and "_growing" not in msg:
                raise CheckpointError(self._short(msg["nbytes"]))
            if len(self.deferred) >= MAX_DEFERRED_ALLOCS:
                raise CheckpointError(f"{len(self.deferred)} allocations already wait for shared memory; try again later")
            if msg.get("timeout"):
                msg["_deadline"] = self._clock() + msg["timeout"]
            self.deferred.append((ident, msg))
            if not msg.get("warm"):
                self.allocs_waited += 1
        elif not msg.get("warm"):
            self._spare(slot.owner, slot.size)
        return slot

    def _short(self, nbytes: int, waited: float | None = None) -> str:
        held = self.bytes_held()
        since = f" after waiting {waited:.0f} s" if waited is not None else ""
        return (
            f"no room for a {nbytes}-byte slot in the shared-memory budget{since}: {held} of {self.budget} bytes are held"
            " (slots being filled or persisted, memory-tier steps); raise --shm-budget, or prepare() fewer slots"
        )

    def lease(self, msg: dict[str, Any]) -> Slot | None:
        """Lease a slot of at least ``msg["nbytes"]`` to ``(job, rank)``, or ``None`` if none fits the budget."""
        if msg.get("spare"):
            return self._lease_spare(msg)
        owner, need = (msg["job"], msg["rank"]), msg["nbytes"]
        free = [s for s in self.slots.values() if s.state is SlotState.FREE and not s.pins and s.size >= need]
        # the rank's own slot first: the trainer already holds a warm mapping of it
        slot = min((s for s in free if s.owner == owner), key=lambda s: s.size, default=None)
        if slot is None and "_growing" not in msg and not msg.get("warm") and msg.get("wait", True) and self.soon(msg["job"], msg["step"]):
            return None  # deferred: a seal under way makes a memory-only step stale and frees its slots in milliseconds
        used = self.bytes_held()
        rounded = aligned(need)
        if slot is None and (used + rounded > self.budget or "_growing" in msg):
            # over budget: any free slot that fits; this request's own segment still being made (another request of
            # the same rank took the one that came first): an unowned one, never another rank's (its trainer mapped it)
            slot = min((s for s in free if used + rounded > self.budget or s.owner is None), key=lambda s: s.size, default=None)
        if slot is not None and not self._writable(slot, msg):
            return self.lease(msg)  # retired: another slot, or a new one
        if slot is None:
            slot = self._create(need, rounded, used, msg)
            if slot is None:
                # a memory-tier step is dropped only for a snapshot: prepare() warming the pool is refused instead,
                # never paid for with a job's newest state (a restarted trainer prepares before it restores); and not
                # while spares being made hold the room: the request waits, and a spare that lands goes to it
                if "_growing" in msg or msg.get("warm") or self.bytes_held() - self._spare_room() + rounded <= self.budget:
                    return None
                if self.reclaim(msg["job"], msg["step"]):
                    return self.lease(msg)  # a memory-tier step made room
                return None
        return self._take(slot, owner, msg)

    def _take(self, slot: Slot, owner: tuple[str, int], msg: dict[str, Any]) -> Slot:
        if "_born" not in msg:  # the lessee's start time, noted when it asked (request()): a pid is reused
            msg["_born"] = started(msg["pid"]) if msg["pid"] else None
        slot.state, slot.owner, slot.pid, slot.born = SlotState.LEASED, owner, msg["pid"] or None, msg["_born"]
        slot.holds, slot.token, slot.spare, slot.used_at = None, secrets.token_hex(16), False, self._clock()
        slot.leased_at = slot.used_at
        slot.lease = {k: msg[k] for k in LEASE_FIELDS}
        slot.uids.add(msg.get("uid"))
        return slot

    def _lease_spare(self, msg: dict[str, Any]) -> Slot | None:
        """A trainer warming the spare made for its rank (mapping it off its snapshots' path): that slot, or ``None``
        while it is being made; refused when none is coming, or while a snapshot with no spare of its own waits for
        memory (a spare is a guess: a request that exists comes first; the rank's own waits for it mapped)."""
        owner = (msg["job"], msg["rank"])
        if self._needs_room(but=owner):
            raise CheckpointError("the spare slot is left to a snapshot that waits for memory")
        slot = self._free_spare(owner, msg["nbytes"])
        if slot is not None:
            if not self._writable(slot, msg):
                raise CheckpointError("the spare slot could not be made writable")
            self._take(slot, owner, msg).spare = True  # still a spare while its trainer maps it: see _spare_room
            return slot
        token = next((t for t, o in self.spares.items() if o == owner), None)
        if token is None:
            raise CheckpointError(f"no spare slot is being made for rank {owner[1]} of job {owner[0]}")
        msg["_growing"] = token  # deferred until it is made
        return None

    def spare_coming(self, owner: tuple[str, int] | None, nbytes: int) -> bool:  # a spare of ``nbytes`` being made for it, or free
        coming = any(o == owner and self.growing.get(t, 0) >= nbytes for t, o in self.spares.items())
        return coming or self._free_spare(owner, nbytes) is not None

    def _free_spare(self, owner: tuple[str, int] | None, nbytes: int) -> Slot | None:  # made, not leased since
        free = (s for s in self.slots.values() if s.spare and s.owner == owner and s.state is SlotState.FREE)
        return next((s for s in free if not s.pins and s.size >= nbytes), None)

    def _spare_room(self) -> int:  # bytes of spares being made, or leased to be mapped ahead: room a snapshot may wait for
        leased = sum(s.size for s in self.slots.values() if s.spare and s.state is SlotState.LEASED)
        return leased + sum(self.growing.get(t, 0) for t in self.spares)

    def _snapshot_waits(self) -> bool:  # a request other than a spare's warming waits for memory
        return any(not m.get("spare") for _, m in self.deferred)

    def _needs_room(self, but: tuple[str, int]) -> bool:
        """A snapshot of a rank other than ``but`` waits for memory with no spare of its own being made or mapped."""
        mine = {o for o in self.spares.values()} | {s.owner for s in self.slots.values() if s.spare}
        return any(not m.get("spare") and (o := (m["job"], m["rank"])) != but and o not in mine for _, m in self.deferred)

    def _spare(self, owner: tuple[str, int] | None, size: int) -> None:
        """``owner`` (job, rank) just took its last free slot while one of its own is still being persisted
        (its disk lags): with a grower, room in the budget and a job whose due steps all go to disk, make it a
        spare segment off the loop, so that its next snapshot finds a slot instead of waiting while one is made."""
        if self._grow is None or owner is None or owner in self.spares.values() or not self.want_spare(owner[0]):
            return
        slots, rounded = self.slots.values(), aligned(size)
        # not while a snapshot waits (a guess must not take the room it waits for), nor while the rank has a free slot, nor
        # once its own last step is on disk (its disk keeps up: another rank's persist is not this one's lag), nor over budget
        if self._snapshot_waits() or any(s.state is SlotState.FREE and s.owner == owner for s in slots):
            return
        if not any(s.state is SlotState.COMMITTED and s.owner == owner for s in slots) or self.bytes_held() + rounded > self.budget:
            return
        token = secrets.randbits(62)
        self.growing[token], self.spares[token] = rounded, owner
        self._grow(size, token)

    def _writable(self, slot: Slot, msg: dict[str, Any]) -> bool:
        """A free slot about to be leased for ``msg``, made writable (``--group``: committed segments are read-only), renamed
        if a reader learned its name; False (retired) if that failed or another job or user may write it (``foreign``)."""
        if self.segments.sealed_mode != self.segments.file_mode and foreign(slot, msg):
            log.info("segment %s of job %s retired rather than leased to job %s", slot.name, slot.owner and slot.owner[0], msg["job"])
            self.unlink(slot)
            return False
        try:
            name = self.segments.unseal(slot.name, rename=slot.exposed)
        except OSError as e:
            log.error("cannot lease %s again (%s): segment retired", slot.name, e.strerror or e)
            self.unlink(slot)
            return False
        if name != slot.name:
            self.slots[name] = self.slots.pop(slot.name)
            slot.name = name
        slot.exposed = False
        return True

    def _create(self, need: int, rounded: int, used: int, msg: dict[str, Any]) -> Slot | None:
        """A new segment, after evicting free slots (least recently used first) until it fits (none when that is not
        enough); with a grower, asked for off the loop (the request waits for :meth:`created`, once)."""
        if self._grow is not None and "_growing" in msg:
            return None  # its segment is on the way
        victims = sorted((s for s in self.slots.values() if s.state is SlotState.FREE and not s.pins), key=lambda s: s.used_at)
        if used - sum(v.size for v in victims) + rounded > self.budget:
            return None  # evicting every free slot would not make room: none is (another request may reuse one)
        for victim in victims:
            if used + rounded <= self.budget:
                break
            used -= victim.size
            self.unlink(victim)
        if used + rounded > self.budget:
            return None
        if self._grow is not None:
            token = msg["_growing"] = secrets.randbits(62)
            self.growing[token] = rounded
            self._grow(need, token)
            return None
        name, size = self.segments.create(need)
        slot = Slot(name, size)
        self.slots[name] = slot
        return slot

    def leased(self, name: str, token: str, peer: int | None = None) -> Slot:
        """The slot ``name`` leased with ``token`` (by process ``peer``, when the transport tells);
        ``ProtocolError`` if there is none (another client's lease, one that lapsed, or no such segment)."""
        slot = self.slots.get(name)
        if slot is None:
            raise ProtocolError(f"unknown segment {name!r}")
        if slot.state is not SlotState.LEASED:
            raise ProtocolError(f"segment {name!r} is not leased (it is {slot.state.value})")
        if slot.token is None or not hmac.compare_digest(slot.token.encode(), token.encode()):
            raise ProtocolError(f"segment {name!r} is not leased to this client (wrong lease token)")
        if peer and slot.pid is not None and peer != slot.pid:
            raise ProtocolError(f"segment {name!r} is not leased to this client (another process took the lease)")
        return slot

    def commit(self, slot: Slot, record: CommitRecord, tree_bytes: int = 0) -> None:
        """The lessee filled the slot and committed it (``record``; ``tree_bytes``: its tree, counted in the budget): it is
        the persist threads' until :meth:`persisted`. Its lease is over."""
        slot.state, slot.lease, slot.record, slot.token, slot.tree_bytes = SlotState.COMMITTED, None, record, None, tree_bytes
        try:
            self.segments.seal(slot.name)  # --group: no member opens it for writing any more
        except OSError as e:
            log.warning("cannot make %s read-only to the group: %s", slot.name, e.strerror or e)

    def persisted(self, slot: Slot, holds: tuple[str, int, int] | None) -> None:
        """A persist thread is done with a committed slot: drop its commit record, free it, and remember
        which shard it still holds (``None`` when persisting failed)."""
        self.segments.drop_record(slot.name)
        slot.holds = holds
        self.free(slot)

    def free(self, slot: Slot) -> None:
        self._reset(slot)
        self.retry_deferred()

    def _reset(self, slot: Slot) -> None:
        slot.state, slot.pid, slot.born, slot.lease, slot.record, slot.used_at = SlotState.FREE, None, None, None, None, self._clock()
        slot.token, slot.tree_bytes, slot.spare = None, 0, False

    def created(self, token: int, name: str | None, size: int, error: str | None = None) -> None:
        """A segment asked of the grower is made (``name``: it goes to the request that asked for it) or
        failed (``error``: that request is refused); then every deferred request is tried again."""
        self.growing.pop(token, None)
        spare_for = self.spares.pop(token, None)  # a spare: its rank's, free until that rank's next snapshot
        asked = [d for d in self.deferred if d[1].get("_growing") == token]
        if name is not None:
            owner = (asked[0][1]["job"], asked[0][1]["rank"]) if asked else spare_for
            self.slots[name] = Slot(name, size, owner=owner, used_at=self._clock(), spare=spare_for is not None)
        else:
            log.error("cannot make a staging segment of %d bytes: %s", size, error)
            for ident, msg in asked:
                self.deferred.remove((ident, msg))
                self._on_grant(ident, msg, CheckpointError(f"cannot allocate {size} bytes of shared memory: {error}"))
        self.retry_deferred(spare=token)

    def retry_deferred(self, spare: int | None = None) -> None:
        """Try every deferred request again (each stays listed meanwhile: a warming's grant depends on who waits): first the
        warming of spare ``spare`` (a grow token) just made, so its rank's snapshot never maps it on its path, then the rest."""
        mine = lambda m: spare is not None and m.get("spare") and m.get("_growing") == spare  # noqa: E731
        for ident, msg in sorted(self.deferred, key=lambda d: (not mine(d[1]), bool(d[1].get("spare")))):
            try:
                slot: Slot | CheckpointError | None = self.lease(msg)
            except CheckpointError as e:
                slot = e
            except Exception as e:  # /dev/shm itself failing, or a bug: refuse this one, keep the others waiting
                log.error("deferred allocation failed: %s", e, exc_info=not isinstance(e, OSError))
                slot = CheckpointError(f"cannot allocate shared memory: {e}")
            if slot is not None:
                self.deferred = [d for d in self.deferred if d[1] is not msg]
                self._on_grant(ident, msg, slot)

    def unlink(self, slot: Slot) -> None:
        self.segments.unlink(slot.name)
        self.slots.pop(slot.name, None)

    # ------------------------------------------------------------------ recovery

    def adopt(self, name: str, size: int, record: CommitRecord) -> Slot:
        """Take over a segment a previous run committed (its commit ``record`` read back, checked)."""
        slot = Slot(name, size, state=SlotState.COMMITTED, owner=(record.job, record.rank), record=record)
        slot.exposed = True  # the daemon before this one may have given its name to readers
        slot.uids.add(ADOPTED)
        slot.tree_bytes = len(record.tree)
        self.slots[name] = slot
        return slot

    # ------------------------------------------------------------------ housekeeping

    def reap(self, now: float) -> None:
        """Free slots whose lessee died (a process is its pid and start time; one the daemon cannot see, in another PID
        namespace, never dies for it) or lapse them past the lease timeout; drop pins and deferred requests of the dead."""
        # first: a freed slot must not go to the dead (pid 0: unknown, kept), nor to a client that gave up
        self.deferred = [(i, m) for i, m in self.deferred if not m["pid"] or self._alive(m["pid"], m.get("_born"))]
        # a request waiting for its own segment is not timed out (that segment is coming), one warming a spare is
        late = [d for d in self.deferred if d[1].get("_deadline", now + 1) < now and ("_growing" not in d[1] or d[1].get("spare"))]
        for ident, msg in late:
            self.deferred.remove((ident, msg))
            self._on_grant(ident, msg, CheckpointError(self._short(msg["nbytes"], msg["timeout"])))
        lapsed = False
        for slot in list(self.slots.values()):
            if slot.state is SlotState.LEASED and slot.pid is not None and not self._alive(slot.pid, slot.born):
                log.warning("trainer pid %s died holding %s uncommitted: slot freed, nothing of it is persisted", slot.pid, slot.name)
                self.free(slot)
            elif slot.state is SlotState.LEASED and now - slot.leased_at > self.lease_timeout:
                # its holder may still live (another PID namespace, a stalled trainer) and write through its mapping:
                # the segment is retired, never leased to anyone else (its memory returns when the holder unmaps)
                log.warning(
                    "the lease of %s (pid %s) lapsed after %.0f s uncommitted: segment retired", slot.name, slot.pid, self.lease_timeout
                )
                self.unlink(slot)
                lapsed = True
            lapsed = self.holdings.lapse_pins(slot, now) or lapsed
        if lapsed:
            self.retry_deferred()

    def close(self) -> None:
        """Shutdown: unlink every slot but the committed ones (a restart persists those)."""
        for slot in list(self.slots.values()):
            if slot.state is not SlotState.COMMITTED:
                self.unlink(slot)
        self.segments.close()

    # ------------------------------------------------------------------ for status

    def bytes_held(self) -> int:
        """Segments (also those being made), and the trees of committed slots the daemon holds until persisted."""
        return sum(s.size + s.tree_bytes for s in self.slots.values()) + sum(self.growing.values())

    def summary(self) -> dict[str, Any]:
        states = collections.Counter(s.state.value for s in self.slots.values())
        return {
            "shm_budget": self.budget,
            "shm_bytes": self.bytes_held(),
            "staged_bytes": sum(s.record.nbytes for s in self.slots.values() if s.state in _UNSAFE and s.record is not None),
            "slots": dict(states),
            "deferred_allocs": len(self.deferred),
            "allocs_waited": self.allocs_waited,
            "hot_pins": {s.name: sorted(pid for pid, _, _ in s.pins.values()) for s in self.slots.values() if s.pins},
        }
