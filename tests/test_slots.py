"""The slot pool alone: no socket, no daemon. Leasing, budget and eviction, backpressure, hot-restore
pins and reaping, on real /dev/shm segments (each test's own namespace, unlinked afterwards)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd import shm
from ckptd.config import HOT_PIN_MAX_S
from ckptd.daemon.slots import SlotPool, SlotState
from ckptd.errors import CheckpointError, ProtocolError
from ckptd.protocol import CommitRecord

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, Any]]:
    segments = shm.SegmentDir(str(tmp_path))
    grants: list[tuple[bytes, Any, Any]] = []
    dead: set[int] = set()
    clock = Clock()

    def make(budget: int) -> SlotPool:
        grant = lambda i, m, r: grants.append((i, m, r))  # noqa: E731
        return SlotPool(segments, budget, on_grant=grant, clock=clock, alive=lambda pid, born: pid not in dead, lease_timeout=100.0)

    try:
        yield {"make": make, "grants": grants, "dead": dead, "clock": clock, "root": str(tmp_path)}
    finally:
        shm.purge(str(tmp_path))


def _req(rank: int = 0, nbytes: int = MiB, pid: int | None = None, job: str = "j", step: int = 1) -> dict[str, Any]:
    return {"id": 7, "job": job, "rank": rank, "world_size": 4, "step": step, "nbytes": nbytes, "pid": pid or os.getpid()}


def _record(job: str = "j", rank: int = 0, step: int = 1, nbytes: int = 10) -> CommitRecord:
    """A commit of ``rank``'s shard of ``step`` (4 ranks, all on this node)."""
    fields = {"local_world_size": 4, "replicas": {}, "committed_at": 1, "run": None, "after": None}
    return CommitRecord(job=job, rank=rank, world_size=4, step=step, nbytes=nbytes, **fields, tree=b"{}")


def test_a_rank_gets_its_own_slot_back(env: dict[str, Any]) -> None:
    pool = env["make"](8 * MiB)
    a, b = pool.lease(_req(rank=0)), pool.lease(_req(rank=1))
    assert a is not None and b is not None and a.name != b.name
    pool.free(a)
    pool.free(b)
    assert pool.lease(_req(rank=1)) is b  # its warm mapping in the trainer: the same segment
    assert pool.lease(_req(rank=0)) is a
    assert a.lease == {"job": "j", "rank": 0, "world_size": 4, "step": 1}


def test_budget_full_defers_and_a_release_grants(env: dict[str, Any]) -> None:
    pool = env["make"](4 * MiB)
    first = pool.request(b"a", _req(rank=0, nbytes=3 * MiB))
    assert first is not None and first.size == 4 * MiB  # rounded up to the 2 MiB alignment
    assert pool.request(b"b", _req(rank=1, nbytes=3 * MiB)) is None  # over budget: deferred
    assert len(pool.deferred) == 1 and env["grants"] == []
    pool.free(first)
    ((ident, msg, granted),) = env["grants"]
    assert ident == b"b" and msg["rank"] == 1 and granted is first and granted.state is SlotState.LEASED
    assert pool.deferred == []


def test_prepare_never_drops_a_memory_only_step_to_warm_a_slot(env: dict[str, Any]) -> None:
    """A trainer restarted on the node calls prepare() (allocs that do not wait, ``warm``) before restore():
    with the pool full of the job's memory-only steps, prepare() must be refused, not drop the newest step to
    warm a slot (the restore would then read an older step). A snapshot may still make room so."""
    asked: list[tuple[str, int | None]] = []
    pool = env["make"](2 * MiB)
    pool.reclaim = lambda job, step: asked.append((job, step)) or False
    assert pool.lease(_req(rank=0)) is not None  # the pool is full (a memory-only step's slot, say)
    with pytest.raises(CheckpointError, match="no room"):
        pool.request(b"p", {**_req(rank=1, step=0), "wait": False, "warm": True})
    assert asked == [] and pool.deferred == []
    assert pool.request(b"s", _req(rank=1, step=6)) is None  # a snapshot: asks for room, then waits
    assert asked == [("j", 6)] and len(pool.deferred) == 1


def test_with_a_group_another_jobs_free_segment_is_retired_not_leased(env: dict[str, Any]) -> None:
    """``--group``: job A's processes may keep a writable mapping of a segment A used, which no mode or name
    change takes back; leased to job B, A could rewrite B's committed shard. Such a segment is retired and B
    gets a new one; A's own rank gets its segment back, writable again (read-only to the group once committed)."""
    os.makedirs(env["root"] + "/g")
    segments = shm.SegmentDir(env["root"] + "/g", file_mode=0o660, gid=os.getgid())
    pool = SlotPool(segments, 2 * MiB, on_grant=lambda i, m, r: None, clock=env["clock"])
    a = pool.lease(_req(job="A"))
    assert a is not None
    pool.commit(a, _record(job="A"))
    assert os.stat(shm.path_of(a.name)).st_mode & 0o777 == 0o640
    pool.persisted(a, ("A", 1, 0))
    again = pool.lease(_req(job="A", step=2))
    assert again is a and os.stat(shm.path_of(a.name)).st_mode & 0o777 == 0o660
    pool.free(a)
    b = pool.lease(_req(job="B"))
    try:
        assert b is not None and b.name != a.name and not os.path.exists(shm.path_of(a.name))
    finally:
        shm.purge(env["root"] + "/g")


