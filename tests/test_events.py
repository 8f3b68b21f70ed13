"""The worker -> loop event queue alone (``ckptd.daemon.events``), on a real ZeroMQ context: events
posted from several threads all arrive, each thread's in the order it posted them, typed as posted;
a post makes the inproc wake socket readable and ``drain()`` empties it; ``close()`` lets the context
terminate once the posting threads are gone.

As in the daemon, events are posted from worker threads only, and those are joined before the context
is terminated: each thread's PUSH socket is closed when the thread ends (by garbage collection, with a
ResourceWarning, which is silenced here)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator

import pytest
import zmq

from ckptd.daemon.events import ErrorReported, Event, EventQueue, Fetched, ShardPersisted, Uploaded

pytestmark = pytest.mark.filterwarnings("ignore:Unclosed socket:ResourceWarning")

GUARD_S = 30.0  # only bounds a failing test (a hang becomes a failure), never measures anything


def term_or_fail(ctx: zmq.Context) -> None:
    """Terminate ``ctx`` on a helper thread; a socket left open fails the test instead of hanging it."""
    t = threading.Thread(target=ctx.term, daemon=True)
    t.start()
    t.join(GUARD_S)
    if t.is_alive():
        left = [s for s in list(ctx._sockets) if not s.closed]
        for s in left:
            s.close(linger=0)  # unblocks term, so the test run goes on
        t.join(GUARD_S)
        pytest.fail(f"the zmq context did not terminate: sockets left open: {left}")


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        if not ctx.closed:
            term_or_fail(ctx)


@pytest.fixture
def events(ctx: zmq.Context) -> Iterator[EventQueue]:
    q = EventQueue(ctx)
    try:
        yield q
    finally:
        q.close()


def in_threads(n: int, target: Callable[[int], None]) -> None:
    """Run ``target(i)`` on ``n`` threads started together; join them; re-raise the first error."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            barrier.wait(GUARD_S)
            target(i)
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), name=f"poster-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GUARD_S)
    assert not any(t.is_alive() for t in threads), "a posting thread did not finish"
    if errors:
        raise errors[0]


def post_from_a_thread(q: EventQueue, *evs: Event) -> None:
    in_threads(1, lambda _: [q.post(ev) for ev in evs])


def readable(sock: zmq.Socket, timeout_ms: int = 0) -> bool:
    return bool(sock.poll(timeout_ms, zmq.POLLIN))


def by_thread(got: list[Event]) -> dict[int, list[int]]:
    """``ErrorReported("t:i")`` events -> {t: [i, ...]} in arrival order."""
    out: dict[int, list[int]] = {}
    for ev in got:
        assert isinstance(ev, ErrorReported)
        t, i = ev.message.split(":")
        out.setdefault(int(t), []).append(int(i))
    return out


def test_events_from_four_threads_all_arrive_in_each_threads_order(events: EventQueue) -> None:
    n = 500  # per thread, under one socket's high-water mark: nothing drains while they post

    def post(t: int) -> None:
        for i in range(n):
            events.post(ErrorReported(f"{t}:{i}"))

    in_threads(4, post)
    assert readable(events.wake)
    got = list(events.drain())
    assert len(got) == 4 * n
    assert by_thread(got) == {t: list(range(n)) for t in range(4)}
    assert not readable(events.wake)  # drain() consumed every wake-up
    assert list(events.drain()) == []


def test_a_loop_drains_while_four_threads_post(events: EventQueue) -> None:
    """The daemon's loop: poll the wake socket, drain, repeat, while the workers post."""
    n = 300
    got: list[Event] = []
    done = threading.Event()

    def post(t: int) -> None:
        for i in range(n):
            events.post(ErrorReported(f"{t}:{i}"))

    posters = threading.Thread(target=lambda: (in_threads(4, post), done.set()))
    posters.start()
    poller = zmq.Poller()
    poller.register(events.wake, zmq.POLLIN)
    try:
        while len(got) < 4 * n:
            ready = dict(poller.poll(int(GUARD_S * 1000)))
            assert events.wake in ready, f"no wake-up with {len(got)} of {4 * n} events drained"
            got += events.drain()
    finally:
        posters.join(GUARD_S)
    assert done.is_set(), "a posting thread failed"
    got += events.drain()
    assert by_thread(got) == {t: list(range(n)) for t in range(4)}
    assert not readable(events.wake)


def test_a_post_makes_the_wake_socket_readable_and_drain_empties_it(events: EventQueue) -> None:
    assert not readable(events.wake)
    assert list(events.drain()) == []

    post_from_a_thread(events, ErrorReported("one"))
    assert readable(events.wake, int(GUARD_S * 1000))
    assert list(events.drain()) == [ErrorReported("one")]
    assert not readable(events.wake)

    post_from_a_thread(events, ErrorReported("two"), ErrorReported("three"))  # each post wakes again
    assert readable(events.wake, int(GUARD_S * 1000))
    assert list(events.drain()) == [ErrorReported("two"), ErrorReported("three")]
    assert not readable(events.wake)


