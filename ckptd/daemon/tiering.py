"""The tiering policy: which snapshots go to disk, and which stay in the memory tier only.

Every committed snapshot lands in the daemon's shared memory (the memory tier) and can be restored on
this node from there. Going further, to local disk (and from there to the bucket), costs disk
bandwidth and, on a busy node, CPU the trainer wants; so a job can checkpoint every step in memory and
persist only some of them:

* ``persist_every`` N — one snapshot in N is persisted (1: every one);
* ``persist_interval`` T — also the first snapshot T seconds or more after the last persisted one
  (0: no time rule);
* ``lagging`` — what a snapshot that is due for disk does while the job's previous persisted step is
  still being written: ``"wait"`` (the default) queues it for disk all the same (every due step
  reaches disk; when shared memory runs out, the next snapshot waits for the disk: backpressure);
  ``"memory"`` keeps it in memory and persists the job's newest step as soon as the disk is free (the
  snapshot rate is never bound to the disk's; a snapshot the disk could not take is dropped once a
  newer one is complete).

The defaults (N = 1, T = 0, ``"wait"``) persist every snapshot, as a user who did not ask for a memory
tier expects.

The first snapshot of a job this daemon sees is always persisted, and so is a step of a multi-node job
(its nodes complete it through the bucket). A memory-only step is persisted later when someone needs it
durable: a ``wait`` for it, a restore that may not read shared memory, the end of the run that made
it (every process that committed it is gone), or the daemon's shutdown (:mod:`.memtier`).

The daemon's configuration sets the defaults; a job's commits may set its own N and T (the client's
``persist_every`` / ``persist_interval``). Main thread only (the daemon's loop); no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

LAGGING = ("memory", "wait")


class Tier(StrEnum):
    DISK = "disk"  # persisted to local disk (and, with a bucket, uploaded)
    MEMORY = "memory"  # held in shared memory only


@dataclass(frozen=True)
class TierPolicy:
    persist_every: int = 1
    persist_interval: float = 0.0
    lagging: str = "wait"

    def __post_init__(self) -> None:
        if not isinstance(self.persist_every, int) or self.persist_every < 1:
            raise ValueError(f"persist_every must be an integer >= 1, got {self.persist_every!r}")
        if not self.persist_interval >= 0:
            raise ValueError(f"persist_interval must be >= 0 seconds, got {self.persist_interval!r}")
        if self.lagging not in LAGGING:
            raise ValueError(f"lagging must be one of {LAGGING}, got {self.lagging!r}")


@dataclass
class _JobTier:
    since: int = 0  # snapshots since the last one persisted
    last: float | None = None  # when the last persisted one was decided
    owed: bool = False  # a snapshot was due while the disk was busy: the newest goes once it is free
    every: int | None = None  # the job's own N and T, from its commits
    interval: float | None = None


class Tiering:
    def __init__(self, policy: TierPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self._clock = policy, clock
        self._jobs: dict[str, _JobTier] = {}

    def set_job(self, job: str, every: int | None, interval: float | None) -> None:
        """The job's own settings, as its latest commit gave them (``None``: the daemon's)."""
        st = self._jobs.setdefault(job, _JobTier())
        st.every, st.interval = every, interval

    def policy_of(self, job: str) -> TierPolicy:
        st = self._jobs.get(job) or _JobTier()
        p = self.policy
        return TierPolicy(st.every or p.persist_every, p.persist_interval if st.interval is None else st.interval, p.lagging)

    def decide(self, job: str, *, disk_busy: bool, multi_node: bool = False) -> Tier:
        """The tier of a new step of ``job`` (called once, when its first rank commits). ``disk_busy``:
        a persisted step of the job is still being written."""
        st = self._jobs.setdefault(job, _JobTier())
        p = self.policy_of(job)
        now = self._clock()
        st.since += 1
        due = (
            multi_node
            or st.last is None
            or st.owed
            or st.since >= p.persist_every
            or (p.persist_interval > 0 and now - st.last >= p.persist_interval)
        )
        if not due:
            return Tier.MEMORY
        if disk_busy and not multi_node and p.lagging == "memory":
            st.owed = True
            return Tier.MEMORY
        self.persisted(job)
        return Tier.DISK

    def persists_across(self, job: str, step: int) -> bool:
        """Whether step ``step`` of a job that spans nodes, kept in its daemons' memory, goes through the bucket instead:
        a number that is a multiple of the job's N (every node decides alike, from the number alone; N of 1: every step,
        and ``persist_interval`` does not apply: the nodes' clocks would decide differently)."""
        every = self.policy_of(job).persist_every
        return every <= 1 or step % every == 0

    def owed(self, job: str) -> bool:
        """A step of ``job`` was due for disk while it was busy: persist the newest once it is free."""
        st = self._jobs.get(job)
        return st is not None and st.owed

    def persisted(self, job: str) -> None:
        """A step of ``job`` goes to disk now (decided so, or promoted from memory): the count restarts."""
        st = self._jobs.setdefault(job, _JobTier())
        st.since, st.last, st.owed = 0, self._clock(), False
