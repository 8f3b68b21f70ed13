"""A peer daemon's replica store, as an :class:`~ckptd.storage.store.ObjectStore`: the sending and the pulling side
of a peer link (:mod:`ckptd.peerwire`).

A step is replicated to a peer exactly as it is uploaded to a bucket (:func:`~ckptd.storage.remote.upload_step`:
its files, then its manifest last, so a step without a manifest is incomplete there too) and pulled back exactly as
it is downloaded (:func:`~ckptd.storage.remote.download_step`: every file's size and every chunk's checksum checked
before the step enters the root). What this module adds is the link: a DEALER socket, CurveZMQ with the cluster's
key (a peer that does not hold it never completes the handshake), requests answered in order by id, each chunk
carrying its XXH3-64, which the peer checks before it acknowledges; a window of chunks in flight, a shared
:class:`Pacer` for ``--replicate-rate-limit``, and a timeout on every answer (a peer that is down or stalls is an
error naming it, never a hang).

Any thread: one lock serializes the socket's requests.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from .. import peerwire
from ..errors import CheckpointError, FormatError, ProtocolError
from ..format import digest
from ..peerkey import PeerKey
from .store import Progress

log = logging.getLogger("ckptd.daemon")

WINDOW = 8  # chunks in flight per upload
TIMEOUT_S = 30.0  # the longest a peer may take to answer one request
CONNECT_TIMEOUT_S = 3.0  # the longest a request waits for a connection (a peer down, or holding another key, fails fast)


class PeerError(CheckpointError):
    """A peer did not answer, refused, or answered nonsense."""


class Pacer:
    """At most ``rate`` bytes per second through :meth:`take` from every thread together (0: no limit)."""

    def __init__(self, rate: float = 0.0, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self._clock, self._sleep = float(rate), clock, sleep
        self._next = clock()  # when the next byte may go
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = self._clock()
            start = max(self._next, now - 0.1)  # a link idle for a while gets no burst past 0.1 s worth
            self._next = start + nbytes / self.rate
            ahead = start - now
        if ahead > 0:
            self._sleep(ahead)


class _Listed(abc.ABC):
    """The listings of an ObjectStore, from its ``list_sized``."""

    @abc.abstractmethod
    def list_sized(self, rel_prefix: str = "") -> dict[str, tuple[str, int]]:
        """Every object under ``rel_prefix``: key -> (tag, size)."""

    def list_tagged(self, rel_prefix: str = "") -> dict[str, str]:
        return {k: tag for k, (tag, _) in self.list_sized(rel_prefix).items()}

    def list(self, rel_prefix: str = "") -> list[str]:
        return sorted(self.list_sized(rel_prefix))

    def exists(self, rel: str) -> bool:
        return rel in self.list_sized(rel)


class PeerStore(_Listed):
    """The replica store of the daemon at ``endpoint`` (``tcp://HOST:PORT``, its ``--peer-listen``)."""

    def __init__(self, endpoint: str, key: PeerKey, *, pacer: Pacer | None = None, timeout: float = TIMEOUT_S,
                 ctx: zmq.Context | None = None) -> None:  # fmt: skip
        self.endpoint, self._key, self.timeout = endpoint, key, timeout
        self._pacer = pacer or Pacer()
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.Context()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None

    # ------------------------------------------------------------------ the link

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.linger = 0
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = self._key.secret, self._key.public, self._key.public
            s.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a peer that is not connected: a send times out instead
            s.sndtimeo = int(min(self.timeout, CONNECT_TIMEOUT_S) * 1000)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def _reset(self) -> None:
        """Drop the socket (and whatever it had queued, answers to requests given up on included)."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _send(self, op: str, data: Any = None, **fields: Any) -> int:
        rid = next(self._ids)
        frames = [peerwire.request(op, rid, **fields)] + ([data] if data is not None else [])
        try:
            self._socket().send_multipart(frames, copy=data is None or len(data) < 65536)
        except zmq.Again:
            self._reset()
            raise PeerError(f"peer {self.endpoint} is not connected (down, unreachable, or not holding this cluster's peer key)") from None
        return rid

    def _recv(self, rid: int) -> tuple[dict[str, Any], bytes | None]:
        sock = self._socket()
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                self._reset()
                raise PeerError(f"peer {self.endpoint} did not answer within {self.timeout:.0f} s")
            frames = sock.recv_multipart()
            try:
                msg = peerwire.decode_reply(frames[0])
            except ProtocolError as e:
                self._reset()
                raise PeerError(f"peer {self.endpoint}: {e}") from None
            if msg.get("id") != rid:
                continue  # the answer to a request given up on
            if not msg["ok"]:
                raise PeerError(f"peer {self.endpoint} refused: {msg['error']}")
            return msg, frames[1] if len(frames) > 1 else None

    def _call(self, op: str, data: Any = None, **fields: Any) -> tuple[dict[str, Any], bytes | None]:
        with self._lock:
            return self._recv(self._send(op, data, **fields))

    # ------------------------------------------------------------------ ObjectStore

    def url(self, rel: str = "") -> str:
        return f"{self.endpoint}/{rel}" if rel else self.endpoint

    def check(self) -> None:
        self._call("ping")

    def put_file(self, rel: str, path: str, progress: Progress | None = None) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            self._put(rel, size, lambda off, n: os.pread(fd, n, off), progress)
        finally:
            os.close(fd)

    def put_bytes(self, rel: str, data: Any) -> None:
        """Also a ``memoryview`` of memory others may write meanwhile (a shared-memory segment): each chunk is copied
        out before its checksum is taken, so the bytes sent are the bytes checksummed (the caller checks afterwards
        that the memory still held what it meant to send)."""
        view = memoryview(data).cast("B")
        self._put(rel, len(view), lambda off, n: bytes(view[off : off + n]), None)

    def put_bytes_if(self, rel: str, data: bytes, tag: str | None) -> bool:
        raise CheckpointError("a peer's replica store takes no conditional writes (multi-node steps complete through the bucket)")

    def delete_if(self, rel: str, tag: str) -> bool:
        raise CheckpointError("a peer's replica store takes no conditional deletes")

    def _put(self, rel: str, size: int, read: Callable[[int, int], Any], progress: Progress | None) -> None:
        """Stream one object: ``put``, then its chunks (at most :data:`WINDOW` unanswered), then ``end``."""
        peerwire.check_key(rel)
        with self._lock:
            upload = self._recv(self._send("put", key=rel, size=size))[0].get("upload")
            if not isinstance(upload, int) or isinstance(upload, bool):
                raise PeerError(f"peer {self.endpoint} answered put without an upload id")
            try:
                pending: list[int] = []
                for off in range(0, size, peerwire.CHUNK_BYTES):
                    chunk = read(off, min(peerwire.CHUNK_BYTES, size - off))
                    self._pacer.take(len(chunk))
                    pending.append(self._send("chunk", chunk, upload=upload, offset=off, xxh3=digest(chunk)))
                    if progress is not None:
                        progress(len(chunk))
                    if len(pending) >= WINDOW:
                        self._recv(pending.pop(0))
                for rid in pending:
                    self._recv(rid)
                self._recv(self._send("end", upload=upload))
            except BaseException:
                if self._sock is not None:  # still connected: the peer frees the upload's room now, not when it lapses
                    with contextlib.suppress(CheckpointError):
                        self._send("abort", upload=upload)
                raise

    def list_sized(self, rel_prefix: str = "") -> dict[str, tuple[str, int]]:
        msg, _ = self._call("list", prefix=rel_prefix)
        objs = msg.get("objects")
        if not isinstance(objs, dict):
            raise PeerError(f"peer {self.endpoint} answered list without objects")
        out = {}
        for key, val in objs.items():
            if not (isinstance(val, list) and len(val) == 2 and isinstance(val[0], str) and type(val[1]) is int and val[1] >= 0):
                raise PeerError(f"peer {self.endpoint} listed {key!r} with a bad tag or size")
            if not key.startswith(rel_prefix):
                raise PeerError(f"peer {self.endpoint} listed {key!r}, outside {rel_prefix!r}")
            out[peerwire.check_key(key)] = (val[0], val[1])
        return out

    def _get(self, rel: str, offset: int, length: int) -> tuple[bytes, int]:
        """Up to ``length`` bytes of ``rel`` from ``offset``, checked against the checksum the peer sent, and its size."""
        with self._lock:
            return self._received(rel, length, self._send("get", key=rel, offset=offset, length=min(length, peerwire.CHUNK_BYTES)))

    def _received(self, rel: str, length: int, rid: int) -> tuple[bytes, int]:
        """The answer to get request ``rid`` (at most ``length`` bytes of ``rel``), checked; lock held."""
        try:
            msg, data = self._recv(rid)
        except PeerError as e:
            if "no object" in str(e):
                raise FileNotFoundError(rel) from None
            raise
        size = msg.get("size")
        if data is None or type(size) is not int or len(data) > length or msg.get("xxh3") != digest(data):
            raise PeerError(f"peer {self.endpoint} sent {rel} damaged (its checksum does not match)")
        return data, size

    def get_head(self, rel: str, nbytes: int) -> tuple[bytes, int]:
        out, size, pos = bytearray(), 0, 0
        while True:
            data, size = self._get(rel, pos, nbytes - pos)
            out += data
            pos += len(data)
            if pos >= min(nbytes, size) or not data:
                return bytes(out), size

    def get_bytes(self, rel: str, limit: int | None = None) -> bytes:
        head, size = self.get_head(rel, limit + 1 if limit is not None else peerwire.MAX_OBJECT_BYTES)
        if limit is not None and size > limit:
            raise FormatError(f"{self.url(rel)} is {size} bytes, more than the {limit} it may be")
        return head

    def get_file(self, rel: str, path: str, progress: Progress | None = None, limit: int | None = None) -> None:
        """Chunk by chunk, :data:`WINDOW` requests in flight, each chunk checked against its checksum as it arrives."""
        tmp = f"{path}.part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with self._lock:
                self._pull(rel, fd, progress, limit)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, path)

    def _pull(self, rel: str, fd: int, progress: Progress | None, limit: int | None) -> None:
        chunk = peerwire.CHUNK_BYTES
        data, size = self._received(rel, chunk, self._send("get", key=rel, offset=0, length=chunk))
        if limit is not None and size > limit:
            raise FormatError(f"{self.url(rel)} is {size} bytes, more than the {limit} it may be")
        pending: collections.deque[tuple[int, int, int]] = collections.deque()
        pos = ask = len(data)
        os.pwrite(fd, data, 0)
        if progress is not None:
            progress(len(data))
        while pos < size:
            while ask < size and len(pending) < WINDOW:
                n = min(chunk, size - ask)
                pending.append((self._send("get", key=rel, offset=ask, length=n), ask, n))
                ask += n
            rid, off, n = pending.popleft()
            data, now = self._received(rel, n, rid)
            if now != size or len(data) != n:
                raise PeerError(f"peer {self.endpoint}: {rel} changed while it was read ({size} bytes, then {now})")
            os.pwrite(fd, data, off)
            pos += n
            if progress is not None:
                progress(n)

    def delete(self, rels: list[str]) -> None:
        for i in range(0, len(rels), peerwire.MAX_DELETE):
            self._call("delete", keys=rels[i : i + peerwire.MAX_DELETE])

    def abort_unfinished(self) -> int:
        return 0  # a peer lets an upload nobody finishes lapse itself

    def close(self) -> None:
        with self._lock:
            self._reset()
        if self._own_ctx:
            self._ctx.term()


class PeerUnion(_Listed):
    """The replica stores of a job's daemons read as one store: a step that spans nodes (:mod:`ckptd.daemon.mesh`) has
    its manifest and fragments on every daemon of the job and each node's shards on that node and its next K, so no one
    of them holds it whole. A listing merges theirs (a name several hold keeps the first's tag and size; a daemon that
    cannot be asked is skipped with a warning: the node lost is one of them); a read goes to the first daemon that
    listed the name and to the next on any error. Verifying what comes back is the reader's
    (:func:`~ckptd.storage.remote.download_step`), as for a bucket. Read-only. Any thread."""

    def __init__(self, stores: list[PeerStore]) -> None:
        self.stores = list(stores)
        self._lock = threading.Lock()
        self._where: dict[str, list[PeerStore]] = {}  # name -> the daemons that listed it, by the latest listing

    def url(self, rel: str = "") -> str:
        ring = ",".join(s.endpoint.removeprefix("tcp://") for s in self.stores)
        return f"peers:{ring}/{rel}" if rel else f"peers:{ring}"

    def check(self) -> None:
        self.list_sized("")

    def rotations(self) -> list[PeerUnion]:
        """This union, then the same daemons asked in each other order of precedence: a step that failed its checksums
        read through one is read again through the next, each file from another daemon first (a bad copy is one
        daemon's; another may hold the same file whole)."""
        return [self] + [PeerUnion(self.stores[k:] + self.stores[:k]) for k in range(1, len(self.stores))]

    def list_sized(self, rel_prefix: str = "") -> dict[str, tuple[str, int]]:
        out: dict[str, tuple[str, int]] = {}
        where: dict[str, list[PeerStore]] = {}
        errors = []
        for store in self.stores:
            try:
                listed = store.list_sized(rel_prefix)
            except CheckpointError as e:
                errors.append(str(e))
                continue
            for name, got in listed.items():
                out.setdefault(name, got)
                where.setdefault(name, []).append(store)
        if len(errors) == len(self.stores):
            raise PeerError(f"no daemon of the job answered: {'; '.join(errors)}")
        with self._lock:
            self._where.update(where)
        return out

    def _read(self, rel: str, read: Callable[[PeerStore], Any]) -> Any:
        """``read(store)`` from the daemons that listed ``rel`` (every daemon when none did yet), the next after a failure."""
        with self._lock:
            listed = list(self._where.get(rel, ()))
        errors: list[str] = []
        for store in listed + [s for s in self.stores if s not in listed]:
            try:
                return read(store)
            except FileNotFoundError:
                continue
            except CheckpointError as e:
                errors.append(str(e))
        if errors:
            raise PeerError(f"no daemon of the job could send {rel}: {'; '.join(errors)}")
        raise FileNotFoundError(errno.ENOENT, f"no daemon of the job ({', '.join(s.endpoint for s in self.stores)}) holds it", rel)

    def get_head(self, rel: str, nbytes: int) -> tuple[bytes, int]:
        return self._read(rel, lambda s: s.get_head(rel, nbytes))

    def get_bytes(self, rel: str, limit: int | None = None) -> bytes:
        return self._read(rel, lambda s: s.get_bytes(rel, limit))

    def get_file(self, rel: str, path: str, progress: Progress | None = None, limit: int | None = None) -> None:
        self._read(rel, lambda s: s.get_file(rel, path, progress, limit))

    def delete(self, rels: list[str]) -> None:
        """Nothing is deleted: a step read whole through the union that fails its checksums came from several daemons,
        and which copy is bad is not known (each daemon's own copy of its part is, most likely, good)."""
        log.warning("a step read from the daemons %s failed verification; their copies are kept", self.url())

    def put_file(self, rel: str, path: str, progress: Progress | None = None) -> None:
        raise CheckpointError("the job's daemons are read here as one store: nothing is written through it")

    def put_bytes(self, rel: str, data: Any) -> None:
        raise CheckpointError("the job's daemons are read here as one store: nothing is written through it")

    def put_bytes_if(self, rel: str, data: bytes, tag: str | None) -> bool:
        raise CheckpointError("the job's daemons are read here as one store: nothing is written through it")

    def delete_if(self, rel: str, tag: str) -> bool:
        raise CheckpointError("the job's daemons are read here as one store: no conditional deletes")

    def abort_unfinished(self) -> int:
        return 0

    def close(self) -> None:
        """The stores are the caller's (:class:`~ckptd.daemon.mesh.Mesh` keeps one link per daemon)."""
