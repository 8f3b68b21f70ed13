"""Which complete steps a tier keeps: small policies that compose (as Orbax's ``LatestN`` and
``EveryNSteps`` do), applied by :mod:`.local` and :mod:`.remote` after each new step.

A policy answers one question, ``keeps(steps)``: of these complete steps (oldest commit first: after a
rollback a lower step number can be newer), which must stay.
Every step no policy of an :class:`AnyOf` keeps is removed. Pure functions of their input: any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class RetentionPolicy(Protocol):
    def keeps(self, steps: Sequence[int]) -> set[int]:
        """The steps of ``steps`` (complete steps, oldest commit first) this policy keeps."""
        ...


@dataclass(frozen=True)
class KeepLatest:
    """The ``n`` steps committed last (every step when ``n`` is 0)."""

    n: int

    def keeps(self, steps: Sequence[int]) -> set[int]:
        return set(steps[-self.n :]) if self.n > 0 else set(steps)


@dataclass(frozen=True)
class KeepEvery:
    """Every step divisible by ``n``, forever (none when ``n`` is 0)."""

    n: int

    def keeps(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if self.n > 0 and s % self.n == 0}


@dataclass(frozen=True)
class Protect:
    """Named steps, whatever their age (for example those still to be uploaded)."""

    steps: frozenset[int]

    def keeps(self, steps: Sequence[int]) -> set[int]:
        return set(steps) & self.steps


@dataclass(frozen=True)
class AnyOf:
    """A step stays if any of ``policies`` keeps it."""

    policies: tuple[RetentionPolicy, ...]

    def keeps(self, steps: Sequence[int]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keeps(steps)
        return out


def doomed(policy: RetentionPolicy, steps: Sequence[int]) -> list[int]:
    """The steps of ``steps`` that ``policy`` does not keep, ascending."""
    kept = policy.keeps(steps)
    return sorted(s for s in steps if s not in kept)
