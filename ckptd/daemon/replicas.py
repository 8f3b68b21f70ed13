"""The replica store: what peer daemons replicate into this one (``--peer-listen``), held in shared memory.

A peer sends a step as it would upload it to a bucket (its files, then its manifest last: :mod:`ckptd.storage.peer`);
this daemon keeps each object in a segment of its own (objects under :data:`SMALL_BYTES` in its memory), within
``replica_budget`` bytes, a share of the shared-memory budget set aside for replicas (the slot pool has the rest:
a peer's replicas never take room a local snapshot needs). Per job it keeps the step whose manifest arrived last
and the ones still arriving; a step whose manifest lands makes the job's other complete steps go. A put that does
not fit is refused, saying so (the sender reports the step as not replicated); an upload nobody finishes lapses
after :data:`UPLOAD_IDLE_S`.

Who may send: only a peer that holds the cluster's key (:mod:`ckptd.peerkey`). The socket is a CurveZMQ server,
and a ZAP handler admits exactly the key's public key, so a connection without the secret fails in the handshake,
before a byte of its messages is read. Each request is validated (:mod:`ckptd.peerwire`): keys of the bucket layout
only (no path is ever made from them), every chunk's XXH3-64 checked before it is stored and acknowledged, writes
within the size the put declared, uploads bounded in number. Replicas are not kept across a restart of this daemon
(its segments are removed at shutdown; a crash leaves them to the next start's recovery, which removes them).

One thread (``ckptd-peers``) owns the socket and the objects; :meth:`ReplicaServer.summary` (status) takes its lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from .. import peerwire, shm
from ..errors import CheckpointError, ProtocolError
from ..format import commit_time, digest
from ..layout import MANIFEST
from ..peerkey import PeerKey

log = logging.getLogger("ckptd.daemon")

SMALL_BYTES = 256 << 10  # objects below this are kept in the daemon's memory, not a segment of their own
UPLOAD_IDLE_S = 120.0  # an upload with no chunk for this long is given up and its room freed
MAX_UPLOADS = 256  # uploads open at once, all peers together
POLL_MS = 500
ZAP_DOMAIN = "ckptd-peers"


@dataclass
class Obj:
    """One object: in a segment (``name``, mapped at ``mm``) or in memory (``data``)."""

    size: int
    room: int  # what it takes from the budget
    name: str | None = None
    mm: mmap.mmap | None = None
    data: bytearray | None = None
    tag: str = ""
    seq: int = 0  # publication order

    def view(self) -> memoryview:
        return memoryview(self.mm if self.mm is not None else self.data)[: self.size]  # type: ignore[arg-type]


@dataclass
class Upload:
    key: str
    obj: Obj
    ident: bytes
    pos: int = 0
    last: float = field(default_factory=time.monotonic)


class _OnlyTheClusterKey:
    """The ZAP check: a CURVE client is admitted only with the cluster's public key (which only a holder of its
    secret can present)."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.public
        if not ok:
            log.warning("refused a peer connection with an unknown key %s", key.decode(errors="replace"))
        return ok