def test_a_request_larger_than_the_budget_is_refused(env: dict[str, Any]) -> None:
    pool = env["make"](4 * MiB)
    with pytest.raises(ProtocolError, match="exceeds the shared-memory budget"):
        pool.request(b"x", _req(nbytes=5 * MiB))
    assert pool.deferred == []


def test_new_segments_evict_free_slots_least_recently_used_first(env: dict[str, Any]) -> None:
    pool = env["make"](6 * MiB)
    slots = [pool.lease(_req(rank=r, nbytes=2 * MiB)) for r in range(3)]
    for s in slots:
        env["clock"].now += 1
        assert s is not None
        pool.free(s)  # freed in order: slot 0 is the least recently used
    big = pool.lease(_req(rank=9, nbytes=4 * MiB))
    assert big is not None
    names = {s.name for s in pool}
    assert slots[0].name not in names and slots[1].name not in names and slots[2].name in names
    assert not os.path.exists(shm.path_of(slots[0].name))
    assert pool.bytes_held() <= pool.budget


def test_a_full_budget_reuses_the_smallest_free_slot_of_another_rank(env: dict[str, Any]) -> None:
    pool = env["make"](6 * MiB)
    small, large = pool.lease(_req(rank=0, nbytes=2 * MiB)), pool.lease(_req(rank=1, nbytes=4 * MiB))
    assert small is not None and large is not None
    pool.free(small)
    pool.free(large)
    assert pool.lease(_req(rank=5, nbytes=MiB)) is small


def test_committed_and_pinned_slots_are_never_leased(env: dict[str, Any]) -> None:
    pool = env["make"](4 * MiB)
    a = pool.lease(_req(rank=0, nbytes=2 * MiB))
    b = pool.lease(_req(rank=1, nbytes=2 * MiB))
    assert a is not None and b is not None
    pool.commit(a, _record())
    pool.persisted(b, ("j", 1, 1))
    pin = pool.holdings.pin([b], pid=os.getpid())
    assert pool.lease(_req(rank=2, nbytes=2 * MiB)) is None  # nothing free to reuse or evict
    pool.holdings.unpin([b.name], "0" * 32)  # another reader's token: the pin stays
    assert pool.lease(_req(rank=2, nbytes=2 * MiB)) is None
    pool.holdings.unpin([b.name, 3, None], pin)  # names that are not segments are ignored
    assert pool.lease(_req(rank=2, nbytes=2 * MiB)) is b


def test_held_names_the_free_slots_of_one_step(env: dict[str, Any]) -> None:
    pool = env["make"](8 * MiB)
    slots = [pool.lease(_req(rank=r)) for r in range(3)]
    for r, s in enumerate(slots):
        assert s is not None
        pool.persisted(s, ("j", 5, r) if r < 2 else ("j", 4, r))
    assert {r: s.name for r, s in pool.holdings.of("j", 5).items()} == {0: slots[0].name, 1: slots[1].name}
    assert pool.holdings.steps() == {("j", 5), ("j", 4)}
    pool.lease(_req(rank=0, step=6))  # leasing a slot forgets the shard it held
    assert set(pool.holdings.of("j", 5)) == {1}


def test_persisted_sets_what_the_slot_holds_before_a_waiting_request_takes_it(env: dict[str, Any]) -> None:
    pool = env["make"](2 * MiB)
    a = pool.request(b"a", _req(rank=0))
    assert a is not None
    pool.commit(a, _record())
    assert pool.request(b"b", _req(rank=1)) is None
    pool.persisted(a, ("j", 1, 0))
    assert env["grants"][0][2] is a and a.state is SlotState.LEASED
    assert a.holds is None and pool.holdings.of("j", 1) == {}  # its bytes are being overwritten: no hot restore reads it


def test_a_pin_lapses_even_if_its_pid_lives(env: dict[str, Any]) -> None:
    """A live process that never calls hot_close (or a made-up pid that happens to exist) cannot hold a
    slot forever: the pin lapses after HOT_PIN_MAX_S."""
    pool = env["make"](2 * MiB)
    slot = pool.lease(_req())
    assert slot is not None
    pool.persisted(slot, ("j", 1, 0))
    pool.holdings.pin([slot], pid=1)  # pid 1 lives
    env["clock"].now += HOT_PIN_MAX_S / 2
    pool.holdings.pin([slot], pid=os.getpid())
    env["clock"].now += HOT_PIN_MAX_S / 2 + 1
    pool.reap(env["clock"].now)
    assert [pid for pid, _, _ in slot.pins.values()] == [os.getpid()]  # pid 1's pin is past its deadline
    env["dead"].add(os.getpid())
    pool.reap(env["clock"].now)
    assert slot.pins == {}  # a reader that died


