"""A job that spans nodes names the daemons that serve it: its *ring* (:mod:`ckptd.daemon.mesh`).

Every rank asks its daemon for its peer address (``hello``'s ``peer``: set where the daemon listens for peers), the
ranks gather them (one ``all_gather_object``, on the trainer's thread, in the foreground of the job's first snapshot
and of a collective restore: collectives are safe there), and each rank tells its daemon the list, in rank order, each
daemon once. A job on one node, or one whose daemons do not all listen for peers, names no ring: its steps go as before.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointError
from .rpc import Channel

log = logging.getLogger("ckptd.client")


def gather_ring(rpc: Channel) -> list[str] | None:
    """Every rank's daemon's peer address in rank order, each once, or ``None`` when the job has fewer than two daemons
    or one of them does not listen for peers. Collective over the default group: call on every rank."""
    import torch.distributed as dist

    try:
        mine = rpc.call("hello").get("peer")
    except CheckpointError as e:  # still gathered: the other ranks must not wait for this one
        log.debug("no peer address from this rank's daemon: %s", e)
        mine = None
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine if isinstance(mine, str) else None)
    ring = list(dict.fromkeys(every))
    if len(ring) < 2:
        return None
    if None in ring:
        log.warning("the job spans several daemons, but not every one listens for peers: its steps are not held in their memory")
        return None
    return [a for a in ring if a is not None]


def tell_ring(rpc: Channel, job: str, ring: list[str]) -> None:
    """Tell this rank's daemon the job's ring; a daemon that cannot use it says why (logged)."""
    try:
        rep = rpc.call("ring", job=job, ring=ring)
    except CheckpointError as e:
        log.warning("could not tell the daemon the daemons of job %s: %s", job, e)
        return
    if not rep.get("used"):
        log.warning("the daemon keeps job %s's steps to itself: %s", job, rep.get("reason"))
