"""Requests whose reply is held back until something happens or a deadline passes (``wait`` on a
step, ``fetch_wait`` on a fetch). Main thread only: the daemon's loop adds, pops and expires them.

At most :data:`MAX_WAITERS` wait in one table: a client flooding ``wait`` requests (each held up to
``WAIT_CAP_S``) is refused rather than grow the daemon's memory with its rate."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import CheckpointError

K = TypeVar("K", bound=Hashable)
MAX_WAITERS = 16384


@dataclass(frozen=True)
class Waiter:
    ident: bytes  # the client's ZeroMQ identity: where the reply goes
    req_id: Any  # the request's id, echoed in the reply
    deadline: float  # monotonic time by which it gets an answer, whatever happens


class Waiters(Generic[K]):
    """Waiters grouped by what they wait for."""

    def __init__(self) -> None:
        self._by_key: dict[K, list[Waiter]] = {}
        self._n = 0

    def add(self, key: K, ident: bytes, req_id: Any, deadline: float) -> None:
        if self._n >= MAX_WAITERS:
            raise CheckpointError(f"{MAX_WAITERS} requests wait for an answer already: try again")
        self._by_key.setdefault(key, []).append(Waiter(ident, req_id, deadline))
        self._n += 1

    def has(self, key: K) -> bool:
        return bool(self._by_key.get(key))

    def pop(self, key: K) -> list[Waiter]:
        """Every waiter of ``key``, forgotten here: the caller answers them."""
        out = self._by_key.pop(key, [])
        self._n -= len(out)
        return out

    def due(self, now: float) -> list[tuple[K, Waiter]]:
        """The waiters whose deadline has passed, forgotten here: the caller answers them."""
        out = []
        for key in list(self._by_key):
            waiting = self._by_key[key]
            late = [w for w in waiting if w.deadline <= now]
            if late:
                rest = [w for w in waiting if w.deadline > now]
                if rest:
                    self._by_key[key] = rest
                else:
                    del self._by_key[key]
                out += [(key, w) for w in late]
        self._n -= len(out)
        return out

    def __len__(self) -> int:
        return self._n