def test_a_reader_that_opens_and_never_closes_cannot_pile_up_pins(env: dict[str, Any]) -> None:
    """The attack: hot_open in a loop without hot_close. Each pin lived 10 minutes and was checked on the loop
    every housekeeping pass: 166,882 pins in 40 s kept the idle daemon at 13 % of a core, and growing. A
    process now holds at most MAX_PINS_PER_READER on a slot; another process's restores are unaffected."""
    from ckptd.config import MAX_PINS_PER_READER

    pool = env["make"](2 * MiB)
    slot = pool.lease(_req())
    assert slot is not None
    tokens = [pool.holdings.pin([slot], 4242) for _ in range(MAX_PINS_PER_READER)]
    with pytest.raises(CheckpointError, match="already holds 16 open hot restores"):
        pool.holdings.pin([slot], 4242)
    assert len(slot.pins) == MAX_PINS_PER_READER
    pool.holdings.pin([slot], 4343)  # another reader
    pool.holdings.unpin([slot.name], tokens[0], 4242)
    pool.holdings.pin([slot], 4242)  # one closed: one more may open


def test_a_lapsed_pin_grants_a_waiting_request(env: dict[str, Any]) -> None:
    pool = env["make"](2 * MiB)
    slot = pool.lease(_req())
    assert slot is not None
    pool.persisted(slot, ("j", 1, 0))
    pool.holdings.pin([slot], pid=424242)
    assert pool.request(b"w", _req(rank=1)) is None
    env["dead"].add(424242)
    pool.reap(env["clock"].now)
    assert [g[0] for g in env["grants"]] == [b"w"]


def test_reaping_frees_dead_lessees_and_drops_their_deferred_requests(env: dict[str, Any]) -> None:
    pool = env["make"](2 * MiB)
    slot = pool.lease(_req(pid=31337))
    assert slot is not None
    assert pool.request(b"x", _req(rank=1, pid=31338)) is None
    env["dead"].update({31337, 31338})
    pool.reap(env["clock"].now)
    assert slot.state is SlotState.FREE and pool.deferred == [] and env["grants"] == []


