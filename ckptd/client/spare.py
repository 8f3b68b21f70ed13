"""Warming a spare slot off the snapshots' path.

When the disk lags under ``lagging="wait"``, the daemon makes a rank a spare slot (its own previous one is
still being persisted) and says so in the ``alloc`` reply. A slot the trainer has never used costs its first
snapshot a mapping (``MAP_POPULATE``: 0.6 s for 6 GB on an H100 host) and, for CUDA state, a page-lock
(0.3 s). :class:`SpareWarmer` takes those costs on a thread of its own instead: it leases the spare
(``alloc`` with ``warm`` and ``spare``, which waits while the daemon makes it), maps it (page-locked for the
snapshot's GPU) into the client's :class:`.copy.SlotMaps`, and releases it; the next snapshot that gets it
finds it mapped. A spare the daemon gave to a snapshot meanwhile, or none at all, is no error: nothing is
warmed. One warming at a time per client.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError, ProtocolError
from .copy import SlotMaps

log = logging.getLogger("ckptd.client")


class SpareWarmer:
    def __init__(self, maps: SlotMaps, lease: Callable[[int, int, int], str], release: Callable[[str], None]) -> None:
        """``lease(rank, world_size, nbytes)``: the spare's segment, leased; ``release(segment)`` gives it back."""
        self._maps, self._lease, self._release = maps, lease, release
        self._due: tuple[int, int, int] | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()  # the client closes: a lease granted from now on is given back unmapped
        self.warmed = 0  # spares mapped ahead of the snapshot that uses them

    def due(self, rank: int, world: int, nbytes: int) -> None:
        """The daemon announced a spare for this rank (``alloc``'s reply): warm it after this snapshot."""
        self._due = (rank, world, nbytes)

    def start(self, device: int | None) -> None:
        """Warm the announced spare on a thread (page-locked for GPU ``device``, or not: ``None``)."""
        due, self._due = self._due, None
        if due is None or self._cancel.is_set() or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._run, args=(*due, device), name="ckptd-warm-spare", daemon=True)
        self._thread.start()

    def _run(self, rank: int, world: int, nbytes: int, device: int | None) -> None:
        try:
            segment = self._lease(rank, world, nbytes)
        except CheckpointError as e:  # taken by a snapshot, or none coming: the next snapshot maps what it gets
            log.debug("no spare slot to warm: %s", e)
            return
        try:
            if not self._cancel.is_set():
                self._maps.warm([segment], pin=device is not None, device=device)
                self.warmed += 1
        except Exception as e:
            log.warning("could not map spare slot %s ahead: %s", segment, e)
        finally:
            self._release(segment)

    def close(self, timeout: float) -> bool:
        """Stop warming: a warming in progress gives its lease back without mapping it. Waits up to ``timeout``
        for it to end; False if it is still talking to the daemon (its socket must not be closed under it)."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()


def lease_many(lease: Callable[[], str], n: int, leased: list[str]) -> list[ProtocolError]:
    """``prepare()``: ``n`` slots leased side by side (each made, mapped and page-locked in parallel) into
    ``leased``; the refusals of those the daemon's budget has no room for now (refused at once, not waited for)."""
    short: list[ProtocolError] = []

    def one() -> None:
        try:
            leased.append(lease())
        except ProtocolError as e:
            short.append(e)

    with ThreadPoolExecutor(max(1, n)) as pool:
        for f in [pool.submit(one) for _ in range(n)]:
            f.result()
    return short
