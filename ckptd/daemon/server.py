"""The node daemon's loop: a ZeroMQ ROUTER socket, an explicit op table, the events its worker threads report,
housekeeping, and its lifecycle (bind, recover, serve, shut down).

Threads: the main thread runs this loop and owns every table — the slot pool (:mod:`.slots`), the step table
(:mod:`.steps`), fetches (:mod:`.fetcher`) — and never blocks on disk or network. Persist threads (:mod:`.persister`),
the upload thread (:mod:`.uploader`) and the fetch thread report back through :mod:`.events`. Nothing here talks to
the trainers' process groups, and nothing in this package imports torch. Which step is complete, and which one a
restore reads, is the catalog's (:mod:`.catalog`) answer.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from .. import shm, version
from ..config import HOUSEKEEPING_S, WAIT_CAP_S, DaemonConfig, default_shm_budget
from ..errors import CheckpointError, DaemonBusy, ProtocolError
from ..peerkey import PeerKey, load_key
from ..protocol import EXTRA_FRAMES, Source, decode_request, reply_error, reply_ok
from ..storage import local
from ..storage.peer import Pacer, PeerStore
from ..storage.retention import AnyOf, Protect, RetentionPolicy
from ..storage.store import ObjectStore, open_store
from . import inbox, recovery
from .access import Access, peer_cred
from .admission import Admission
from .books import Books
from .catalog import CommitClock, StepCatalog
from .commits import Commits
from .completion import Completion
from .connections import ConnectionCaps, ConnectionGuard, raise_open_files_limit
from .endpoint import bind, check_endpoint, identity, unlink_own
from .events import (
    Answered,
    ErrorReported,
    EventQueue,
    Fetched,
    MeshComplete,
    Replicated,
    ShardPersisted,
    ShardSealed,
    SlotCreated,
    Uploaded,
)  # fmt: skip
from .fetcher import Fetcher
from .growth import Grower
from .memtier import MemoryTier, TierHooks
from .mesh import Mesh, advertised
from .persister import Persister, PersistOptions, lower_priority
from .protected import Protections
from .replicas import ReplicaServer
from .replicator import Outcomes, Replicator, source_of
from .sdnotify import notify, watchdog_interval
from .slots import Room, Slot, SlotPool
from .status import Counters, build_status
from .steps import StepTable
from .tiering import Tiering, TierPolicy
from .uploader import Uploader
from .waiters import Waiter

log = logging.getLogger("ckptd.daemon")
# the requests a client may send: each is handled by the server's method _op_<name>
OPS = (
    "hello", "status", "alloc", "release", "commit", "wait", "replicated", "latest", "hot_open", "hot_close", "fetch", "fetch_wait",
    "fetch_close", "promote", "protect", "unprotect", "ring",
)  # fmt: skip

Handler = Callable[[bytes, dict[str, Any]], "dict[str, Any] | None"]  # None: the reply is sent later


class Daemon:
    """One per node. Construct, then :meth:`serve` (blocks until :meth:`stop` or SIGTERM)."""

    def __init__(self, config: DaemonConfig, *, store: ObjectStore | None = None) -> None:
        """``store`` replaces the bucket ``config.remote`` describes (tests pass an in-memory one)."""
        self.config = config
        self.access = Access(config.group)
        self.root = os.path.abspath(config.root)
        self.instance = secrets.token_hex(8)  # in hello: a client tells a restarted daemon from the one it asked
        self._ctx, self._endpoint_lock, self._root_lock = zmq.Context(), None, None
        try:  # the endpoint first, then the root (one daemon per root): a refused start makes no root, lock or segment
            self._endpoint_lock = check_endpoint(self.access, self._ctx, config.endpoint)
            self._root_lock = self.access.make_root(self.root)
        except BaseException:
            self._unlock()
            self._ctx.term()
            raise
        try:
            self._build(config, store)
        except BaseException:
            self._unlock()
            raise

    def _build(self, config: DaemonConfig, store: ObjectStore | None) -> None:
        self.endpoint, self.started = config.endpoint, time.monotonic()
        self.counters = Counters()
        self._sock: zmq.Socket | None = None
        self._sock_id: tuple[int, int] | None = None  # the bound socket file (device, inode)
        self.connections: ConnectionGuard | None = None  # made at the bind
        self._running = False
        self._metrics: Any = None
        self._status_snapshot: dict[str, Any] | None = None
        self.events = EventQueue(self._ctx)
        key = load_key(config.peer_key) if config.peer_key else None  # a key others may read fails the start, naming it
        peers = [PeerStore(ep, key) for ep in config.peers] if key is not None else []  # restores ask these (their own links)
        self.catalog = StepCatalog(
            self.root, store if store is not None else open_store(config.remote, self.root), peers=peers,
            ring=lambda job: self.mesh.union(job) if self.mesh is not None else None,
        )  # fmt: skip
        self.steps = StepTable(self.catalog.complete_path)
        self.tiering = Tiering(TierPolicy(config.persist_every, config.persist_interval, config.lagging))
        budget = config.shm_budget if config.shm_budget is not None else default_shm_budget()
        segments = shm.SegmentDir(self.root, file_mode=self.access.file_mode, gid=self.access.gid)
        budget, self.replica_server = self._replica_server(config, key, segments, budget)
        self.grower = Grower(segments, self.events)  # new segments are made off the loop
        self.pool = SlotPool(
            segments, budget, on_grant=self._grant, lease_timeout=config.lease_timeout, grow=self.grower.submit,
            room=Room(
                reclaim=lambda job, step: self.memtier.reclaim(job, step), soon=lambda job, step: self.memtier.sealing(job, step),
                want_spare=lambda job: self.tiering.policy_of(job).lagging == "wait",
            ),
        )  # fmt: skip
        self._req_peers: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # REQ sockets: replies need a delimiter
        self.clock = CommitClock(self.catalog, self.pool)
        self.replicator: Replicator | None = None
        self.mesh: Mesh | None = None
        if key is not None and config.replicas > 0:
            pacer = Pacer(config.replicate_rate_limit)
            background = lower_priority(config.nice, config.idle_priority)  # sending yields the CPU to training
            if config.peers:
                links = [PeerStore(ep, key, pacer=pacer) for ep in config.peers]  # the replication thread's own links
                self.replicator = Replicator(
                    links, config.replicas, lambda name: segments.open_owned(name), self.events.post, initializer=background
                )
            if self.replica_server is not None:  # a job that spans nodes names its daemons: they hold its steps
                self.mesh = Mesh(
                    advertised(config.peer_listen or "", None), key, self.replica_server, config.replicas, report=self.events.post,
                    open_segment=lambda name: segments.open_owned(name), pacer=pacer, initializer=background,
                )  # fmt: skip
        self.replication = Outcomes()
        self._wire_storage(config, segments)
        self._wire_steps()

    def _replica_server(
        self, config: DaemonConfig, key: PeerKey | None, segments: shm.SegmentDir, budget: int
    ) -> tuple[int, ReplicaServer | None]:
        """With ``--peer-listen``: the replica store, and the rest of the shared-memory budget, the slot pool's."""
        if config.peer_listen is None or key is None:
            return budget, None
        share = config.replica_budget if config.replica_budget is not None else budget // 2
        if share >= budget:
            raise CheckpointError(
                f"replica_budget ({share} bytes) leaves nothing of the shm budget ({budget} bytes) for this node's own snapshots"
            )
        background = lower_priority(config.nice, config.idle_priority)  # receiving yields the CPU to training
        server = ReplicaServer(
            config.peer_listen, key, segments, share, initializer=background,
            published=lambda name: self.mesh.published(name) if self.mesh is not None else None,
        )  # fmt: skip
        return budget - share, server

    def _replicate(self, job: str, step: int) -> None:
        """A step complete here goes to the peers (with ``--replicas``)."""
        track = self.steps.get((job, step))
        if self.replicator is None or (track is not None and track.mesh):  # the mesh replicates those (and reports)
            return
        src = source_of(job, step, self.catalog, self.pool.holdings)
        if src is None:
            why = "a step that spans nodes completes through the bucket or shared directory; it is not replicated to peers"
            self.events.post(Replicated(job, step, "not_replicated", reason=why))
            return
        self.replicator.submit(src)

    def _wire_storage(self, config: DaemonConfig, segments: shm.SegmentDir) -> None:
        """The components that persist, upload, fetch and keep steps. Every one gets what it calls when it is made; an
        edge back to one made later (the uploader asks the names kept, the persister what retention must keep) is a
        call through this daemon, resolved once it serves."""
        background = lower_priority(config.nice, config.idle_priority)  # persist and upload threads yield to training
        self.uploader: Uploader | None = None
        if self.catalog.store is not None:
            self.uploader = Uploader(
                self.catalog.store, self.root, lambda res: self.completion.uploaded(res), keep=config.remote_keep,
                keep_every=config.remote_keep_every, commit_timeout=config.commit_timeout, initializer=background,
                protected=lambda job: self.protections.policy(job),
            )  # fmt: skip
        options = PersistOptions(
            config.workers, config.keep, local.WritePolicy(config.write_rate_limit, config.direct_io), uploads=self.uploader is not None
        )
        self.persister = Persister(
            self.root, self.events, options, protect=self._protected, initializer=background, open_segment=segments.open_owned
        )
        self.fetcher = Fetcher(self.catalog, self.events, retain=self.persister.retain)
        uploader = self.uploader
        catch_up = None if uploader is None else lambda job, step: uploader.submit(job, step, 0, catch_up=True)
        self.protections = Protections(self.root, self.events, retain=self.persister.retain, initializer=background, upload=catch_up)

    def _wire_steps(self) -> None:
        """The components that take commits and drive a step to complete, and the op and event tables. The memory tier
        calls back into completion, which is made after it (completion holds the tier)."""
        books = Books(self.root, self.steps, self.catalog, self.counters, self.events, self._answer)
        self.memtier = MemoryTier(
            books, self.pool, self.tiering,
            TierHooks(
                persist=lambda slot: self.completion.persist(slot), settle=lambda key, track: self.completion.settle(key, track),
                after_complete=lambda job, step: self.completion.after_complete(job, step),
                run_gone=lambda job: self.admission.run_gone(job),
                protected=lambda job, step: bool(self.protections.policy(job).keeps([step])),
                publish=lambda part: self.mesh.publish(part) if self.mesh is not None else None,
            ),
        )  # fmt: skip
        self.completion = Completion(books, self.persister, self.uploader, self.pool, memory=self.memtier, replicate=self._replicate)
        self.admission = Admission(
            self.root, self.steps, self.pool.holdings, self.completion.settle, writing=self.persister.writing,
            give_up=self.uploader.give_up if self.uploader is not None else None, drop_memory=self.memtier.drop,
        )  # fmt: skip
        self.commits = Commits(
            books, self.pool, self.clock, self.admission, self.tiering, self.memtier, self.completion,
            mesh_ready=lambda job: self.mesh is not None and self.mesh.ready(job),
        )  # fmt: skip
        self._ops: dict[str, Handler] = {op: getattr(self, f"_op_{op}") for op in OPS}
        self._on_event: dict[type, Callable[[Any], None]] = {
            ShardPersisted: self.completion.on_persisted,
            ShardSealed: self.memtier.on_sealed,
            Uploaded: self.completion.on_uploaded,
            Fetched: lambda ev: self._answer(self.fetcher.done(ev), report=ev.report),
            ErrorReported: lambda ev: self.counters.error(ev.message),
            SlotCreated: lambda ev: self.pool.created(ev.token, ev.name, ev.size, ev.error),
            Answered: self._on_answered,
            Replicated: lambda ev: self._answer(self.replication.done(ev)),
            MeshComplete: self.memtier.completed_across,
        }

    # ------------------------------------------------------------------ lifecycle

    def serve(self) -> None:
        try:  # a start that fails (a port taken, a root it cannot write) is shut down: nothing is left behind
            self._sock = bind(self.access, self._ctx, self.endpoint)
            self._sock_id = identity(self.endpoint)
            self.connections = ConnectionGuard(self._sock, self.endpoint, ConnectionCaps.for_limit(raise_open_files_limit()))
            self._serve_metrics()  # before recovery: a port taken fails the start before any work is queued
            if self.replica_server is not None:
                self.replica_server.start()  # likewise
            self.fetcher.check_store()  # off the loop: READY must not wait for the network
            self.protections.load(self.catalog.jobs())  # before recovery's retention passes
            recovery.recover(self.pool, self.steps, self.persister, self.uploader, self.root, self.catalog.jobs(), self.completion.persist)
            if self.uploader is not None:
                for job in self.catalog.jobs():
                    self.uploader.catch_up(job, self.catalog.made_here(job))
        except BaseException:
            self._shutdown(started=False)
            raise
        self._running = True
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        log.info("ckptd %s serving %s, root %s, shm budget %.2f GB", version.__version__, self.endpoint, self.root, self.pool.budget / 1e9)
        notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {self.endpoint}")
        try:
            self._loop()
        finally:
            self._shutdown()

    def stop(self) -> None:
        self._running = False

    def _loop(self) -> None:
        watchdog = watchdog_interval()
        last_ping = last_house = 0.0
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self.events.wake, zmq.POLLIN)
        guard = self.connections  # made at the bind, before the loop
        poller.register(guard.monitor, zmq.POLLIN)  # type: ignore[union-attr]
        while self._running:
            ready = dict(poller.poll(int(HOUSEKEEPING_S * 1000)))
            self._guarded(self._drain)
            if guard.monitor in ready:  # type: ignore[union-attr]  # first: a connection past the caps is refused before it is served
                self._guarded(guard.on_events)  # type: ignore[union-attr]
            if self._sock in ready:
                for _ in range(256):
                    try:
                        parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    # no message, however malformed, may take the daemon down; none is copied here (see _handle)
                    self._guarded(self._handle, parts, *peer_cred(parts[-1]))
                    del parts  # its frames' memory goes back now, not when the next message comes
            now = time.monotonic()
            if watchdog is not None and now - last_ping >= watchdog:
                notify("WATCHDOG=1")  # the loop is alive: systemd restarts a daemon that stops pinging
                last_ping = now
            if now - last_house >= HOUSEKEEPING_S:
                last_house = now
                self._guarded(self._housekeeping, now)

    @staticmethod
    def _guarded(fn: Callable[..., None], *args: Any) -> None:
        """Run one unit of the loop's work; whatever it raises is logged, and the loop (every other job's checkpoints) goes on."""
        try:
            fn(*args)
        except Exception:
            log.exception("%s failed; the daemon carries on", getattr(fn, "__name__", fn))

    def _serve_metrics(self) -> None:
        if self.config.metrics_port:
            from . import metrics

            self._status_snapshot = build_status(self)
            self._metrics = metrics.serve(self.config.metrics_port, lambda: self._status_snapshot)

    def _shutdown(self, started: bool = True) -> None:
        """Persist what is staged, finish uploads (a start that failed leaves its queued catch-up to the next
        start), then let go of everything; the root's lock last."""
        notify("STOPPING=1")
        if self.replicator is not None:
            self.replicator.shutdown()
        if self.mesh is not None:
            self.mesh.shutdown()
        self.memtier.shutdown()
        self._drain()  # steps sealed into memory meanwhile
        self.memtier.persist_all()  # each job's newest memory-only step
        log.info("shutting down: finishing %d pending persist(s)", self.steps.shards_in_flight())
        self.persister.shutdown()
        self.protections.shutdown()
        self.grower.shutdown()  # segments still being made are adopted by the drain, then unlinked with the pool
        self._drain()
        self.memtier.keep_for_restart()
        if self.uploader is not None:
            log.info("shutting down: finishing %d queued upload(s)", len(self.uploader.backlog()) + (self.uploader.current is not None))
            self.uploader.close(finish_queue=started)
            self._drain()
        self.fetcher.shutdown()
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
        if self.catalog.store is not None:
            self.catalog.store.close()
        for peer in self.catalog.peers:
            peer.close()
        if self.replica_server is not None:
            self.replica_server.shutdown()  # its segments go before the pool lets the segment directory go
        self.pool.close()
        if self.connections is not None:
            self.connections.close()
        if self._sock is not None:  # bound: the socket file is this daemon's, unless another daemon replaced it since
            self._sock.close(0)
            unlink_own(self.endpoint, self._sock_id)
        self.events.close()
        self._ctx.term()
        self._unlock()  # last: the next daemon on this root or endpoint starts once this one is done with it

    def _unlock(self) -> None:
        for fd in (self._endpoint_lock, self._root_lock):
            if fd is not None:
                os.close(fd)

    # ------------------------------------------------------------------ requests

    def _handle(self, parts: list[Any], peer: int | None = None, uid: int | None = None) -> None:
        """One request as received (``zmq.Frame`` objects, or bytes): its frames are copied only once their number is checked
        (:mod:`.inbox`: a frame may be 64 MiB); ``peer``, ``uid``: the sender's pid and user per the kernel (ipc), or ``None``."""
        ident, body = inbox.unwrap(parts, self._req_peers)
        try:
            frames = [ident, *inbox.copy(body)]
            msg = decode_request(frames[1])
            want = 2 + EXTRA_FRAMES.get(msg["op"], 0)
            if len(frames) != want:
                raise ProtocolError(f"op {msg['op']!r} takes {want - 1} frame(s), got {len(frames) - 1}")
            msg["frames"], msg["peer"], msg["uid"] = frames[2:], peer, uid
            if peer is not None and "pid" in msg:
                # liveness by the transport: the kernel's pid of the sender, in this daemon's PID namespace
                # (a trainer in a container reports its own namespace's pid; a hostile client, any pid);
                # 0 when the kernel cannot name it here: unknown, only the lease timeout reclaims it
                msg["pid"] = peer
        except ProtocolError as e:
            self._send(ident, reply_error(None, "bad_request", str(e)))
            return
        except Exception as e:  # a validation bug: still one answer, and the daemon goes on
            log.exception("could not decode a request")
            self._send(ident, reply_error(None, "bad_request", f"undecodable request: {type(e).__name__}"))
            return
        try:
            out = self._ops[msg["op"]](ident, msg)
        except CheckpointError as e:  # busy: refused for now, the client asks again (an earlier attempt is in flight)
            self._send(ident, reply_error(msg["id"], "busy" if isinstance(e, DaemonBusy) else "refused", str(e)))
            return
        except Exception as e:  # a bug or an OS error must not take the daemon down
            log.exception("op %s failed", msg["op"])
            self._send(ident, reply_error(msg["id"], "internal", f"{type(e).__name__}: {e}"))
            return
        if out is not None:
            self._send(ident, reply_ok(msg["id"], instance=self.instance, **out))

    def _send(self, ident: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([ident, b"", data] if ident in self._req_peers else [ident, data], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("reply dropped: %s", e)

    def _answer(self, replies: list[tuple[Waiter, dict[str, Any]]], report: str | None = None) -> None:
        """Send held-back replies (``report``: an error for status, from the event that freed them)."""
        if report is not None:
            self.counters.error(report)
        for w, fields in replies:
            self._send(w.ident, reply_ok(w.req_id, instance=self.instance, **fields))

    def _protected(self, job: str) -> RetentionPolicy:
        """Local steps of ``job`` retention must keep: those still to be uploaded, those restores read, those named (any thread)."""
        busy = (self.uploader.pending(job) if self.uploader is not None else set()) | self.fetcher.held(job)
        return AnyOf((Protect(frozenset(busy)), self.protections.policy(job)))

    def _grant(self, ident: bytes, msg: dict[str, Any], result: Slot | CheckpointError) -> None:
        """The slot pool granted (or refused) a deferred ``alloc``."""
        if isinstance(result, CheckpointError):
            self._send(ident, reply_error(msg["id"], "refused", str(result)))
        else:
            self._send(ident, reply_ok(msg["id"], instance=self.instance, **self._leased(result, msg)))

    def _leased(self, slot: Slot, msg: dict[str, Any]) -> dict[str, Any]:
        """An ``alloc``'s answer; ``spare``: a spare slot is being made for this rank, which it may warm."""
        spare = not msg.get("warm") and self.pool.spare_coming(slot.owner, msg["nbytes"])
        return {"segment": slot.name, "size": slot.size, "lease": slot.token, **({"spare": True} if spare else {})}

    def _op_hello(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        tiering = dataclasses.asdict(self.tiering.policy)  # prepare() sizes the slot pool by it
        peer = self.mesh.me if self.mesh is not None else None  # the ranks of a job that spans nodes tell every daemon its ring
        return {"server_version": version.__version__, "root": self.root, "pid": os.getpid(), "tiering": tiering, "peer": peer}

    def _op_status(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        return build_status(self)

    def _op_alloc(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        slot = self.pool.request(ident, msg)
        return None if slot is None else self._leased(slot, msg)  # None: deferred

    def _op_release(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        self.pool.free(self.pool.leased(msg["segment"], msg["lease"], msg["peer"]))
        return {}

    def _op_commit(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        self.commits.commit(msg)
        return {}

    def _op_wait(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        if msg["persist"]:  # a wait asks for durability: a memory-only step is persisted
            self.memtier.want_durable(msg["job"], msg["step"])
        return self.steps.wait((msg["job"], msg["step"]), ident, msg["id"], self._deadline(msg["timeout"]), msg["persist"])

    def _op_ring(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        """A rank of a job that spans nodes names the daemons that serve it (:mod:`.mesh`)."""
        if self.mesh is None:
            return {"used": False, "reason": "this daemon holds no steps for other nodes (--peer-listen, --peer-key, --replicas)"}
        why = self.mesh.set_ring(msg["job"], msg["ring"])
        if why is not None:
            log.warning("%s", why)
        return {"used": why is None, "reason": why}

    def _op_replicated(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        if self.replicator is None and self.mesh is None:
            raise CheckpointError("this daemon replicates nothing: start it with --replicas K and --peer tcp://HOST:PORT")
        return self.replication.wait(msg["job"], msg["step"], ident, msg["id"], self._deadline(msg["timeout"]))

    def _op_latest(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        if self.catalog.store is not None or self.catalog.peers or self.catalog.ring(msg["job"]) is not None:  # a later step elsewhere
            self.fetcher.latest(msg["job"], ident, msg["id"], msg["uid"])
            return None
        step, path = self.catalog.latest(msg["job"])
        return {"step": step, "path": path, "source": None if step is None else Source.DISK.to_wire()}

    def _on_answered(self, ev: Answered) -> None:
        err = ev.answer.get("error")
        self._send(
            ev.ident,
            reply_error(ev.req_id, "refused", err) if err is not None else reply_ok(ev.req_id, instance=self.instance, **ev.answer),
        )

    def _op_hot_open(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        return self.memtier.hot_open(msg["job"], msg["step"], msg["pid"], msg["uid"])

    def _op_promote(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        return {"step": self.memtier.newest(msg["job"], msg["step"], msg["persist"])}

    def _op_protect(self, ident: bytes, msg: dict[str, Any]) -> None:
        """``protect`` / ``unprotect`` (:mod:`.protected`): a step kept by name is kept on disk; answered once recorded."""
        job, step = msg["job"], msg["step"] if msg["op"] == "protect" else None
        self.protections.submit(ident, msg["id"], job, msg["name"], step, step is not None and self.steps.live((job, step)))
        if step is not None:
            self.memtier.want_durable(job, step)

    _op_unprotect = _op_protect

    def _op_hot_close(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        self.pool.holdings.unpin(msg["segments"], msg["pin"], msg["peer"])
        return {}

    def _op_fetch(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        return {"fetch": self.fetcher.start(msg["job"], msg["step"], ident, msg["uid"])}

    def _op_fetch_wait(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        return self.fetcher.wait(msg["fetch"], ident, msg["id"], self._deadline(msg["timeout"]))

    def _op_fetch_close(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        return {"released": self.fetcher.release(msg["fetch"], ident)}

    @staticmethod
    def _deadline(timeout: float) -> float:
        return time.monotonic() + max(0.0, min(float(timeout), WAIT_CAP_S))

    # ------------------------------------------------------------------ what the workers report

    def _drain(self) -> None:
        for event in self.events.drain():
            try:
                self._on_event[type(event)](event)
            except Exception:  # one bad event must not take the daemon (and every other job) down
                log.exception("could not handle %s", type(event).__name__)

    def _housekeeping(self, now: float) -> None:
        if self._metrics is not None:
            self._status_snapshot = build_status(self)  # what the next scrape reports
        self.pool.reap(now)
        if self.connections is not None:
            self.connections.housekeeping(now)
        self.memtier.housekeeping(now)
        self.catalog.prune(self.pool.holdings.steps())  # manifests of steps whose slots were reused go
        self._answer(self.fetcher.due(now))
        self._answer(self.steps.due(now))
        self._answer(self.replication.due(now))
