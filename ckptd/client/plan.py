"""Who writes which chunk: replicated chunks (DDP parameters, replicated experts, scalars) are
written once, by one of their holders, with the bytes spread evenly over holders.

Runs on the trainer's main thread inside ``snapshot()`` and ``prepare()`` (foreground: collectives
are safe there, never from the background copy). Each call costs one ``all_gather`` of a layout hash
and the step; the full exchange of chunk lists runs only at the first snapshot and whenever some
rank's layout changed. The assignment is a pure function of every rank's chunk list, so all ranks
agree without a further round.

Two user mistakes are caught here, before anything is copied: ranks that pass different steps (every
rank raises the same :class:`CheckpointError`), and a call on some ranks only (``if rank == 0:
snapshot(...)``), which would hang in the collective until the process group's timeout aborts it:
before the collective every rank checks in at the process group's store and waits at most
``CKPTD_COLLECTIVE_TIMEOUT`` seconds (1800, as long as gloo's default; a warning each minute says how
many ranks arrived) for the others.
"""

from __future__ import annotations

import json
import logging
import secrets
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from ..config import COLLECTIVE_TIMEOUT_S, env_float
from ..errors import CheckpointError

log = logging.getLogger("ckptd.client")
WARN_EVERY_S = 60.0  # while ranks are missing at a collective of ckptd's

ChunkId = tuple[str, tuple[int, ...], tuple[int, ...]]  # key, offsets, sizes


def collective_device() -> torch.device:
    """The device a collective over the default group takes its tensors on: the current GPU under NCCL, else the CPU."""
    backend = str(dist.get_backend())
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def assign(per_rank: list[list[tuple[ChunkId, int]]], lowest: set[ChunkId] | frozenset[ChunkId] = frozenset()) -> list[set[ChunkId]]:
    """Given each rank's ``(chunk id, nbytes)`` list, the set of chunk ids each rank writes.

    Each distinct chunk goes to the holder with the fewest bytes assigned so far (ties: lowest
    rank), largest chunks first; a chunk in ``lowest`` (a buffer, whose holders' bytes may differ) to its
    lowest-rank holder: rank 0's under DDP, the copy its next forward broadcasts.
    """
    holders: dict[ChunkId, list[int]] = {}
    size: dict[ChunkId, int] = {}
    for r, items in enumerate(per_rank):
        for cid, nbytes in items:
            holders.setdefault(cid, []).append(r)
            size[cid] = nbytes
    load = [0] * len(per_rank)
    out: list[set[ChunkId]] = [set() for _ in per_rank]
    for cid in sorted(holders, key=lambda c: (-size[c], c)):
        r = holders[cid][0] if cid in lowest else min(holders[cid], key=lambda h: (load[h], h))
        load[r] += size[cid]
        out[r].add(cid)
    return out


