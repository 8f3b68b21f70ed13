"""Wire messages between trainer clients and the daemon: schema, validation, encode/decode.

Transport: a ZeroMQ DEALER (client) to ROUTER (daemon). Every message is one frame holding one UTF-8
JSON object. Requests carry ``"v"`` (:data:`PROTOCOL_VERSION`), ``"op"``, ``"id"`` (an integer the
reply echoes) and the op's fields below; replies carry ``"v"``, ``"id"``, ``"ok"`` and either the
result fields or ``"error"`` (a message) and ``"code"`` (a word). Unknown versions, ops and fields,
missing fields, wrong types and values out of bounds (pids within the kernel's ``pid_max``, world
sizes up to :data:`~ckptd.config.MAX_WORLD_SIZE`, ranks below the world size, short strings) are
refused with ``code`` ``"bad_request"``; nothing is guessed. A request the daemon will not take is refused
with ``"refused"``; one it cannot take yet, having changed nothing (a ``commit`` starting a new attempt at a step while a
shard of an earlier attempt is still being written, queued or sealed, or while a dead run's step is still being made
durable), with ``"busy"``: the client asks again. A bug's error is ``"internal"``. A REQ socket's empty delimiter
frame is accepted, and its replies carry one.

Ops (who sends them: the trainer's client, on whichever of its threads needs the answer):

``hello`` → ``{"server_version", "root", "pid", "tiering"}`` (``tiering``: the daemon's default
    ``persist_every``, ``persist_interval``, ``lagging``).
``alloc`` ``{job, rank, world_size, step, nbytes, pid}`` → ``{"segment", "size", "lease"}``: lease a
    staging slot of at least ``nbytes`` (``step`` null: the commit names it). The reply is deferred while the memory budget is full
    (backpressure; at most :data:`~ckptd.config.MAX_DEFERRED_ALLOCS` wait at once). ``lease`` is a
    secret token: only a request that names it may commit or release the slot. A lease neither
    committed nor released within the daemon's lease timeout (or whose holder dies) is taken back.
    Over ``ipc://`` the holder's pid is the one the kernel reports for the socket's peer
    (``SO_PEERCRED``, in the daemon's PID namespace), not the ``pid`` field; over ``tcp://`` the field.
    Over ``ipc://`` only that process may commit or release the lease, whatever token another names.
    The reply carries ``"spare": true`` when the daemon is making a spare slot for the rank (its disk
    lags); the trainer may then lease that slot with ``{warm, spare}`` true, off its snapshots' path, to
    map it ahead, and release it.
``commit`` ``{job, rank, world_size, local_world_size, step, segment, lease, nbytes, replicas}`` plus a
    second frame, the rank's non-tensor tree as JSON: the slot holds a complete shard (``replicas``:
    chunk id → sample digest of every chunk other ranks hold too; ``local_world_size``: how many of
    the step's ranks this daemon serves, fewer than ``world_size`` for a multi-node job, which the
    daemon then commits through the bucket); the reply ``{}`` comes once the daemon has recorded
    the commit in shared memory, after which the step is made durable even if the trainer dies. The
    daemon stores the tree frame as it came and parses it on a persist thread (a malformed tree
    fails the step), so a large tree does not delay the reply.
``release`` ``{segment, lease}``: give a leased slot back unused (the copy failed).
    Optional: ``persist_every`` / ``persist_interval`` (the job's own tiering, see
    :mod:`ckptd.daemon.tiering`; null: the daemon's).
``wait`` ``{job, step, timeout}`` → ``{"state": "pending"|"memory"|"durable"|"failed"|"dropped", "path",
    "error"}``; the reply is held up to ``timeout`` seconds for the step to leave ``pending``. A wait
    for a step held in the memory tier only has it persisted (a wait asks for durability);
    ``dropped``: a memory-only step the tiering policy dropped before anyone asked. ``failed`` with
    ``"unknown": true``: the daemon has no record of the step and it is not on disk (it restarted since).
    ``persist`` (optional, default true): false answers a memory-only step as it is (``memory``).
``replicated`` ``{job, step, timeout}`` → ``{"state": "pending"|"replicated"|"degraded"|"superseded"|"not_replicated",
    "step", "peers", "reason"}``: what became of the step's copy to the daemon's peers (``--replicas K``), held up to
    ``timeout`` seconds while it is ``pending``; ``degraded``: fewer than K peers took it (``peers`` those that did);
    ``superseded``: a later step of the job completed before this one was sent, and went instead. Refused by a
    daemon that replicates nothing.
``ring`` ``{job, ring}`` → ``{"used", "reason"}``: a rank of a job that spans nodes names the daemons that serve the
    job (``ring``: their peer addresses, ``tcp://HOST:PORT``, in the order of the ranks they serve; 2..:data:`MAX_RING`,
    distinct): with peer links the daemon keeps the job's steps in their memory (:mod:`ckptd.daemon.mesh`); ``used``
    false, and why, where it cannot (no peer links, or its own address is not in the ring).
``promote`` ``{job, step}`` → ``{"step"}``: before a restore, the step to wait for: ``step`` (null: the
    job's newest step every rank committed) if it is still pending or held in the memory tier only;
    null when the durable steps answer. With ``persist`` (optional, default true; false for a restore
    that reads shared memory) a memory-only one is persisted. Then ``wait`` for it.
``latest`` ``{job}`` → ``{"step", "path", "source"}``: the job's latest complete step, the one
    committed last (commit order: after a rollback a lower step number can be the latest), under the
    root or, with a bucket, in the bucket (``source`` ``"local"`` / ``"remote"``; ``path`` null for
    a step only the bucket holds; ``step`` null when the job has none). With a bucket the reply waits
    for the bucket's listing; an unreachable bucket is an error naming the local step, if any (never
    a silent "none", never a possibly stale step).
``status`` ``{}`` → daemon-wide counters.
``hot_open`` ``{job, step, pid}`` → ``{"step", "path", "manifest", "segments", "pin", "reason", "tier"}``: the
    newest complete step of the job (``step`` null) or ``step``, durable or in the memory tier only
    (``tier`` ``"disk"`` / ``"memory"``: then the manifest has no checksums), if the daemon still holds every
    rank's shard of it in shared memory: its manifest and, per shard file, the segment holding the
    same bytes. The segments are pinned (not reused) until ``hot_close`` names the ``pin`` token,
    ``pid`` dies, or 10 minutes pass.
    ``"step": null`` and a ``reason`` when it does not hold them.
``hot_close`` ``{pin, segments}``: unpin segments that ``hot_open`` pinned with ``pin``.
``fetch`` ``{job, step}`` → ``{"fetch"}``: find the newest complete step (``step`` null) or ``step``
    under the root or in the bucket, downloading it into the root if only the bucket has it, on a
    daemon thread. ``fetch_wait`` ``{fetch, timeout}`` → ``{"state": "pending"|"done"|"failed",
    "step", "path", "source": "local"|"remote", "error"}``, held up to ``timeout`` seconds
    (``source``: the wire's spelling of :class:`Source` ``disk`` / ``bucket`` / ``peer``; ``passed_over``, when present:
    why the latest step, which no source could deliver whole, was passed over for the step answered). The step is held from
    local retention until ``fetch_close`` ``{fetch}`` → ``{"released": bool}`` (an hour at most). Only the
    socket that asked for a fetch may wait for it or close it.
``protect`` ``{job, step, name}`` → ``{"protected", "before"}``: retention keeps ``step`` of ``job`` (on local
    disk and in the bucket) while ``name`` (a pointer file's path; moved from the step it protected
    ``before``, if any) protects it, and a memory-only ``step`` is persisted; ``unprotect`` ``{job, name}`` →
    ``{"protected": null, "before"}`` lets it go. Answered once recorded durably (:mod:`ckptd.daemon.protected`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Any

from .config import MAX_LOCAL_WORLD_SIZE, MAX_NAME_BYTES, MAX_PROTECTED_NAME, MAX_STEP, MAX_WORLD_SIZE, PEER_ADDRESS_RE, validate_job
from .errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20
MAX_ID = (1 << 63) - 1
MAX_NBYTES = 1 << 50  # one rank's shard
MAX_REPLICAS = 1 << 20
MAX_RING = 4096  # daemons (nodes) one job's ring may name

_INT = (int,)
_NUM = (int, float)
_STR = (str,)

SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {},
    # step null: named by the commit (a DCP async_save stages before it learns its checkpoint id)
    "alloc": {"job": _STR, "rank": _INT, "world_size": _INT, "step": (int, type(None)), "nbytes": _INT, "pid": _INT},
    "commit": {
        "job": _STR,
        "rank": _INT,
        "world_size": _INT,
        "step": _INT,
        "segment": _STR,
        "lease": _STR,
        "nbytes": _INT,
        "replicas": (dict,),
        "local_world_size": _INT,
    },  # fmt: skip
    "release": {"segment": _STR, "lease": _STR},
    "wait": {"job": _STR, "step": _INT, "timeout": _NUM},
    "replicated": {"job": _STR, "step": _INT, "timeout": _NUM},
    "latest": {"job": _STR},
    "status": {},
    "hot_open": {"job": _STR, "step": (int, type(None)), "pid": _INT},
    "hot_close": {"pin": _STR, "segments": (list,)},
    "fetch": {"job": _STR, "step": (int, type(None))},
    "fetch_wait": {"fetch": _INT, "timeout": _NUM},
    "fetch_close": {"fetch": _INT},
    "promote": {"job": _STR, "step": (int, type(None))},
    "protect": {"job": _STR, "step": _INT, "name": _STR},
    "unprotect": {"job": _STR, "name": _STR},
    "ring": {"job": _STR, "ring": (list,)},
}
# fields a request may leave out, and what they then are
OPTIONAL: dict[str, dict[str, tuple[tuple[type, ...], Any]]] = {
    # the step this client restored: a rolled-back run may save the numbers after it again
    # this launch's id (all its ranks share it): the daemon refuses a second live run saving the same job
    "wait": {"persist": ((bool,), True)},  # false: a step held in the memory tier only counts as done
    # wait false: refused at once when memory is short, never deferred (prepare() takes the slots that fit);
    # timeout: a deferred alloc is refused after this many seconds (0: it waits as long as its process lives);
    # warm: prepare() filling the pool before any snapshot: never makes room by dropping a memory-tier step
    # spare (with warm): the trainer warming the spare slot made for its rank, which the alloc's reply announced
    "alloc": {"wait": ((bool,), True), "timeout": ((int, float), 0), "warm": ((bool,), False), "spare": ((bool,), False)},
    "promote": {"persist": ((bool,), True)},
    "commit": {
        "after": ((int, type(None)), None),
        "run": ((int, type(None)), None),
        # the job's own tiering (null: the daemon's)
        "persist_every": ((int, type(None)), None),
        "persist_interval": ((int, float, type(None)), None),
    },
}
# the commit record the daemon keeps in shared memory beside a committed segment (read back after a crash): the fields
# of its JSON line, in the order written (:class:`CommitRecord`)
RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
    "job": _STR, "rank": _INT, "world_size": _INT, "local_world_size": _INT, "step": _INT, "nbytes": _INT,
    "replicas": (dict,), "committed_at": _INT, "run": (int, type(None)),
    "after": (int, type(None)),
}  # fmt: skip
_ENVELOPE = {"v", "op", "id"}
# closed ranges of the integer fields, wherever they appear
_RANGES = {
    "rank": (0, MAX_WORLD_SIZE - 1), "world_size": (1, MAX_WORLD_SIZE), "local_world_size": (1, MAX_LOCAL_WORLD_SIZE),
    "step": (0, MAX_STEP), "after": (0, MAX_STEP), "run": (1, MAX_ID), "nbytes": (0, MAX_NBYTES), "fetch": (1, MAX_ID),
    "committed_at": (0, MAX_ID), "persist_every": (1, 1 << 31),
}  # fmt: skip
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
_DIGEST_RE = re.compile(r"[0-9a-f]{16}")


class Source(StrEnum):
    """Where a restore's bytes come from: the daemon's shared memory, the local root, the bucket (or shared
    directory), a peer daemon's replica (pulled into the local root first)."""

    MEMORY = "memory"
    DISK = "disk"
    BUCKET = "bucket"
    PEER = "peer"

    def to_wire(self) -> str:
        """``fetch_wait``'s spelling (protocol version 1): ``local`` / ``remote`` / ``peer``."""
        return {Source.DISK: "local", Source.BUCKET: "remote", Source.PEER: "peer"}[self]

    @classmethod
    def from_wire(cls, value: str) -> Source:
        return {"local": cls.DISK, "remote": cls.BUCKET, "peer": cls.PEER}[value]


