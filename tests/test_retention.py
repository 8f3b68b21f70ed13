"""Retention policies (:mod:`ckptd.storage.retention`): what :class:`KeepLatest`, :class:`KeepEvery`,
:class:`Protect` and :class:`AnyOf` keep, their edge cases (``n`` of 0, no steps, no policies), and
:func:`doomed` as the exact complement of what a policy keeps. Pure functions: no disk."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ckptd.storage.retention import AnyOf, KeepEvery, KeepLatest, Protect, RetentionPolicy, doomed

STEPS = [0, 3, 5, 10, 12, 15, 20]


@pytest.mark.parametrize(
    "n,steps,want",
    [
        (2, STEPS, {15, 20}),
        (1, STEPS, {20}),
        (len(STEPS), STEPS, set(STEPS)),
        (100, STEPS, set(STEPS)),  # more than there are: all of them
        (0, STEPS, set(STEPS)),  # 0 means keep everything
        (0, [], set()),
        (3, [], set()),
    ],
)
def test_keep_latest(n: int, steps: list[int], want: set[int]) -> None:
    assert KeepLatest(n).keeps(steps) == want


@pytest.mark.parametrize(
    "n,steps,want",
    [
        (5, STEPS, {0, 5, 10, 15, 20}),
        (10, STEPS, {0, 10, 20}),
        (7, STEPS, {0}),
        (1, STEPS, set(STEPS)),
        (0, STEPS, set()),  # 0 means none
        (5, [], set()),
        (0, [], set()),
    ],
)
def test_keep_every(n: int, steps: list[int], want: set[int]) -> None:
    assert KeepEvery(n).keeps(steps) == want


@pytest.mark.parametrize(
    "protected,steps,want",
    [
        ({3, 12}, STEPS, {3, 12}),
        ({4, 99}, STEPS, set()),  # never invents steps that are not there
        ({3, 99}, STEPS, {3}),
        (set(), STEPS, set()),
        ({3}, [], set()),
    ],
)
def test_protect(protected: set[int], steps: list[int], want: set[int]) -> None:
    assert Protect(frozenset(protected)).keeps(steps) == want


def test_any_of_keeps_the_union() -> None:
    policy = AnyOf((KeepLatest(2), KeepEvery(10), Protect(frozenset({3}))))
    assert policy.keeps(STEPS) == {15, 20} | {0, 10, 20} | {3}
    assert doomed(policy, STEPS) == [5, 12]


def test_any_of_nests() -> None:
    inner = AnyOf((KeepEvery(5), Protect(frozenset({3}))))
    assert AnyOf((inner, KeepLatest(1))).keeps(STEPS) == {0, 3, 5, 10, 15, 20}


@pytest.mark.parametrize("steps", [STEPS, []])
def test_any_of_nothing_keeps_nothing(steps: list[int]) -> None:
    assert AnyOf(()).keeps(steps) == set()
    assert doomed(AnyOf(()), steps) == sorted(steps)


def test_any_of_keep_latest_and_protect_as_the_daemon_composes_them() -> None:
    policy = AnyOf((KeepLatest(2), Protect(frozenset({1}))))
    assert doomed(policy, [1, 2, 3, 4]) == [2]
    assert doomed(policy, [2, 3, 4]) == [2]  # a protected step already gone changes nothing


@pytest.mark.parametrize(
    "policy,steps,want",
    [
        (KeepLatest(2), [1, 2, 3, 4], [1, 2]),
        (KeepLatest(0), [1, 2, 3], []),
        (KeepEvery(0), [1, 2, 3], [1, 2, 3]),
        (KeepEvery(2), [1, 2, 3, 4], [1, 3]),
        (KeepLatest(2), [], []),
        (AnyOf(()), [], []),
    ],
)
def test_doomed(policy: RetentionPolicy, steps: list[int], want: list[int]) -> None:
    assert doomed(policy, steps) == want


def test_doomed_is_ascending_and_the_complement_of_what_is_kept() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        steps = sorted(rng.sample(range(60), rng.randrange(0, 15)))
        parts: list[RetentionPolicy] = [KeepLatest(rng.randrange(0, 5)), KeepEvery(rng.randrange(0, 7))]
        parts.append(Protect(frozenset(rng.sample(range(60), 3))))
        policy = AnyOf(tuple(rng.sample(parts, rng.randrange(0, 4))))
        gone, kept = doomed(policy, steps), policy.keeps(steps)
        assert gone == sorted(gone)
        assert kept <= set(steps)
        assert set(gone) | kept == set(steps) and not set(gone) & kept, (policy, steps)


def test_policies_do_not_modify_their_input() -> None:
    steps = list(STEPS)
    for policy in (KeepLatest(2), KeepEvery(5), Protect(frozenset({3})), AnyOf((KeepLatest(1), KeepEvery(10)))):
        policy.keeps(steps)
        doomed(policy, steps)
        assert steps == STEPS
    assert KeepLatest(2).keeps(tuple(STEPS)) == {15, 20}  # any sequence


class _KeepOdd:
    """A policy of the caller's own: anything with ``keeps`` composes."""

    def keeps(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % 2}


def test_a_custom_policy_composes() -> None:
    assert AnyOf((_KeepOdd(), KeepLatest(1))).keeps(STEPS) == {3, 5, 15, 20}
    assert doomed(_KeepOdd(), [1, 2, 3, 4]) == [2, 4]