def test_a_failed_segment_creation_is_refused_to_the_waiting_request(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    pool = env["make"](4 * MiB)
    first = pool.lease(_req(rank=0, nbytes=3 * MiB))
    assert first is not None
    assert pool.request(b"w", _req(rank=1, nbytes=2 * MiB)) is None
    pool.commit(first, _record())

    def full(size: int) -> tuple[str, int]:
        raise CheckpointError("cannot allocate: /dev/shm is full")

    monkeypatch.setattr(pool.segments, "create", full)
    pool.unlink(first)  # memory back, but creating the segment fails
    pool.retry_deferred()
    ((ident, _, result),) = env["grants"]
    assert ident == b"w" and isinstance(result, CheckpointError) and "full" in str(result)


def test_close_keeps_only_committed_segments(env: dict[str, Any]) -> None:
    pool = env["make"](8 * MiB)
    kept, leased, free = (pool.lease(_req(rank=r)) for r in range(3))
    assert kept is not None and leased is not None and free is not None
    pool.commit(kept, _record())
    pool.free(free)
    pool.close()
    assert shm.segments_of(env["root"]) == [kept.name]  # a restart persists it


def test_a_lease_is_bound_to_its_token(env: dict[str, Any]) -> None:
    """Another client naming the segment (it can guess or see names in status) cannot commit or release it."""
    pool = env["make"](4 * MiB)
    slot = pool.lease(_req())
    assert slot is not None and slot.token is not None
    for token in ("0" * 32, slot.token[::-1]):
        with pytest.raises(ProtocolError, match="not leased to this client"):
            pool.leased(slot.name, token)
    assert pool.leased(slot.name, slot.token) is slot
    pool.free(slot)
    again = pool.lease(_req())
    assert again is slot and again.token is not None and pool.leased(again.name, again.token) is slot
    with pytest.raises(ProtocolError):
        pool.leased(slot.name, "0" * 32)


@pytest.mark.parametrize("pid", [1, "other namespace"])
def test_a_lease_whose_pid_never_dies_lapses(env: dict[str, Any], pid: Any) -> None:
    """pid 1 (always alive) or a pid in another PID namespace (some unrelated live process here) would
    hold the slot forever: the lease timeout takes its memory back for a waiting request. Its holder may
    still be alive and write through its mapping (a stalled trainer resuming), so the segment is retired,
    never leased again: the request gets a new one, which the late writes cannot reach."""
    pool = env["make"](2 * MiB)
    slot = pool.lease(_req(pid=1 if pid == 1 else os.getppid()))
    assert slot is not None
    assert pool.request(b"w", _req(rank=1)) is None
    env["clock"].now += 99
    pool.reap(env["clock"].now)
    assert slot.state is SlotState.LEASED and env["grants"] == []
    env["clock"].now += 2
    pool.reap(env["clock"].now)
    ((ident, _, granted),) = env["grants"]
    assert ident == b"w" and granted.name != slot.name and granted.owner == ("j", 1)
    assert pool.get(slot.name) is None and not os.path.exists(shm.path_of(slot.name))


def test_deferred_allocations_are_bounded(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.daemon import slots as slots_mod

    monkeypatch.setattr(slots_mod, "MAX_DEFERRED_ALLOCS", 3)
    pool = env["make"](2 * MiB)
    assert pool.lease(_req()) is not None
    for i in range(3):
        assert pool.request(b"%d" % i, _req(rank=1 + i)) is None
    with pytest.raises(CheckpointError, match="already wait"):
        pool.request(b"x", _req(rank=9))
    assert len(pool.deferred) == 3


def test_a_pid_that_is_no_pid_reads_as_dead() -> None:
    from ckptd.daemon.slot import is_running, pid_alive, started

    assert pid_alive(os.getpid()) and not pid_alive(2**64) and not pid_alive(-5)
    born = started(os.getpid())
    assert born is not None and is_running(os.getpid(), born) and is_running(os.getpid(), None)
    assert not is_running(os.getpid(), born - 60)  # the pid now names a process that started later: another one


def test_a_step_of_the_wall_clock_does_not_make_live_processes_look_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NTP step (or a VM resumed) moves the boot time psutil adds to a process's start: with psutil's create_time
    as the identity, every live trainer's lease and every reader's pin would be dropped at the next reap. Found by a
    review of the pid-and-start-time change."""
    import psutil._pslinux as linux

    from ckptd.daemon.slot import is_running, started

    born = started(os.getpid())
    real = linux.boot_time  # what psutil re-reads from /proc/stat's btime, derived from the wall clock
    monkeypatch.setattr(linux, "boot_time", lambda: real() + 1.0)
    assert is_running(os.getpid(), born) and started(os.getpid()) == born


def test_a_dead_trainers_lease_is_freed_although_its_pid_was_reused_or_it_is_a_zombie(tmp_path: Path) -> None:
    """The trainer that leased a slot died and its pid now names another process (or the dead trainer is a
    zombie nobody reaped: the kernel still answers for its pid). With the pid alone the slot stayed leased
    until the lease timeout and its memory stayed out of the budget; the daemon records who asked by pid and
    start time, so the next reap frees it."""
    import subprocess
    import sys

    segments = shm.SegmentDir(str(tmp_path))
    pool = SlotPool(segments, 8 * MiB, lease_timeout=1e9)  # the real liveness check
    try:
        reused = pool.lease(_req(rank=0))  # this process, as if it had started after the lessee
        assert reused is not None and reused.born is not None
        reused.born -= 60
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        zombie = pool.request(b"z", _req(rank=1, pid=child.pid))
        assert zombie is not None and zombie.born is not None
        child.kill()
        while (child_status := open(f"/proc/{child.pid}/stat").read().split(") ")[1][0]) != "Z":
            pass  # killed, not reaped yet: a zombie
        alive = pool.lease(_req(rank=2))
        pool.reap(1.0)
        assert reused.state is SlotState.FREE and zombie.state is SlotState.FREE, child_status
        assert alive is not None and alive.state is SlotState.LEASED  # a living lessee keeps its lease
        child.wait()
    finally:
        shm.purge(str(tmp_path))


def test_a_lease_of_a_process_the_kernel_cannot_name_waits_for_the_timeout(env: dict[str, Any]) -> None:
    """An ipc peer outside the daemon's PID namespace has pid 0 in its credentials: unknown, never taken
    for some unrelated process here; only the lease timeout reclaims it."""
    pool = env["make"](2 * MiB)
    slot = pool.lease({**_req(), "pid": 0})
    assert slot is not None and slot.pid is None
    env["dead"].add(0)
    pool.reap(env["clock"].now + 50)
    assert slot.state is SlotState.LEASED
    pool.reap(env["clock"].now + 101)
    assert pool.get(slot.name) is None  # retired: its holder may still write to it


# ----------------------------------------------------------------------------- growth off the loop


def _growing_pool(env: dict[str, Any], budget: int) -> tuple[SlotPool, list[tuple[int, int]]]:
    asked: list[tuple[int, int]] = []
    grant = lambda i, m, r: env["grants"].append((i, m, r))  # noqa: E731
    segments = shm.SegmentDir(env["root"])
    return SlotPool(segments, budget, on_grant=grant, clock=env["clock"], grow=lambda need, token: asked.append((need, token))), asked


def test_a_new_segment_is_made_off_the_loop_and_goes_to_the_rank_that_needed_it(env: dict[str, Any]) -> None:
    A = shm.ALIGN
    pool, asked = _growing_pool(env, 8 * A)
    assert pool.request(b"r0", _req(rank=0, nbytes=3 * A)) is None  # deferred while the grower makes it
    assert pool.request(b"r1", _req(rank=1, nbytes=A)) is None
    assert [need for need, _ in asked] == [3 * A, A]
    assert pool.bytes_held() == 4 * A, "segments being made count in the budget"
    assert pool.request(b"r2", _req(rank=2, nbytes=5 * A)) is None and len(asked) == 2, "over budget: waits, asks for nothing"
    name, size = pool.segments.create(A)  # the grower's work, for rank 1 first
    pool.created(asked[1][1], name, size)
    assert [(i, r.name) for i, _, r in env["grants"]] == [(b"r1", name)]
    assert pool.get(name).owner == ("j", 1) and pool.get(name).state is SlotState.LEASED
    pool.created(asked[0][1], None, 3 * A, "No space left on device")
    assert env["grants"][1][0] == b"r0" and "No space left on device" in str(env["grants"][1][2])
    assert [ident for ident, _ in pool.deferred] == [b"r2"]
    assert len(asked) == 3 and asked[2][0] == 5 * A, "the refused request's budget went to the one waiting"
    assert pool.bytes_held() == 6 * A


def test_two_allocs_of_one_rank_at_once_are_both_granted_whichever_segment_comes_first(env: dict[str, Any]) -> None:
    # prepare() asks for its slots side by side: the segment made for the second request can come first and
    # go to the first request; the second must then take the first's segment when it comes (it waited forever)
    A = shm.ALIGN
    pool, asked = _growing_pool(env, 8 * A)
    assert pool.request(b"a", _req(rank=0, nbytes=A)) is None
    assert pool.request(b"b", _req(rank=0, nbytes=A)) is None
    for _, token in reversed(asked):
        pool.created(token, *pool.segments.create(A))
    granted = {ident: r.name for ident, _, r in env["grants"]}
    assert set(granted) == {b"a", b"b"} and len(set(granted.values())) == 2, env["grants"]
    assert not pool.deferred and pool.bytes_held() == 2 * A


def test_a_rank_waiting_for_its_segment_never_takes_the_slot_another_rank_just_prepared(env: dict[str, Any]) -> None:
    """Two ranks prepare() at once: rank 0's slots were made, mapped and given back while rank 1's were still being
    made, and rank 1's waiting request took rank 0's free slot ("any free slot"); rank 0's first snapshot then got
    rank 1's late segment and mapped it on its path (seen with FSDP1 on two ranks, about one run in four)."""
    A = shm.ALIGN
    pool, asked = _growing_pool(env, 8 * A)
    assert pool.request(b"a", _req(rank=0, nbytes=A)) is None
    pool.created(asked[0][1], *pool.segments.create(A))
    ((_, _, mine),) = env["grants"]
    assert pool.request(b"b", _req(rank=1, nbytes=A)) is None  # its segment is being made
    pool.free(mine)  # rank 0's prepare() gives its slot back, mapped by its trainer
    assert len(env["grants"]) == 1 and pool.get(mine.name).owner == ("j", 0) and pool.get(mine.name).state is SlotState.FREE
    pool.created(asked[1][1], *pool.segments.create(A))
    assert env["grants"][-1][0] == b"b" and env["grants"][-1][2].name != mine.name
    assert pool.request(b"a2", _req(rank=0, nbytes=A)).name == mine.name  # rank 0's next lease: its own, warm


def test_an_alloc_that_may_not_wait_is_refused_at_once_and_one_past_its_timeout_is_refused_not_granted_later(env: dict[str, Any]) -> None:
    # prepare() asks without waiting; a snapshot's alloc carries its client's timeout: a request the client gave
    # up on must not be granted later (the slot would be leased to nobody until the lease timeout)
    A = shm.ALIGN
    pool = env["make"](int(1.5 * A))
    held = pool.request(b"h", _req(rank=0, nbytes=A))
    assert held is not None
    with pytest.raises(CheckpointError, match=r"no room for a \d+-byte slot .*raise --shm-budget"):
        pool.request(b"p", {**_req(rank=1, nbytes=A), "wait": False})
    assert pool.deferred == []
    assert pool.request(b"s", {**_req(rank=1, nbytes=A), "timeout": 5.0}) is None  # deferred, for 5 s
    env["clock"].now += 4
    pool.reap(env["clock"]())
    assert [i for i, _ in pool.deferred] == [b"s"] and env["grants"] == []
    env["clock"].now += 2
    pool.reap(env["clock"]())
    assert pool.deferred == [] and [(i, "after waiting 5 s" in str(r)) for i, _, r in env["grants"]] == [(b"s", True)]
    pool.free(held)  # the memory frees up: nobody is granted a slot they no longer wait for
    assert len(env["grants"]) == 1 and pool.summary()["slots"] == {"free": 1}


def test_a_spare_being_made_never_costs_another_jobs_snapshot_its_memory_only_step(env: dict[str, Any]) -> None:
    # job "a" (its disk lagging) takes its last free slot and a spare is made for it; meanwhile job "b", whose
    # memory-tier step holds a slot, snapshots into a budget only the spare fills: "b" waits for the spare's
    # room instead of having its memory-only step dropped for a guess at a future need (seen in review)
    A = shm.ALIGN
    pool, asked = _growing_pool(env, 4 * A)
    reclaimed: list[tuple[str, Any]] = []
    pool.reclaim = lambda job, step: reclaimed.append((job, step)) or False
    pool.want_spare = lambda job: job == "a"
    for token, (job, rank) in ((1, ("a", 0)), (2, ("a", 0)), (3, ("b", 0))):
        pool.created(token, *pool.segments.create(A))
        slot = pool.slots[list(pool.slots)[-1]]
        slot.owner = (job, rank)
    a_prev, a_last, b_held = (pool.slots[n] for n in list(pool.slots))
    a_prev.state = SlotState.COMMITTED  # a's previous step is still being written
    b_held.state = SlotState.HELD  # b's newest step lives in memory only
    got = pool.request(b"a", _req(rank=0, nbytes=A, job="a", step=2))
    assert got is a_last and len(asked) == 1 and pool.spares, "a took its last free slot: a spare is made"
    assert pool.bytes_held() == 4 * A
    assert pool.request(b"b", _req(rank=0, nbytes=A, job="b", step=7)) is None  # waits...
    assert reclaimed == [] and b_held.state is SlotState.HELD  # ...and drops nothing
    with pytest.raises(CheckpointError, match="no room"):  # an early copy, which may not wait, is refused as before
        pool.request(b"e", {**_req(rank=1, nbytes=A, job="b", step=7), "wait": False})
    name, size = pool.segments.create(A)
    pool.created(asked[0][1], name, size)  # the spare lands: it goes to the snapshot that waits
    assert [(i, r.name) for i, _, r in env["grants"]] == [(b"b", name)] and pool.get(name).owner == ("b", 0)
    assert pool.bytes_held() == 4 * A and not pool.deferred


def test_the_grower_answers_every_request_after_shutdown_or_out_of_memory(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # a request retried by the shutdown's last drain asked a stopped thread pool (RuntimeError: the other waiting
    # requests were dropped unanswered); a MemoryError while zero-filling posted nothing (its token held for good)
    import zmq

    from ckptd.daemon.events import EventQueue, SlotCreated
    from ckptd.daemon.growth import Grower

    ctx = zmq.Context()
    events = EventQueue(ctx)
    segments = shm.SegmentDir(env["root"])
    grower = Grower(segments, events)
    try:

        def no_memory(need: int) -> tuple[str, int]:
            raise MemoryError

        monkeypatch.setattr(segments, "create", no_memory)
        grower.submit(shm.ALIGN, 11)
        grower.shutdown()
        grower.submit(shm.ALIGN, 12)
        got = {ev.token: ev for ev in events.drain() if isinstance(ev, SlotCreated)}
        assert got.keys() == {11, 12} and got[11].name is None and got[11].error == "MemoryError"
        assert got[12].name is None and "shutting down" in got[12].error
    finally:
        events.close()
        ctx.term()


def _lagging_rank(env: dict[str, Any], budget: int) -> tuple[SlotPool, list[tuple[int, int]], Any]:
    """A pool where rank 0 of job "a" just took its last free slot while its previous step is being written:
    a spare is being made for it (``asked[0]``). Returns the pool, the grower's requests and the leased slot."""
    A = shm.ALIGN
    pool, asked = _growing_pool(env, budget)
    pool.want_spare = lambda job: job == "a"
    for token in (1, 2):
        pool.created(token, *pool.segments.create(A))
        pool.slots[list(pool.slots)[-1]].owner = ("a", 0)
    prev, last = pool.slots.values()
    prev.state = SlotState.COMMITTED
    leased = pool.request(b"a", _req(rank=0, nbytes=A, job="a", step=2))
    assert leased is last and len(asked) == 1
    return pool, asked, leased


def _warm(rank: int = 0, job: str = "a") -> dict[str, Any]:
    return {**_req(rank=rank, nbytes=shm.ALIGN, job=job, step=0), "warm": True, "wait": False, "spare": True, "timeout": 15.0}


def test_a_trainer_warming_its_spare_waits_while_it_is_made_and_no_one_else_gets_it(env: dict[str, Any]) -> None:
    pool, asked, _ = _lagging_rank(env, 4 * shm.ALIGN)
    assert pool.spare_coming(("a", 0), shm.ALIGN) and not pool.spare_coming(("a", 1), shm.ALIGN)
    assert not pool.spare_coming(("a", 0), 2 * shm.ALIGN)  # too small for the shard: not announced
    with pytest.raises(CheckpointError, match="no spare slot is being made for rank 1 of job a"):
        pool.request(b"x", _warm(rank=1))  # another rank's spare is not this one's to take
    with pytest.raises(CheckpointError, match="no spare slot is being made for rank 0 of job b"):
        pool.request(b"y", _warm(job="b"))
    assert pool.request(b"w", _warm()) is None and pool.allocs_waited == 0  # deferred until made; not a snapshot's wait
    name, size = pool.segments.create(shm.ALIGN)
    pool.created(asked[0][1], name, size)
    assert [(i, r.name) for i, _, r in env["grants"]] == [(b"w", name)]
    spare = pool.get(name)
    assert spare.state is SlotState.LEASED and spare.spare  # a spare still while its trainer maps it
    assert not pool.spare_coming(("a", 0), shm.ALIGN)
    pool.free(spare)  # the trainer mapped it and gave it back: its rank's, an ordinary free slot now
    assert spare.owner == ("a", 0) and not spare.spare and not pool.spare_coming(("a", 0), shm.ALIGN)
    with pytest.raises(CheckpointError, match="no spare slot is being made"):
        pool.request(b"w2", _warm())


def test_a_spare_goes_to_a_waiting_snapshot_before_the_trainer_warming_it(env: dict[str, Any]) -> None:
    A = shm.ALIGN
    pool, asked, _ = _lagging_rank(env, 3 * A)
    assert pool.request(b"w", _warm()) is None  # the trainer asks for its spare first...
    assert pool.request(b"b", _req(rank=0, nbytes=A, job="b", step=7)) is None  # ...then a snapshot waits for memory
    with pytest.raises(CheckpointError, match="left to a snapshot that waits"):
        pool.request(b"w2", _warm())
    name, size = pool.segments.create(A)
    pool.created(asked[0][1], name, size)
    got = {i: r for i, _, r in env["grants"]}
    assert got[b"b"].name == name and isinstance(got[b"w"], CheckpointError), env["grants"]
    assert not pool.deferred


def _spare_and_snapshot_wait(env: dict[str, Any], snapshot_first: bool = False) -> tuple[SlotPool, Any, str]:
    """The lagging rank's trainer waits to map its spare ahead and the rank's next snapshot finds no free slot (in
    either order); then the spare lands. Returns the pool, the slot being persisted and the spare's name."""
    A = shm.ALIGN
    pool, asked, _ = _lagging_rank(env, 3 * A)
    persisting = next(s for s in pool if s.state is SlotState.COMMITTED)
    requests = [(b"s3", _req(rank=0, nbytes=A, job="a", step=3)), (b"w", _warm())]
    for ident, msg in requests if snapshot_first else requests[::-1]:
        assert pool.request(ident, msg) is None
    name, size = pool.segments.create(A)
    pool.created(asked[0][1], name, size)
    return pool, persisting, name


def _granted(env: dict[str, Any]) -> list[tuple[bytes, str]]:
    return [(i, r.name if not isinstance(r, Exception) else str(r)) for i, _, r in env["grants"]]


@pytest.mark.parametrize("snapshot_first", [False, True])
def test_a_snapshot_never_takes_its_ranks_spare_unmapped_while_its_trainer_waits_to_map_it(
    env: dict[str, Any], snapshot_first: bool
) -> None:
    # seen on one H100 (--lagging wait, 6 GB): the snapshot took the spare the moment it was made and mapped and
    # page-locked it on its path, 2.5 s, although its own slot was persisted 0.9 s after it asked. Now the spare goes
    # to the trainer mapping it ahead, and the snapshot gets whichever is free first: here its slot being persisted
    pool, persisting, spare = _spare_and_snapshot_wait(env, snapshot_first)
    assert _granted(env) == [(b"w", spare)], "the spare must go to the trainer that maps it ahead"
    pool.persisted(persisting, ("a", 1, 0))
    assert _granted(env)[1:] == [(b"s3", persisting.name)]  # its own slot, mapped (and page-locked) long ago
    pool.free(pool.leased(spare, pool.get(spare).token))  # mapped: an ordinary free slot of the rank for its next one
    assert pool.get(spare).state is SlotState.FREE and pool.get(spare).owner == ("a", 0) and not pool.deferred


def test_a_snapshot_waiting_on_a_slow_disk_gets_its_ranks_spare_once_mapped_ahead(env: dict[str, Any]) -> None:
    pool, persisting, spare = _spare_and_snapshot_wait(env)
    pool.free(pool.leased(spare, pool.get(spare).token))  # mapped before step 1 is on disk
    assert _granted(env) == [(b"w", spare), (b"s3", spare)]
    pool.persisted(persisting, ("a", 1, 0))
    assert pool.get(persisting.name).state is SlotState.FREE and not pool.deferred


def test_a_snapshot_gets_its_ranks_spare_when_the_trainer_mapping_it_gives_up(env: dict[str, Any]) -> None:
    A = shm.ALIGN
    pool, asked, _ = _lagging_rank(env, 3 * A)
    assert pool.request(b"w", _warm()) is None and pool.request(b"s3", _req(rank=0, nbytes=A, job="a", step=3)) is None
    env["clock"].now += 16  # the warming's own timeout (15 s) passes before the spare is made
    pool.reap(env["clock"]())
    name, size = pool.segments.create(A)
    pool.created(asked[0][1], name, size)
    assert [i for i, _ in _granted(env)] == [b"w", b"s3"] and _granted(env)[1] == (b"s3", name) and not pool.deferred


def test_a_snapshot_gets_its_ranks_spare_when_the_trainer_mapping_it_dies(env: dict[str, Any]) -> None:
    pool, _, spare = _spare_and_snapshot_wait(env)
    pool.get(spare).pid = 4242  # the process that leased it to map it ahead is gone
    pool._alive = lambda pid, born: pid != 4242
    pool.reap(env["clock"]())
    assert _granted(env) == [(b"w", spare), (b"s3", spare)] and pool.get(spare).lease["step"] == 3 and not pool.deferred


def test_two_lagging_ranks_each_get_their_own_spare_mapped_ahead_never_each_others(env: dict[str, Any]) -> None:
    # seen in review: with two ranks lagging (a node of several GPUs), rank 1's snapshot took rank 0's spare the
    # moment it landed ("any free slot" over budget), both warmings were refused, and both snapshots mapped a new
    # segment on their path
    A = shm.ALIGN
    pool, asked = _growing_pool(env, 6 * A)
    pool.want_spare = lambda job: True
    for token in (1, 2, 3, 4):
        pool.created(token, *pool.segments.create(A))
        pool.slots[list(pool.slots)[-1]].owner = ("a", (token - 1) // 2)
    for rank in (0, 1):
        prev = next(s for s in pool if s.owner == ("a", rank))
        prev.state = SlotState.COMMITTED  # the rank's previous step is still being written
        assert pool.request(b"a%d" % rank, _req(rank=rank, nbytes=A, job="a", step=2)) is not None
    assert len(asked) == 2 and sorted(pool.spares.values()) == [("a", 0), ("a", 1)]
    for rank in (0, 1):
        assert pool.request(b"w%d" % rank, _warm(rank=rank)) is None
    for rank in (0, 1):
        assert pool.request(b"s%d" % rank, _req(rank=rank, nbytes=A, job="a", step=3)) is None
    spares = {}
    for (_, token), rank in zip(asked, (0, 1), strict=True):
        spares[rank], size = pool.segments.create(A)
        pool.created(token, spares[rank], size)
    assert _granted(env) == [(b"w0", spares[0]), (b"w1", spares[1])], "each warming must get its own rank's spare"
    for rank in (0, 1):
        pool.free(pool.leased(spares[rank], pool.get(spares[rank]).token))  # mapped ahead, given back
    assert _granted(env)[2:] == [(b"s0", spares[0]), (b"s1", spares[1])] and not pool.deferred


def test_a_request_that_evicting_every_free_slot_cannot_serve_evicts_none(env: dict[str, Any]) -> None:
    # seen in review: _create unlinked free slots one by one and then found the room still short, so a rank lost
    # the warm slot it would have reused next, for nothing
    A = shm.ALIGN
    pool, asked = _growing_pool(env, 3 * A)
    for token in (1, 2):
        pool.created(token, *pool.segments.create(A))
    kept, busy = pool.slots.values()
    kept.owner, busy.owner, busy.state = ("a", 0), ("a", 1), SlotState.COMMITTED
    assert pool.request(b"big", _req(rank=0, nbytes=3 * A, job="b", step=1)) is None  # 3A needs the committed slot's room too
    assert pool.get(kept.name) is kept and kept.state is SlotState.FREE and asked == []
    assert pool.request(b"a0", _req(rank=0, nbytes=A, job="a", step=2)) is kept


def test_a_trainer_warming_a_spare_that_takes_too_long_is_refused_not_granted_later(env: dict[str, Any]) -> None:
    # its client gives up after its own timeout: a grant after that would lease the spare to nobody
    pool, asked, _ = _lagging_rank(env, 4 * shm.ALIGN)
    assert pool.request(b"w", _warm()) is None
    env["clock"].now += 16
    pool.reap(env["clock"]())
    assert [(i, "after waiting 15 s" in str(r)) for i, _, r in env["grants"]] == [(b"w", True)] and not pool.deferred
    pool.created(asked[0][1], *pool.segments.create(shm.ALIGN))  # made later: a free spare of its rank, leased to no one
    assert len(env["grants"]) == 1 and pool.summary()["slots"] == {"committed": 1, "leased": 1, "free": 1}


def test_a_snapshot_short_of_memory_while_a_trainer_maps_its_spare_waits_for_it_and_drops_nothing(env: dict[str, Any]) -> None:
    # the spare landed and its trainer leased it to map it ahead (0.9 s for 6 GB): a snapshot of another job that
    # needs the room waits for its release, as it waits for a spare being made, instead of dropping a memory-only step
    A = shm.ALIGN
    pool, asked, _ = _lagging_rank(env, 3 * A)
    reclaimed: list[Any] = []
    pool.reclaim = lambda job, step: reclaimed.append(job) or False
    assert pool.request(b"w", _warm()) is None
    name, size = pool.segments.create(A)
    pool.created(asked[0][1], name, size)
    assert [i for i, _, _ in env["grants"]] == [b"w"]
    assert pool.request(b"b", _req(rank=0, nbytes=A, job="b", step=7)) is None and reclaimed == []
    pool.free(pool.leased(name, pool.get(name).token))  # the trainer mapped it and gives it back
    assert [(i, r.name) for i, _, r in env["grants"]][1:] == [(b"b", name)] and not pool.deferred


def test_no_spare_is_started_while_a_snapshot_waits_for_memory(env: dict[str, Any]) -> None:
    A = shm.ALIGN
    pool, asked = _growing_pool(env, 3 * A)
    pool.want_spare = lambda job: True
    for token, owner in ((1, ("a", 0)), (2, ("a", 0))):
        pool.created(token, *pool.segments.create(A))
        pool.slots[list(pool.slots)[-1]].owner = owner
    prev, last = pool.slots.values()
    prev.state = SlotState.COMMITTED
    pool.deferred.append((b"b", _req(rank=0, nbytes=2 * A, job="b", step=7)))  # waits for more than is free
    assert pool.request(b"a", _req(rank=0, nbytes=A, job="a", step=2)) is last
    assert asked == [] and not pool.spares, "a spare started while a snapshot waits for the room"


def test_a_spares_warming_that_ends_after_its_client_closed_keeps_no_mapping(env: dict[str, Any]) -> None:
    # the warmer thread can outlive close()'s wait (the daemon slow to make the spare): what it maps then is
    # dropped at once, never left in a closed client's table (pinned, for a GPU, forever)
    from ckptd.client.copy import SlotMaps

    name, _ = shm.SegmentDir(env["root"]).create(shm.ALIGN)
    maps = SlotMaps()
    maps.warm([name], pin=False)
    assert maps.names() == {name} and maps.made_on_path == 0  # mapped ahead, not on a snapshot's path
    maps.close()
    maps.warm([name], pin=False)
    assert maps.names() == set()
