"""Requests whose reply is held back until something happens or a deadline passes (``wait`` on a
step, ``fetch_wait`` on a fetch). Main thread only: the daemon's loop adds, pops and expires them."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Waiter:
    ident: bytes  # the client's ZeroMQ identity: where the reply goes
    req_id: Any  # the request's id, echoed in the reply
    deadline: float  # monotonic time by which it gets an answer, whatever happens


class Waiters(Generic[K]):
    """Waiters grouped by what they wait for."""

    def __init__(self) -> None:
        self._by_key: dict[K, list[Waiter]] = {}

    def add(self, key: K, ident: bytes, req_id: Any, deadline: float) -> None:
        self._by_key.setdefault(key, []).append(Waiter(ident, req_id, deadline))

    def has(self, key: K) -> bool:
        return bool(self._by_key.get(key))

    def pop(self, key: K) -> list[Waiter]:
        """Every waiter of ``key``, forgotten here: the caller answers them."""
        return self._by_key.pop(key, [])

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
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())