EXTRA_FRAMES = {"commit": 1}  # ops followed by raw frames (commit: the tree's JSON)


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def decode_request(frame: bytes) -> dict[str, Any]:
    """Parse and validate one request frame; raise :class:`ProtocolError` saying what is wrong."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        msg = json.loads(frame)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an integer of over 4,300 digits, deep nesting
        raise ProtocolError(f"message is not valid JSON: {str(e)[:200] or type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("message is not a JSON object")
    if not _is_int(msg.get("v")) or msg["v"] != PROTOCOL_VERSION:  # true and 1.0 are not version 1
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not supported (daemon speaks {PROTOCOL_VERSION})")
    op = msg.get("op")
    if not isinstance(op, str) or op not in SCHEMA:
        raise ProtocolError(f"unknown op {op!r}")
    if not _is_int(msg.get("id")):
        raise ProtocolError("field 'id' missing or not an integer")
    if not -MAX_ID <= msg["id"] <= MAX_ID:
        raise ProtocolError("field 'id' is not a 64-bit integer")
    optional = OPTIONAL.get(op, {})
    for name, (_, default) in optional.items():
        msg.setdefault(name, default)
    check_fields(f"op {op!r}", {**SCHEMA[op], **{k: t for k, (t, _) in optional.items()}}, msg, extra_ok=_ENVELOPE)
    return msg


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    """One rank's commit of a staged shard, as the daemon keeps it from the commit to the shard's persist (and beside the
    segment, through a crash). Built in two places only, each an edge where its fields were checked: from a validated
    ``commit`` request (``ckptd.daemon.commits``) and by :func:`validate_record` from a record read back from shared
    memory. Main thread, persist threads and the seal thread share it: nothing changes it.

    The file beside a committed segment (``<segment>.commit``, :meth:`ckptd.shm.SegmentDir.write_record`) is one line, the
    JSON object :meth:`fields` (compact separators, keys in :data:`RECORD_SCHEMA`'s order), then ``\\n``, then :attr:`tree`
    as it came.

    Attributes:
        job: the job, as it names the job's directory.
        rank: the rank whose shard the segment holds.
        world_size: how many ranks the step has.
        local_world_size: how many of the step's ranks this daemon serves (fewer than ``world_size``: multi-node).
        step: the step number.
        nbytes: how many bytes of the segment the shard is, header included.
        replicas: chunk id -> sample digest of each chunk other ranks hold too (never changed once built).
        committed_at: the commit's stamp in the job's commit order (ns since the epoch): it orders the job's steps.
        run: the launch that committed it (``None``: not named, or a record written before records named it).
        after: the step that launch last restored (``None``: none); with ``run``, the step's attempt.
        tree: the rank's non-tensor tree, the raw JSON the trainer sent, parsed on a persist or seal thread.
    """

    job: str
    rank: int
    world_size: int
    local_world_size: int
    step: int
    nbytes: int
    replicas: dict[str, str]
    committed_at: int
    run: int | None
    after: int | None
    tree: bytes

    def __repr__(self) -> str:  # never the tree nor every replica: it may be megabytes
        return f"CommitRecord({self.job!r} step {self.step} rank {self.rank}/{self.world_size}, {self.nbytes} bytes)"

    def fields(self) -> dict[str, Any]:
        """The record's JSON line as an object: every field but the tree, in :data:`RECORD_SCHEMA`'s order."""
        return {name: getattr(self, name) for name in RECORD_SCHEMA}


def validate_record(fields: Any, tree: bytes) -> CommitRecord:
    """A commit record read back from shared memory after a crash (its JSON line's object and the tree after it),
    checked like a ``commit`` message; one written before records named their attempt has no ``run`` and ``after``.

    Raises:
        ProtocolError: ``fields`` is not an object, or a field is missing, unknown, of the wrong type or out of bounds.
    """
    if not isinstance(fields, dict):
        raise ProtocolError("commit record is not a JSON object")
    fields = {"run": None, "after": None, **fields}
    check_fields("commit record", RECORD_SCHEMA, fields)
    return CommitRecord(**fields, tree=tree)


def check_fields(
    what: str, fields: dict[str, tuple[type, ...]], msg: dict[str, Any], extra_ok: frozenset[str] | set[str] = frozenset()
) -> None:
    """Every field of ``fields`` present with its type and within its bounds, and no other; ``ProtocolError`` naming it."""
    extra = set(msg) - (extra_ok or set()) - set(fields)
    if extra:
        raise ProtocolError(f"{what}: unknown fields {sorted(extra)[:8]}")
    for name, types in fields.items():
        if name not in msg:
            raise ProtocolError(f"{what}: missing field {name!r}")
        val = msg[name]
        ok = (
            _is_int(val)
            if types is _INT
            else isinstance(val, bool)
            if types == (bool,)
            else (isinstance(val, types) and not isinstance(val, bool))
        )
        if not ok:
            raise ProtocolError(f"{what}: field {name!r} has the wrong type ({type(val).__name__})")
        _check_value(what, name, val)
    if "world_size" in fields and msg.get("rank", 0) >= msg["world_size"]:
        raise ProtocolError(f"{what}: rank {msg.get('rank')} outside world_size {msg['world_size']}")
    if "local_world_size" in fields and msg["local_world_size"] > msg["world_size"]:
        raise ProtocolError(f"{what}: local_world_size {msg['local_world_size']} is not within 1..world_size ({msg['world_size']})")


def _controls(text: str) -> bool:
    return any(c < " " or "\x7f" <= c < "\xa0" for c in text)


def _check_value(what: str, name: str, val: Any) -> None:  # noqa: C901 - one case per field
    if name in _RANGES and val is not None:
        lo, hi = _RANGES[name]
        if not lo <= val <= hi:
            raise ProtocolError(f"{what}: field {name!r} = {val} is outside {lo}..{hi}")
    elif name == "pid" and not 1 <= val <= pid_max():
        raise ProtocolError(f"{what}: field 'pid' = {val} is not a process id (1..{pid_max()})")
    elif name == "job":
        try:
            validate_job(val)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
    elif name == "timeout" and not ((isinstance(val, int) or math.isfinite(val)) and val >= 0):
        raise ProtocolError(f"{what}: field 'timeout' must be a finite number >= 0")
    elif name == "persist_interval" and val is not None and not (math.isfinite(val) and 0 <= val <= 1e9):
        raise ProtocolError(f"{what}: field 'persist_interval' must be a number of seconds in 0..1e9")
    elif name in ("lease", "pin") and not _TOKEN_RE.fullmatch(val):
        raise ProtocolError(f"{what}: field {name!r} is not a token this daemon hands out")
    elif name == "name" and (not 0 < len(val) <= MAX_PROTECTED_NAME or "\0" in val or (what == "op 'protect'" and _controls(val))):
        # control characters: a name is printed by ckptd ls, where they would drive the operator's terminal (an older
        # daemon recorded some: unprotect still lets them go)
        raise ProtocolError(f"{what}: field 'name' must be 1..{MAX_PROTECTED_NAME} characters, without control characters")
    elif name == "segment" and len(val) > MAX_NAME_BYTES:
        raise ProtocolError(f"{what}: field 'segment' is longer than {MAX_NAME_BYTES} characters")
    elif name == "segments" and (len(val) > MAX_LOCAL_WORLD_SIZE or not all(isinstance(v, str) and len(v) <= MAX_NAME_BYTES for v in val)):
        raise ProtocolError(f"{what}: field 'segments' must be at most {MAX_LOCAL_WORLD_SIZE} segment names")
    elif name == "ring" and (
        not 2 <= len(val) <= MAX_RING
        or not all(isinstance(v, str) and PEER_ADDRESS_RE.fullmatch(v) for v in val)
        or len(set(val)) < len(val)
    ):
        raise ProtocolError(f"{what}: 'ring' must list 2..{MAX_RING} distinct daemons' peer addresses, each tcp://HOST:PORT")
    elif name == "replicas" and (
        len(val) > MAX_REPLICAS or not all(len(k) <= 4096 and isinstance(d, str) and _DIGEST_RE.fullmatch(d) for k, d in val.items())
    ):
        raise ProtocolError(f"{what}: 'replicas' must map at most {MAX_REPLICAS} chunk ids to 16-digit digests")


@cache
def pid_max() -> int:
    """The kernel's largest process id (``/proc/sys/kernel/pid_max``; 2**22 where unreadable)."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 22


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def request(op: str, req_id: int, **fields: Any) -> bytes:
    return encode({"v": PROTOCOL_VERSION, "op": op, "id": req_id, **fields})


def reply_ok(req_id: Any, **fields: Any) -> bytes:
    """An answer; the daemon adds ``instance`` (its id, drawn at start: a client tells a daemon that replaced the one it
    talked to on the endpoint by it)."""
    return encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": True, **fields})


REPLY_ENVELOPE = frozenset({"v", "id", "ok", "instance"})


def reply_fields(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply without its envelope: what the op answered (``ckptd status --json`` prints it)."""
    return {k: v for k, v in reply.items() if k not in REPLY_ENVELOPE}


def reply_error(req_id: Any, code: str, error: str) -> bytes:
    return encode({"v": PROTOCOL_VERSION, "id": req_id if _is_int(req_id) else None, "ok": False, "code": code, "error": error})


def endpoint_answers(ctx: Any, endpoint: str, timeout: float) -> bool:
    """Whether a daemon answers ``hello`` at ``endpoint`` within ``timeout`` seconds (a fresh socket)."""
    return hello_reply(ctx, endpoint, timeout) is not None


def hello_reply(ctx: Any, endpoint: str, timeout: float) -> dict[str, Any] | None:
    """The ``hello`` reply of the daemon at ``endpoint`` (its root, pid and ``instance``, an id drawn at each start),
    on a fresh socket, or ``None`` when none comes within ``timeout`` seconds; an answer that is not a reply counts as
    one (a daemon answers), with no fields."""
    import zmq

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send(request("hello", 0))
        if not s.poll(int(timeout * 1000)):
            return None
        try:
            return decode_reply(s.recv())
        except ProtocolError:
            return {}
    finally:
        s.close(0)


def decode_reply(frame: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(frame)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"daemon sent a reply that is not JSON: {str(e)[:200] or type(e).__name__}") from None
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION or not isinstance(msg.get("ok"), bool):
        raise ProtocolError(f"daemon sent a malformed reply: {str(msg)[:200]}")
    return msg