def test_an_event_posted_while_draining_is_not_lost(events: EventQueue) -> None:
    post_from_a_thread(events, ErrorReported("a"), ErrorReported("b"))
    it = events.drain()
    assert next(it) == ErrorReported("a")
    post_from_a_thread(events, ErrorReported("c"))  # the loop is handling "a"
    rest = list(it)
    if ErrorReported("c") in rest:
        assert rest == [ErrorReported("b"), ErrorReported("c")]
    else:  # not in this drain: then its wake-up must still be pending, so the loop drains again
        assert rest == [ErrorReported("b")]
        assert readable(events.wake)
        assert list(events.drain()) == [ErrorReported("c")]
    assert list(events.drain()) == []
    assert not readable(events.wake)


def test_drain_yields_the_typed_events_as_posted(events: EventQueue) -> None:
    posted: list[Event] = [
        ShardPersisted("ckptd-x-1", "j", 3, 0, 1024, 0.5),
        ShardPersisted("ckptd-x-2", "j", 3, 1, 2048, 0.25, path="/r/j/step-3", manifest={"world_size": 2}),
        ShardPersisted("ckptd-x-3", "j", 4, 0, 0, 0.0, error="disk full"),
        ShardPersisted("ckptd-x-4", "m", 1, 2, 8, 0.1, node_ranks=[2, 3]),
        Uploaded("j", 3, None, 3072, 1.5, True, False, url="s3://b/j/step-3"),
        Uploaded("m", 1, "bucket unreachable", 0, 0.1, False, True),
        Fetched(7, {"state": "ready", "step": 3}, report=None),
        ErrorReported("object storage: unreachable"),
    ]
    post_from_a_thread(events, *posted)
    got = list(events.drain())
    assert got == posted
    assert [type(e) for e in got] == [type(e) for e in posted]

    handled: dict[type, list[Event]] = {ShardPersisted: [], Uploaded: [], Fetched: [], ErrorReported: []}
    for ev in got:  # the daemon dispatches on the exact type
        handled[type(ev)].append(ev)
    assert {t.__name__: len(v) for t, v in handled.items()} == {"ShardPersisted": 4, "Uploaded": 2, "Fetched": 1, "ErrorReported": 1}
    assert handled[ShardPersisted][2].error == "disk full" and handled[ShardPersisted][3].node_ranks == [2, 3]

    with pytest.raises(dataclasses.FrozenInstanceError):
        got[0].step = 99  # type: ignore[misc]


def test_two_queues_on_one_context_wake_only_their_own_loop(ctx: zmq.Context) -> None:
    a, b = EventQueue(ctx), EventQueue(ctx)
    try:
        post_from_a_thread(a, ErrorReported("for a"))
        assert readable(a.wake, int(GUARD_S * 1000))
        assert not readable(b.wake)
        assert list(b.drain()) == []
        assert list(a.drain()) == [ErrorReported("for a")]
    finally:
        a.close()
        b.close()


def test_close_then_the_context_terminates() -> None:
    ctx = zmq.Context()
    try:
        q = EventQueue(ctx)
        in_threads(4, lambda t: [q.post(ErrorReported(f"{t}:{i}")) for i in range(10)])
        assert len(list(q.drain())) == 40
        q.close()
        assert q.wake.closed
    finally:
        term_or_fail(ctx)
    assert ctx.closed


def test_close_with_events_never_drained_still_terminates() -> None:
    """Shutting down with wake-ups and events still queued (the loop never got to them)."""
    ctx = zmq.Context()
    try:
        q = EventQueue(ctx)
        in_threads(2, lambda t: [q.post(ErrorReported(f"{t}:{i}")) for i in range(50)])
        assert readable(q.wake, int(GUARD_S * 1000))
        q.close()
    finally:
        term_or_fail(ctx)
    assert ctx.closed


def test_a_loop_far_behind_never_fails_a_post(events: EventQueue) -> None:
    """Past the wake socket's high-water mark a post still queues its event and returns: a worker's
    result is never reported as undelivered because the loop is busy."""

    def post_many(i: int) -> None:
        for n in range(5000):
            events.post(ErrorReported(f"{i}-{n}"))

    in_threads(1, post_many)
    got = [e.message for e in events.drain() if isinstance(e, ErrorReported)]
    assert got == [f"0-{n}" for n in range(5000)]


def test_close_lets_the_context_terminate_after_a_post_from_the_closing_thread() -> None:
    ctx = zmq.Context()
    q = EventQueue(ctx)
    q.post(ErrorReported("from the loop's own thread"))
    assert [e.message for e in q.drain()] == ["from the loop's own thread"]  # type: ignore[union-attr]
    q.close()
    term_or_fail(ctx)  # hung before: this thread's PUSH socket was never closed
