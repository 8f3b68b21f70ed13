"""Wire messages between trainer clients and the daemon: schema, validation, encode/decode.

Transport: a ZeroMQ DEALER (client) to ROUTER (daemon). Every message is one frame holding one UTF-8
JSON object. Requests carry ``"v"`` (:data:`PROTOCOL_VERSION`), ``"op"``, ``"id"`` (an integer the
reply echoes) and the op's fields below; replies carry ``"v"``, ``"id"``, ``"ok"`` and either the
result fields or ``"error"`` (a message) and ``"code"`` (a word). Unknown versions, ops and fields,
missing fields and wrong types are refused with ``code`` ``"bad_request"``; nothing is guessed.

Ops (who sends them: the trainer's client, on whichever of its threads needs the answer):

``hello`` → ``{"server_version", "root", "pid"}``.
``alloc`` ``{job, rank, world_size, step, nbytes, pid}`` → ``{"segment", "size"}``: lease a staging
    slot of at least ``nbytes``. The reply is deferred while the memory budget is full (backpressure).
``commit`` ``{job, rank, world_size, local_world_size, step, segment, nbytes, replicas}`` plus a
    second frame, the rank's non-tensor tree as JSON: the slot holds a complete shard (``replicas``:
    chunk id → sample digest of every chunk other ranks hold too; ``local_world_size``: how many of
    the step's ranks this daemon serves, fewer than ``world_size`` for a multi-node job, which the
    daemon then commits through the bucket); the reply ``{}`` comes once the daemon has recorded
    the commit in shared memory, after which the step is made durable even if the trainer dies. The
    daemon stores the tree frame as it came and parses it on a persist thread (a malformed tree
    fails the step), so a large tree does not delay the reply.
``release`` ``{segment}``: give a leased slot back unused (the copy failed).
``wait`` ``{job, step, timeout}`` → ``{"state": "pending"|"durable"|"failed", "path", "error"}``;
    the reply is held up to ``timeout`` seconds for the step to leave ``pending``.
``latest`` ``{job}`` → ``{"step", "path"}`` (``null`` when the job has no committed step).
``status`` ``{}`` → daemon-wide counters.
``hot_open`` ``{job, step, pid}`` → ``{"step", "path", "manifest", "segments", "reason"}``: the newest
    durable step of the job (``step`` null) or ``step``, if the daemon still holds every
    rank's shard of it in shared memory: its manifest and, per shard file, the segment holding the
    same bytes. The segments are pinned for ``pid`` (not reused) until ``hot_close``, its death, or
    10 minutes.
    ``"step": null`` and a ``reason`` when it does not hold them.
``hot_close`` ``{pid, segments}``: unpin segments that ``hot_open`` gave this pid.
``fetch`` ``{job, step}`` → ``{"fetch"}``: find the newest complete step (``step`` null) or ``step``
    under the root or in the bucket, downloading it into the root if only the bucket has it, on a
    daemon thread. ``fetch_wait`` ``{fetch, timeout}`` → ``{"state": "pending"|"done"|"failed",
    "step", "path", "source": "local"|"remote", "error"}``, held up to ``timeout`` seconds
    (``source``: the wire's spelling of :class:`Source` ``disk`` / ``bucket``).
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from .config import validate_job
from .errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20

_INT = (int,)
_NUM = (int, float)
_STR = (str,)

SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {},
    "alloc": {"job": _STR, "rank": _INT, "world_size": _INT, "step": _INT, "nbytes": _INT, "pid": _INT},
    "commit": {
        "job": _STR,
        "rank": _INT,
        "world_size": _INT,
        "step": _INT,
        "segment": _STR,
        "nbytes": _INT,
        "replicas": (dict,),
        "local_world_size": _INT,
    },  # fmt: skip
    "release": {"segment": _STR},
    "wait": {"job": _STR, "step": _INT, "timeout": _NUM},
    "latest": {"job": _STR},
    "status": {},
    "hot_open": {"job": _STR, "step": (int, type(None)), "pid": _INT},
    "hot_close": {"pid": _INT, "segments": (list,)},
    "fetch": {"job": _STR, "step": (int, type(None))},
    "fetch_wait": {"fetch": _INT, "timeout": _NUM},
}
_ENVELOPE = {"v", "op", "id"}


class Source(StrEnum):
    """Where a restore's bytes come from: the daemon's shared memory, the local root, the bucket."""

    MEMORY = "memory"
    DISK = "disk"
    BUCKET = "bucket"

    def to_wire(self) -> str:
        """``fetch_wait``'s spelling (protocol version 1): ``local`` / ``remote``."""
        return {Source.DISK: "local", Source.BUCKET: "remote"}[self]

    @classmethod
    def from_wire(cls, value: str) -> Source:
        return {"local": cls.DISK, "remote": cls.BUCKET}[value]


EXTRA_FRAMES = {"commit": 1}  # ops followed by raw frames (commit: the tree's JSON)


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def decode_request(frame: bytes) -> dict[str, Any]:
    """Parse and validate one request frame; raise :class:`ProtocolError` saying what is wrong."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        msg = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"message is not valid JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("message is not a JSON object")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not supported (daemon speaks {PROTOCOL_VERSION})")
    op = msg.get("op")
    if not isinstance(op, str) or op not in SCHEMA:
        raise ProtocolError(f"unknown op {op!r}")
    if not _is_int(msg.get("id")):
        raise ProtocolError("field 'id' missing or not an integer")
    fields = SCHEMA[op]
    extra = set(msg) - _ENVELOPE - set(fields)
    if extra:
        raise ProtocolError(f"op {op!r}: unknown fields {sorted(extra)}")
    for name, types in fields.items():
        if name not in msg:
            raise ProtocolError(f"op {op!r}: missing field {name!r}")
        val = msg[name]
        ok = _is_int(val) if types is _INT else (isinstance(val, types) and not isinstance(val, bool))
        if not ok:
            raise ProtocolError(f"op {op!r}: field {name!r} has the wrong type ({type(val).__name__})")
    if "job" in fields:
        try:
            validate_job(msg["job"])
        except ValueError as e:
            raise ProtocolError(str(e)) from None
    for name in ("rank", "step", "nbytes"):
        if name in fields and isinstance(msg[name], int) and msg[name] < 0:
            raise ProtocolError(f"op {op!r}: field {name!r} must be >= 0")
    if "world_size" in fields and not 0 <= msg.get("rank", 0) < msg["world_size"]:
        raise ProtocolError(f"op {op!r}: rank {msg.get('rank')} outside world_size {msg['world_size']}")
    return msg


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def request(op: str, req_id: int, **fields: Any) -> bytes:
    return encode({"v": PROTOCOL_VERSION, "op": op, "id": req_id, **fields})


def reply_ok(req_id: Any, **fields: Any) -> bytes:
    return encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": True, **fields})


def reply_error(req_id: Any, code: str, error: str) -> bytes:
    return encode({"v": PROTOCOL_VERSION, "id": req_id if _is_int(req_id) else None, "ok": False, "code": code, "error": error})


def endpoint_answers(ctx: Any, endpoint: str, timeout: float) -> bool:
    """Whether a daemon answers ``hello`` at ``endpoint`` within ``timeout`` seconds (a fresh socket)."""
    import zmq

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send(request("hello", 0))
        return bool(s.poll(int(timeout * 1000)))
    finally:
        s.close(0)


def decode_reply(frame: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"daemon sent a reply that is not JSON: {e}") from None
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION or not isinstance(msg.get("ok"), bool):
        raise ProtocolError(f"daemon sent a malformed reply: {str(msg)[:200]}")
    return msg