class Arrivals:
    """Every rank checks in at the default group's store before a collective of ckptd's; a rank that
    waits longer than ``timeout`` for the others raises instead of hanging in the collective."""

    def __init__(self, scope: str) -> None:
        self.scope = scope  # the job: clients of two jobs in one process count separately
        self.seq = 0

    def check(self, what: str) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return  # no store to check in at (another torch): the collective is all there is
        world, self.seq = dist.get_world_size(), self.seq + 1
        key = f"ckptd/{self.scope}/arrive/{self.seq}"
        if store.add(key, 1) == world:
            store.set(key + "/all", b"1")
        else:
            self._wait(store, key, world, what, env_float("CKPTD_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT_S), dist.get_rank())
        if dist.get_rank() == 0 and self.seq > 1:  # every rank is past the previous check: its keys are done
            for k in (f"ckptd/{self.scope}/arrive/{self.seq - 1}", f"ckptd/{self.scope}/arrive/{self.seq - 1}/all"):
                try:
                    store.delete_key(k)
                except (RuntimeError, NotImplementedError):
                    pass

    @staticmethod
    def _wait(store: Any, key: str, world: int, what: str, timeout: float, rank: int) -> None:
        """Until every rank checked in; a warning each minute naming how many did and the likely fix, an error after
        ``timeout`` (without the store's own timeout error chained to it: it says nothing the message does not)."""
        waited = 0.0
        fix = (
            "ckptd.prepare(), ckptd.snapshot() and a strict ckptd.restore() are collective: call them on every rank, with the"
            " same step, never under `if rank == 0`"
        )
        while True:
            chunk = min(WARN_EVERY_S, timeout - waited)
            try:
                store.wait([key + "/all"], timedelta(seconds=chunk))
                return
            except (RuntimeError, dist.DistError):
                waited += chunk
                came = store.add(key, 0)
                if waited >= timeout:
                    break
                log.warning(
                    "%s on rank %d: %d of %d ranks arrived after %.0f s; waiting for the others until %.0f s (CKPTD_COLLECTIVE_TIMEOUT)."
                    " If the others do not call it (a slow rank catches up; a call on some ranks only never does): %s",
                    what, rank, came, world, waited, timeout, fix,
                )  # fmt: skip
        late = f"only {came} of {world} ranks called it within {timeout:g} s (CKPTD_COLLECTIVE_TIMEOUT)"
        raise CheckpointError(f"{what} on rank {rank}: {late}. {fix}")


class WritePlan:
    """Caches the assignment while no rank's layout changes."""

    def __init__(self, scope: str = "default") -> None:
        self._hashes: list[int] | None = None
        self._mine: tuple[set[ChunkId], set[ChunkId]] | None = None
        self._items: Any = None
        self._blob = b""
        self.arrivals = Arrivals(scope)
        self.run = secrets.randbits(62) + 1  # this launch's id: every rank takes rank 0's (the daemon tells runs apart)
        self.after: int | None = None  # the step this rank last restored: every rank must have restored the same

    def restored(self, step: int) -> None:
        """This rank restored ``step`` (a rollback when it saves the steps after it again): the saves from
        here on are a new attempt, so the launch id is drawn afresh (rank 0's is taken at the next snapshot)."""
        self.after, self.run = step, secrets.randbits(62) + 1

    def mine(
        self,
        items: list[tuple[ChunkId, int]],
        step: int | None = None,
        failed: bool = False,
        solo: bool = False,
        lowest: frozenset[ChunkId] = frozenset(),
    ) -> tuple[set[ChunkId], set[ChunkId]]:
        """This rank's chunks to write, and those of its chunks that other ranks hold too. ``step``:
        the snapshot's (``None`` for ``prepare``); every rank must pass the same. ``failed``: this rank
        could not stage its state; every rank then raises (this one its own error, by its caller). ``lowest``:
        of ``items``, those written by their lowest-rank holder (:func:`assign`), exchanged with the rest.

        Collective over the default group: call on every rank; ``solo``: this process saves a step of its
        own, alone (a framework that saves from rank 0 only), and nothing is exchanged.
        """
        if solo or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            if failed:
                return set(), set()  # nothing to agree on; the cached plan stays for the next snapshot
            if items is not self._items or self._mine is None:
                self._items, self._mine, self._hashes = items, ({cid for cid, _ in items}, set()), None
            return self._mine
        if items is not self._items or not self._blob:  # the client passes the same list while its layout holds
            entries = [[list(c[0:1]) + [list(c[1]), list(c[2])], n, *([1] if c in lowest else [])] for c, n in items]
            self._blob = json.dumps(entries, separators=(",", ":")).encode()
            self._items = items
        blob = self._blob
        h = xxhash.xxh3_64_intdigest(blob) & 0x7FFFFFFFFFFFFFFF
        dev = collective_device()
        world = dist.get_world_size()
        what = "ckptd.prepare()" if step is None else f"ckptd.snapshot(step={step})"
        self.arrivals.check(what)
        mine = torch.tensor([h, _or_minus(step), self.run, int(failed), _or_minus(self.after)], dtype=torch.int64, device=dev)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        bad = [r for r, t in enumerate(gathered) if int(t[3].item())]
        if bad:
            raise CheckpointError(f"{what}: rank(s) {bad[:8]} could not stage their state (see their error); nothing was saved")
        _same_step([int(t[1].item()) for t in gathered], what)
        _same_restore([int(t[4].item()) for t in gathered], what)
        self.run = int(gathered[0][2].item())
        hashes = [int(t[0].item()) for t in gathered]
        if hashes == self._hashes and self._mine is not None:
            return self._mine
        gathered_entries = [json.loads(b) for b in _all_gather_bytes(blob, dev, world)]
        cid = lambda e: (e[0][0], tuple(e[0][1]), tuple(e[0][2]))  # noqa: E731
        per_rank = [[(cid(e), e[1]) for e in es] for es in gathered_entries]
        flagged = {cid(e) for es in gathered_entries for e in es if len(e) > 2}  # buffers: written by their lowest holder
        counts: dict[ChunkId, int] = {}
        for its in per_rank:
            for cid, _ in its:
                counts[cid] = counts.get(cid, 0) + 1
        shared = {cid for cid, _ in items if counts[cid] > 1}
        self._mine = (assign(per_rank, flagged)[dist.get_rank()], shared)
        self._hashes = hashes
        return self._mine


def _same_step(steps: list[int], what: str) -> None:
    if len(set(steps)) > 1:
        said = ", ".join(f"rank {r}: {'prepare()' if s < 0 else s}" for r, s in enumerate(steps))
        raise CheckpointError(f"{what}: the ranks passed different steps ({said}); every rank must snapshot the same step")


def _or_minus(v: int | None) -> int:
    return -1 if v is None else v


def _same_restore(steps: list[int], what: str) -> None:
    if len(set(steps)) > 1:
        said = ", ".join(f"rank {r}: {'none' if s < 0 else s}" for r, s in enumerate(steps))
        raise CheckpointError(
            f"{what}: the ranks restored different steps before it ({said}); a step saved after a restore must follow"
            " the same restored step on every rank (restore(step=k) on every rank, strict)"
        )


def _all_gather_bytes(blob: bytes, dev: torch.device, world: int) -> list[bytes]:
    n = torch.tensor([len(blob)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    top = max(int(s.item()) for s in sizes)
    buf = torch.zeros(top, dtype=torch.uint8, device=dev)
    buf[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(dev)
    outs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(outs, buf)
    return [bytes(o[: int(s.item())].cpu().numpy().tobytes()) for o, s in zip(outs, sizes)]
