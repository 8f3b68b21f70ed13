"""The held-back request table alone (``ckptd.daemon.waiters``): waiters grouped by what they wait for,
popped once, expired by deadline (late ones split from the rest, emptied keys dropped), and counted."""

from __future__ import annotations

import dataclasses

import pytest

from ckptd.daemon.waiters import Waiter, Waiters


def test_waiters_are_grouped_by_key_and_counted() -> None:
    w: Waiters[tuple[str, int]] = Waiters()
    assert len(w) == 0
    assert not w.has(("a", 1))
    w.add(("a", 1), b"c1", 10, 5.0)
    w.add(("a", 1), b"c2", 11, 6.0)
    w.add(("a", 2), b"c1", 12, 7.0)
    w.add(("b", 1), b"c3", 13, 8.0)
    assert len(w) == 4
    assert w.has(("a", 1)) and w.has(("a", 2)) and w.has(("b", 1))
    assert not w.has(("b", 2))
    assert w.pop(("a", 1)) == [Waiter(b"c1", 10, 5.0), Waiter(b"c2", 11, 6.0)]  # in the order they came
    assert len(w) == 2
    assert w.pop(("a", 2)) == [Waiter(b"c1", 12, 7.0)]
    assert w.pop(("b", 1)) == [Waiter(b"c3", 13, 8.0)]
    assert len(w) == 0


def test_pop_forgets_the_key() -> None:
    w: Waiters[int] = Waiters()  # the fetcher keys its waiters by fetch id
    w.add(7, b"x", "r1", 1.0)
    w.add(8, b"y", "r2", 1.0)
    assert w.pop(7) == [Waiter(b"x", "r1", 1.0)]
    assert not w.has(7)
    assert w.pop(7) == []  # each waiter is handed out once
    assert w.pop(99) == []  # never waited for: nothing, no error
    assert w.has(8) and len(w) == 1


def test_the_same_client_may_wait_twice_on_one_key() -> None:
    w: Waiters[int] = Waiters()
    w.add(1, b"x", 5, 2.0)
    w.add(1, b"x", 5, 2.0)
    assert len(w) == 2
    assert w.pop(1) == [Waiter(b"x", 5, 2.0)] * 2


def test_due_splits_late_from_not_late_and_drops_emptied_keys() -> None:
    w: Waiters[str] = Waiters()
    w.add("mixed", b"m-late", 1, 10.0)
    w.add("mixed", b"m-early", 2, 30.0)
    w.add("mixed", b"m-edge", 3, 20.0)  # deadline == now: late
    w.add("all-late", b"l1", 4, 5.0)
    w.add("all-late", b"l2", 5, 15.0)
    w.add("none-late", b"n", 6, 25.0)

    due = w.due(20.0)
    assert sorted(due, key=lambda kw: kw[1].req_id) == [
        ("mixed", Waiter(b"m-late", 1, 10.0)),
        ("mixed", Waiter(b"m-edge", 3, 20.0)),
        ("all-late", Waiter(b"l1", 4, 5.0)),
        ("all-late", Waiter(b"l2", 5, 15.0)),
    ]
    assert len(w) == 2
    assert not w.has("all-late")
    assert "all-late" not in w._by_key  # an emptied key is removed, not left as an empty list
    assert w.has("mixed") and w.has("none-late")

    assert w.due(20.0) == []  # each late waiter is handed out once
    assert w.pop("mixed") == [Waiter(b"m-early", 2, 30.0)]  # the not-late one stayed, alone
    assert w.pop("none-late") == [Waiter(b"n", 6, 25.0)]
    assert len(w) == 0


def test_due_before_any_deadline_changes_nothing() -> None:
    w: Waiters[int] = Waiters()
    w.add(1, b"a", 1, 100.0)
    w.add(2, b"b", 2, 200.0)
    assert w.due(99.9) == []
    assert len(w) == 2 and w.has(1) and w.has(2)
    assert w.due(1e9) == [(1, Waiter(b"a", 1, 100.0)), (2, Waiter(b"b", 2, 200.0))]
    assert len(w) == 0 and not w.has(1) and not w.has(2)
    assert w._by_key == {}


def test_waiter_is_an_immutable_value() -> None:
    a = Waiter(b"id", {"any": "req id"}, 3.5)
    assert a == Waiter(b"id", {"any": "req id"}, 3.5)
    assert a != Waiter(b"id", {"any": "req id"}, 3.6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.deadline = 0.0  # type: ignore[misc]
