"""A request's frames as the daemon's ROUTER socket delivers them, counted before any is copied.

``ZMQ_MAXMSGSIZE`` bounds each frame of a message, not the message: one message may hold thousands of
frames of up to :data:`~ckptd.protocol.MAX_MESSAGE_BYTES` each. libzmq hands a multipart message over only
once it is whole (it is in the daemon's memory by then: the endpoint's receive high-water mark bounds how
many wait per connection), but the daemon copies no frame of a message longer than any request — the
sender's identity, a REQ socket's empty delimiter, the request, the raw frames its op takes
(:data:`~ckptd.protocol.EXTRA_FRAMES`) — and answers it ``bad_request``; its memory goes back as soon as
the loop drops it. A REQ socket's envelope is stripped here and its sender remembered (its replies need
the delimiter).

Main thread only (the daemon's loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..errors import ProtocolError
from ..protocol import EXTRA_FRAMES

MAX_FRAMES = 1 + max(EXTRA_FRAMES.values(), default=0)  # a request and the raw frames its op takes
REQ_PEERS_KEPT = 65536  # REQ senders remembered (their replies carry the delimiter), oldest forgotten first


def unwrap(parts: Sequence[Any], req_peers: OrderedDict[bytes, None]) -> tuple[bytes, Sequence[Any]]:
    """The sender's identity (copied: a few bytes) and the frames of its message after the envelope, not copied
    (``zmq.Frame`` objects, or bytes). A REQ socket's sender is noted in ``req_peers``."""
    ident = bytes(parts[0])
    if len(parts) > 2 and len(parts[1]) == 0:  # a REQ socket's envelope: identity, empty delimiter, message
        req_peers[ident] = None
        req_peers.move_to_end(ident)
        while len(req_peers) > REQ_PEERS_KEPT:
            req_peers.popitem(last=False)
        return ident, parts[2:]
    return ident, parts[1:]


def copy(body: Sequence[Any]) -> list[bytes]:
    """The bytes of a message's frames, copied only once their number is checked: ``ProtocolError``, with
    nothing copied, for a message with no frame or with more than any request has."""
    if not body:
        raise ProtocolError("empty message")
    if len(body) > MAX_FRAMES:
        raise ProtocolError(f"a request has at most {MAX_FRAMES} frames; this message has {len(body)} (none of them read)")
    return [bytes(f) for f in body]