class ReplicaServer:
    """Serves ``listen`` (``tcp://ADDR:PORT``) on its own thread: :meth:`start`, then :meth:`shutdown`."""

    def __init__(self, listen: str, key: PeerKey, segments: shm.SegmentDir, budget: int,
                 initializer: Callable[[], None] = lambda: None, published: Callable[[str], None] = lambda key: None) -> None:  # fmt: skip
        """``initializer``: run first on the thread (the daemon's lowers its priority: the thread, and the ZeroMQ and
        ZAP threads it starts, which decrypt every byte, yield the CPU to training). ``published(key)``: called once an
        object is in place, on the thread that put it (:meth:`.mesh.Mesh.published` decides there)."""
        self.listen, self.budget = listen, budget
        self._key, self._segments, self._init, self._published = key, segments, initializer, published
        self._lock = threading.Lock()  # objects, uploads and counters: the thread writes, status reads
        self.objects: dict[str, Obj] = {}
        self.uploads: dict[int, Upload] = {}
        self.used = 0  # budget taken: complete objects and uploads under way
        self.counters = {"bytes_received": 0, "objects_received": 0, "refused": 0, "bad_chunks": 0, "bad_requests": 0}
        self._ids = itertools.count(1)
        self._tags = itertools.count(1)
        self._running = False
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._bind_error: str | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the thread and wait until it is bound: an address taken fails the daemon's start, naming it."""
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="ckptd-peers", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            self._thread.join()
            raise CheckpointError(f"cannot listen for peers on {self.listen}: {self._bind_error}")
        log.info("listening for peers on %s (replica budget %.2f GB)", self.listen, self.budget / 1e9)

    def shutdown(self) -> None:
        """Stop serving and let every replica go (its segment unlinked)."""
        self._running = False
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            for up in self.uploads.values():
                self._free(up.obj)
            for obj in self.objects.values():
                self._free(obj)
            self.uploads.clear()
            self.objects.clear()
            self.used = 0

    def _bind(self, ctx: zmq.Context) -> tuple[zmq.Socket, Any] | None:
        """The server socket, bound, behind the ZAP check; ``None`` (and ``_bind_error`` set) if it cannot bind."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("ckptd.zap"))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_OnlyTheClusterKey(self._key.public))
        s = ctx.socket(zmq.ROUTER)
        s.linger = 0
        s.curve_server = True
        s.curve_secretkey, s.curve_publickey = self._key.secret, self._key.public
        s.zap_domain = ZAP_DOMAIN.encode()
        s.rcvhwm = s.sndhwm = 64
        try:
            s.bind(self.listen)
        except zmq.ZMQError as e:
            s.close(0)
            auth.stop()
            self._bind_error = e.strerror
            return None
        endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1]) if endpoint.startswith("tcp://") else None
        return s, auth

    def _serve(self) -> None:
        self._init()
        ctx = zmq.Context()  # its own I/O thread, started from this one: it inherits this thread's priority
        try:
            bound = self._bind(ctx)
            self._bound.set()
            if bound is None:
                return
            sock, auth = bound
            try:
                self._loop(sock)
            finally:
                sock.close(0)
                auth.stop()
        finally:
            self._bound.set()
            ctx.term()

    def _loop(self, sock: zmq.Socket) -> None:
        last_sweep = time.monotonic()
        while self._running:
            if sock.poll(POLL_MS):
                for _ in range(64):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(sock, frames)
            now = time.monotonic()
            if now - last_sweep >= 5.0:
                last_sweep = now
                self._lapse(now)

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        ident, rest = frames[0], frames[1:]
        rid: int | None = None
        try:
            msg, data = peerwire.decode_request(rest)
            rid = msg["id"]
            out, payload = getattr(self, f"_op_{msg['op']}")(ident, msg, data)
            reply = [ident, peerwire.reply_ok(rid, **out)] + ([payload] if payload is not None else [])
        except ProtocolError as e:
            with self._lock:
                self.counters["bad_requests"] += 1
            reply = [ident, peerwire.reply_error(rid, str(e), "bad_request")]
        except CheckpointError as e:
            with self._lock:
                self.counters["refused"] += 1
            reply = [ident, peerwire.reply_error(rid, str(e))]
        except Exception as e:  # a bug must not end the thread (every other peer's replicas)
            log.exception("peer request failed")
            reply = [ident, peerwire.reply_error(rid, f"{type(e).__name__}: {e}", "internal")]
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart(reply, zmq.NOBLOCK, copy=False)

    # ------------------------------------------------------------------ storage

    def _make(self, size: int) -> Obj:
        """Room for an object of ``size`` bytes, taken from the budget; ``CheckpointError`` when it does not fit."""
        room = size if size < SMALL_BYTES else -(-size // shm.ALIGN) * shm.ALIGN
        with self._lock:
            if self.used + room > self.budget:
                raise CheckpointError(
                    f"no room for a replica of {size} bytes: {self.used} of this daemon's replica budget of {self.budget} bytes"
                    " are held (raise replica_budget on this node, or replicate fewer steps to it)"
                )
            self.used += room
        if size < SMALL_BYTES:
            return Obj(size, room, data=bytearray(size))
        try:
            name, _ = self._segments.create(size)
            fd = self._segments.open_owned(name, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, room)
            finally:
                os.close(fd)
        except (CheckpointError, OSError) as e:
            with self._lock:
                self.used -= room
            raise CheckpointError(f"cannot hold a replica of {size} bytes: {e}") from None
        return Obj(size, room, name=name, mm=mm)

    def _free(self, obj: Obj) -> None:
        """Let ``obj`` go (lock held by the caller, or none needed: shutdown)."""
        self.used -= obj.room
        if obj.mm is not None:
            obj.mm.close()
        if obj.name is not None:
            self._segments.unlink(obj.name)

    def _publish(self, key: str, obj: Obj) -> str:
        """``obj`` becomes ``key`` (replacing one of that key); a manifest makes the job's other complete steps go."""
        obj.seq = next(self._tags)
        obj.tag = f"{obj.seq:x}"
        with self._lock:
            old = self.objects.pop(key, None)
            if old is not None:
                self._free(old)
            self.objects[key] = obj
            self.counters["objects_received"] += 1
            if key.endswith("/" + MANIFEST) and key.count("/") == 2:
                self._drop_others(key)
        self._published(key)
        return obj.tag

    # ------------------------------------------------------------------ this daemon's own objects (any thread)

    def adopt_segment(self, key: str, segment: str, size: int) -> None:
        """Serve ``size`` bytes of this daemon's own segment ``segment`` as ``key``, by reference (no copy, nothing of
        the replica budget): a node's own part of a step that spans nodes, in the slots that hold it. A slot reused
        meanwhile serves other bytes: the reader's checksums catch that, as for any damaged copy."""
        fd = self._segments.open_owned(segment)
        try:
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._publish(peerwire.check_key(key), Obj(size, 0, mm=mm))

    def adopt_bytes(self, key: str, data: bytes) -> None:
        """Keep ``data`` as ``key`` (a fragment or a manifest this daemon made), within the replica budget."""
        obj = self._make(len(data))
        obj.view()[:] = data
        self._publish(peerwire.check_key(key), obj)

    def read(self, key: str, limit: int) -> bytes | None:
        """The bytes of ``key`` (at most ``limit``: a bigger object is ``None``, as is a missing one)."""
        with self._lock:
            obj = self.objects.get(key)
            return None if obj is None or obj.size > limit else bytes(obj.view())

    def names(self, prefix: str) -> set[str]:
        """The keys held under ``prefix``."""
        with self._lock:
            return {k for k in self.objects if k.startswith(prefix)}

    def _drop_others(self, manifest_key: str) -> None:
        """A step of a job completed here: of the job's complete steps only the one committed last stays, and the
        job's incomplete steps whose every object came before this step's first are dropped: their sender moved on
        (a step superseded while it was sent). Lock held."""
        job = manifest_key.split("/", 1)[0]
        steps: dict[str, list[str]] = {}
        for k in self.objects:
            if k.startswith(job + "/"):
                steps.setdefault(k.split("/")[1], []).append(k)
        done = {part: self._order(f"{job}/{part}/{MANIFEST}") for part, keys in steps.items() if f"{job}/{part}/{MANIFEST}" in keys}
        keep = max(done, key=done.__getitem__)
        first = min(self.objects[k].seq for k in steps[manifest_key.split("/")[1]])
        for part, keys in steps.items():
            stale = part in done and part != keep
            abandoned = part not in done and max(self.objects[k].seq for k in keys) < first
            if stale or abandoned:
                for k in keys:
                    self._free(self.objects.pop(k))
                log.info("replica of %s %s dropped: %s", job, part, f"{keep} was committed later" if stale else "never completed")

    def _order(self, manifest_key: str) -> tuple[int, int]:
        """A complete step's place in commit order: its manifest's ``committed_at``, then its number."""
        return commit_time(bytes(self.objects[manifest_key].view())), int(manifest_key.split("/")[1].removeprefix("step-"))

    def _lapse(self, now: float) -> None:
        with self._lock:
            for uid in [u for u, up in self.uploads.items() if now - up.last > UPLOAD_IDLE_S]:
                up = self.uploads.pop(uid)
                log.warning("gave up the replica upload of %s: no data for %.0f s", up.key, UPLOAD_IDLE_S)
                self._free(up.obj)

    # ------------------------------------------------------------------ ops: each returns (answer fields, data frame)

    def _op_ping(self, ident: bytes, msg: dict[str, Any], data: bytes | None) -> tuple[dict[str, Any], bytes | None]:
        return {}, None

    def _op_put(self, ident: bytes, msg: dict[str, Any], data: bytes | None) -> tuple[dict[str, Any], bytes | None]:
        if len(self.uploads) >= MAX_UPLOADS:
            raise CheckpointError(f"{MAX_UPLOADS} replica uploads are open already; try again later")
        obj = self._make(msg["size"])
        uid = next(self._ids)
        with self._lock:
            self.uploads[uid] = Upload(msg["key"], obj, ident)
        return {"upload": uid}, None

    def _upload(self, ident: bytes, uid: int) -> Upload:
        up = self.uploads.get(uid)
        if up is None or up.ident != ident:  # another connection's upload is not this one's to write or end
            raise ProtocolError(f"no upload {uid} open on this connection")
        return up

    def _op_chunk(self, ident: bytes, msg: dict[str, Any], data: bytes | None) -> tuple[dict[str, Any], bytes | None]:
        up = self._upload(ident, msg["upload"])
        assert data is not None
        if msg["offset"] != up.pos or up.pos + len(data) > up.obj.size:
            raise ProtocolError(f"chunk at {msg['offset']} of {len(data)} bytes: expected offset {up.pos} within {up.obj.size} bytes")
        if digest(data) != msg["xxh3"]:
            with self._lock:
                self.counters["bad_chunks"] += 1
            raise CheckpointError(f"chunk at {msg['offset']} of {up.key} arrived damaged (its XXH3-64 does not match); send it again")
        up.obj.view()[up.pos : up.pos + len(data)] = data
        up.pos += len(data)
        up.last = time.monotonic()
        with self._lock:
            self.counters["bytes_received"] += len(data)
        return {}, None

    def _op_end(self, ident: bytes, msg: dict[str, Any], data: bytes | None) -> tuple[dict[str, Any], bytes | None]:
        up = self._upload(ident, msg["upload"])
        if up.pos != up.obj.size:
            raise ProtocolError(f"upload of {up.key} ended at {up.pos} of {up.obj.size} bytes")
        with self._lock:
            del self.uploads[msg["upload"]]
        return {"tag": self._publish(up.key, up.obj)}, None

    def _op_abort(self, ident: bytes, msg: dict[str, Any], data: bytes | None) -> tuple[dict[str, Any], bytes | None]:
        up = self._upload(ident, msg["upload"])
        with self._lock:
            del self.uploads[msg["upload"]]
            self._free(up.obj)
        return {}, None

    def _op_list(self, ident: bytes, msg: dict[str, Any], data: bytes | None) -> tuple[dict[str, Any], bytes | None]:
        with self._lock:
            found = {k: [o.tag, o.size] for k, o in self.objects.items() if k.startswith(msg["prefix"])}
        if len(found) > peerwire.MAX_LIST:
            raise CheckpointError(f"more than {peerwire.MAX_LIST} replicas under {msg['prefix']!r}: list a narrower prefix")
        return {"objects": found}, None

    def _op_get(self, ident: bytes, msg: dict[str, Any], data: bytes | None) -> tuple[dict[str, Any], bytes | None]:
        with self._lock:  # copied under the lock: another thread may let the object go (a later step of its job, adopted)
            obj = self.objects.get(msg["key"])
            if obj is None:
                raise CheckpointError(f"no object {msg['key']} here")
            start = min(msg["offset"], obj.size)
            out = bytes(obj.view()[start : start + min(msg["length"], peerwire.CHUNK_BYTES)])
        return {"size": obj.size, "tag": obj.tag, "xxh3": digest(out)}, out

    def _op_delete(self, ident: bytes, msg: dict[str, Any], data: bytes | None) -> tuple[dict[str, Any], bytes | None]:
        with self._lock:
            for k in msg["keys"]:
                obj = self.objects.pop(k, None)
                if obj is not None:
                    self._free(obj)
        return {}, None

    # ------------------------------------------------------------------ status

    def summary(self) -> dict[str, Any]:
        with self._lock:
            steps: dict[str, list[int]] = {}
            for k in self.objects:
                job, part, name = k.split("/", 2)
                if name == MANIFEST:
                    steps.setdefault(job, []).append(int(part.removeprefix("step-")))
            return {
                "listen": self.listen,
                "replica_budget": self.budget,
                "replica_bytes": self.used,
                "uploads_open": len(self.uploads),
                "steps_held": {j: sorted(s) for j, s in steps.items()},
                **self.counters,
            }
