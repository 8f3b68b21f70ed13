"""Growing the slot pool off the daemon's loop: a new staging segment (fallocated and zero-filled in
``/dev/shm``, seconds for a large shard on a cold node) is made by a worker thread, never while the loop
waits, so the other ranks' requests (commits, waits, allocs of slots that exist) are answered meanwhile
and the segments several ranks need at once are made side by side.

The slot pool asks with :meth:`Grower.submit` and defers the ``alloc`` that needed it; the worker reports
:class:`~ckptd.daemon.events.SlotCreated` and the loop hands the slot to the deferred request.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from .. import shm
from .events import EventQueue, SlotCreated

log = logging.getLogger("ckptd.daemon")

GROW_WORKERS = 2  # segments made at once (zero-filling is memory-bound: more threads gain little)


class Grower:
    def __init__(self, segments: shm.SegmentDir, events: EventQueue) -> None:
        self._segments, self._events = segments, events
        self._pool = ThreadPoolExecutor(GROW_WORKERS, thread_name_prefix="ckptd-grow")
        self._closed = False

    def submit(self, need: int, token: int) -> None:
        """Make a segment of at least ``need`` bytes; ``token`` names the request in the event. Asked after
        :meth:`shutdown` (a request retried by the shutdown's last drain), the event reports a failure."""
        if self._closed:
            self._events.post(SlotCreated(token, None, need, "the daemon is shutting down"))
            return
        self._pool.submit(self._make, need, token)

    def _make(self, need: int, token: int) -> None:
        try:
            name, size = self._segments.create(need)
        except Exception as e:  # every request gets its event (a MemoryError too), or its token would be held for good
            self._events.post(SlotCreated(token, None, need, str(e) or type(e).__name__))
            return
        self._events.post(SlotCreated(token, name, size))

    def shutdown(self) -> None:
        """Wait for segments being made (the loop's last drain adopts or unlinks them)."""
        self._closed = True
        self._pool.shutdown(wait=True)
