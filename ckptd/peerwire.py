"""Wire messages between node daemons (peer links): schema, validation, encode/decode.

Transport: a ZeroMQ DEALER (the daemon that sends or pulls replicas, :mod:`ckptd.storage.peer`) to the ROUTER a
daemon serves with ``--peer-listen`` (:mod:`ckptd.daemon.replicas`), encrypted and authenticated with CurveZMQ
(:mod:`ckptd.peerkey`). A peer's replica store is an object store: keys are the bucket's (``<job>/step-N/<name>``,
:func:`ckptd.layout.bucket_key`), so a step is replicated exactly as it is uploaded (its files, then its manifest
last) and pulled back exactly as it is downloaded (every checksum verified).

Every message is a JSON frame, plus one data frame for ``chunk`` requests and ``get`` replies. Requests carry ``"v"``
(:data:`PEER_VERSION`), ``"op"``, ``"id"`` (echoed by the reply) and the op's fields; replies ``"v"``, ``"id"``,
``"ok"`` and the results or ``"error"``. Unknown versions, ops or fields, wrong types, keys outside the bucket
layout and sizes past the bounds are refused; nothing is guessed. Ops:

``ping`` → ``{}``.
``put`` ``{key, size}`` → ``{"upload"}``: begin an object of ``size`` bytes (room is taken now, or the put refused).
``chunk`` ``{upload, offset, xxh3}`` + data → ``{}``: once the data's XXH3-64 matched ``xxh3`` and it was stored at
    ``offset``; chunks arrive in order, each at most :data:`CHUNK_BYTES`.
``end`` ``{upload}`` → ``{"tag"}``: every byte arrived; the object replaces any of its key. ``abort`` ``{upload}``.
``list`` ``{prefix}`` → ``{"objects": {key: [tag, size]}}``: the complete objects under ``prefix``.
``get`` ``{key, offset, length}`` → ``{"size", "tag", "xxh3"}`` + data: at most :data:`CHUNK_BYTES` of an object.
``delete`` ``{keys}`` → ``{}``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .config import validate_job
from .errors import ProtocolError

PEER_VERSION = 1
CHUNK_BYTES = 4 << 20  # the most one chunk (or a get's answer) carries
MAX_HEADER_BYTES = 64 << 10  # a message's JSON frame
MAX_KEY_CHARS = 512
MAX_OBJECT_BYTES = 1 << 44  # 16 TiB: past any shard; the budget bounds what is held
MAX_LIST = 20_000  # objects one list answers
MAX_DELETE = 10_000
_STEP_RE = re.compile(r"step-\d{1,19}")
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_TOKEN_RE = re.compile(r"[0-9a-f]{1,64}")

_INT = (int,)
FIELDS: dict[str, dict[str, Any]] = {  # op -> field -> type (a tuple of types, or "key" / "keys" / "hex")
    "ping": {},
    "put": {"key": "key", "size": _INT},
    "chunk": {"upload": _INT, "offset": _INT, "xxh3": "hex"},
    "end": {"upload": _INT},
    "abort": {"upload": _INT},
    "list": {"prefix": (str,)},
    "get": {"key": "key", "offset": _INT, "length": _INT},
    "delete": {"keys": "keys"},
}
DATA_OPS = frozenset({"chunk"})  # requests followed by one data frame


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def check_key(key: object, what: str = "key") -> str:
    """``key`` if it names an object of the bucket layout: ``<job>/step-N/<name>[/<name>...]`` (at most four
    segments), each name plain; else :class:`ProtocolError`."""
    if not isinstance(key, str) or not key.isascii() or len(key) > MAX_KEY_CHARS:
        raise ProtocolError(f"{what} must be an ASCII string of at most {MAX_KEY_CHARS} characters")
    parts = key.split("/")
    try:
        validate_job(parts[0])
    except ValueError as e:
        raise ProtocolError(f"{what} {key!r}: {e}") from None
    names_ok = all(_NAME_RE.fullmatch(p) and p not in (".", "..") for p in parts[2:])
    if not 3 <= len(parts) <= 4 or not _STEP_RE.fullmatch(parts[1]) or not names_ok:
        raise ProtocolError(f"{what} {key!r} is not <job>/step-N/<file> (the bucket's layout)")
    return key


def check_prefix(prefix: str) -> str:
    """A list prefix: empty, a job's name, or a job's name followed by ``/`` and more of a key."""
    if len(prefix) > MAX_KEY_CHARS or not prefix.isascii() or any(c in prefix for c in "\x00\n\r"):
        raise ProtocolError("prefix must be a short ASCII string")
    if prefix:
        job = prefix.split("/", 1)[0]
        try:
            validate_job(job)
        except ValueError as e:
            raise ProtocolError(f"prefix {prefix!r}: {e}") from None
    return prefix


def _check_field(op: str, name: str, want: Any, value: Any) -> None:
    if want == "key":
        check_key(value, name)
    elif want == "keys":
        if not isinstance(value, list) or len(value) > MAX_DELETE:
            raise ProtocolError(f"{op}: {name} must be a list of at most {MAX_DELETE} keys")
        for k in value:
            check_key(k, name)
    elif want == "hex":
        if not isinstance(value, str) or not _TOKEN_RE.fullmatch(value):
            raise ProtocolError(f"{op}: {name} must be lowercase hex")
    elif isinstance(value, bool) or not isinstance(value, want):
        raise ProtocolError(f"{op}: {name} must be {' or '.join(t.__name__ for t in want)}")
    elif want is _INT and not 0 <= value <= MAX_OBJECT_BYTES:
        raise ProtocolError(f"{op}: {name} must be 0..{MAX_OBJECT_BYTES}")
    elif name == "prefix":
        check_prefix(value)


def decode_request(frames: list[bytes]) -> tuple[dict[str, Any], bytes | None]:
    """One request (its frames after the ROUTER's identity): the validated message and its data frame, if the op
    takes one. Raises :class:`ProtocolError` saying what is wrong."""
    if not frames or len(frames[0]) > MAX_HEADER_BYTES:
        raise ProtocolError(f"a request's first frame must be a JSON object of at most {MAX_HEADER_BYTES} bytes")
    try:
        msg = json.loads(frames[0])
    except (ValueError, RecursionError):
        raise ProtocolError("the request is not JSON") from None
    if not isinstance(msg, dict) or msg.get("v") != PEER_VERSION:
        raise ProtocolError(f"not a peer request of version {PEER_VERSION}")
    op, rid = msg.get("op"), msg.get("id")
    if op not in FIELDS or isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < 1 << 62:
        raise ProtocolError(f"unknown op {op!r}, or no id" if op not in FIELDS else "id must be an integer")
    fields = FIELDS[op]
    extra = set(msg) - set(fields) - {"v", "op", "id"}
    if extra:
        raise ProtocolError(f"{op}: unknown fields {sorted(extra)}")
    for name, want in fields.items():
        if name not in msg:
            raise ProtocolError(f"{op}: missing field {name!r}")
        _check_field(op, name, want, msg[name])
    want_frames = 2 if op in DATA_OPS else 1
    if len(frames) != want_frames:
        raise ProtocolError(f"{op} takes {want_frames} frame(s), got {len(frames)}")
    data = frames[1] if op in DATA_OPS else None
    if data is not None and len(data) > CHUNK_BYTES:
        raise ProtocolError(f"a chunk carries at most {CHUNK_BYTES} bytes, got {len(data)}")
    return msg, data


def request(op: str, rid: int, **fields: Any) -> bytes:
    return encode({"v": PEER_VERSION, "op": op, "id": rid, **fields})


def reply_ok(rid: int | None, **fields: Any) -> bytes:
    return encode({"v": PEER_VERSION, "id": rid, "ok": True, **fields})


def reply_error(rid: int | None, error: str, code: str = "refused") -> bytes:
    return encode({"v": PEER_VERSION, "id": rid, "ok": False, "error": error[:2000], "code": code})


def decode_reply(frame: bytes) -> dict[str, Any]:
    """A reply's JSON frame, checked for shape (the fields an op's caller reads it checks itself)."""
    if len(frame) > MAX_HEADER_BYTES * 64:  # a list's answer may be long, never past this
        raise ProtocolError("a peer's reply is too large")
    try:
        msg = json.loads(frame)
    except (ValueError, RecursionError):
        raise ProtocolError("a peer's reply is not JSON") from None
    if not isinstance(msg, dict) or msg.get("v") != PEER_VERSION or not isinstance(msg.get("ok"), bool):
        raise ProtocolError(f"not a peer reply of version {PEER_VERSION}")
    if not msg["ok"] and not isinstance(msg.get("error"), str):
        raise ProtocolError("a peer's error reply carries no message")
    return msg
