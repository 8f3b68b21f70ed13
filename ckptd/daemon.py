"""The node daemon: a ZeroMQ ROUTER loop that leases staging slots, records commits, and hands
durable persistence to worker threads.

Threads: the main thread owns the socket, the slot table and the step table and never blocks on
disk; ``workers`` persist threads write shards and finalize steps (:mod:`ckptd.persist`) and report
back through a queue plus an inproc wake-up socket. Nothing here talks to the trainer's process
groups: agreement that a step is complete is read off storage (every rank's fragment present).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import __version__, persist, shm, tier
from .errors import CheckpointError, ProtocolError
from .format import MANIFEST
from .notify import notify, watchdog_interval
from .protocol import EXTRA_FRAMES, decode_request, endpoint_answers, reply_error, reply_ok

log = logging.getLogger("ckptd.daemon")

WAIT_CAP_S = 30.0
HOUSEKEEPING_S = 0.5
TRACKS_KEPT = 256  # finished steps remembered per job
FETCHES_KEPT = 256  # finished fetch answers kept for a client that has not asked yet
HOT_PIN_MAX_S = 600.0  # a hot restore's pin on a slot lapses after this, whatever the pid


@dataclass
class Slot:
    name: str
    size: int
    state: str = "free"  # free | leased | committed
    owner: tuple[str, int] | None = None  # (job, rank) that used it last: reused first by them
    pid: int | None = None
    lease: dict[str, Any] | None = None
    used_at: float = 0.0
    mapping: shm.Mapping | None = None
    holds: tuple[str, int, int] | None = None  # (job, step, rank) a free slot still holds, persisted
    pins: dict[int, float] = field(default_factory=dict)  # pid -> deadline of a hot restore reading it: not reused meanwhile


@dataclass
class StepTrack:
    world_size: int
    local_world_size: int = 0  # ranks of this step on this node (< world_size: a multi-node step)
    committed: set[int] = field(default_factory=set)
    inflight: int = 0
    state: str = "pending"  # pending | durable | failed
    error: str | None = None
    path: str | None = None
    waiters: list[tuple[bytes, Any, float]] = field(default_factory=list)


def _tree(raw: Any) -> dict[str, Any]:
    """A commit's tree: parsed from the raw frame (recovered records hold it parsed already)."""
    if isinstance(raw, dict):
        return raw
    try:
        tree = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"the committed tree is not valid JSON: {e}") from None
    if not isinstance(tree, dict):
        raise ProtocolError("the committed tree is not a JSON object")
    return tree


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _NoStep(CheckpointError):
    """The asked-for step exists neither under the root nor in the bucket."""


def resolve_group(group: str | int | None) -> int | None:
    """The gid of a group given by name or number; ``None`` for none. Raises ``CheckpointError``."""
    if group is None or group == "":
        return None
    import grp

    try:
        if isinstance(group, int) or group.isdigit():
            return grp.getgrgid(int(group)).gr_gid
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise CheckpointError(f"unknown group {group!r}") from None


def default_budget() -> int:
    """Half of the shared-memory filesystem: room to stage while the rest of the node runs."""
    st = os.statvfs(shm.SHM_DIR)
    return st.f_frsize * st.f_blocks // 2


class Daemon:
    """One per node. Construct, then :meth:`serve` (blocks until :meth:`stop` or SIGTERM)."""

    def __init__(
        self,
        root: str,
        endpoint: str,
        *,
        shm_budget: int | None = None,
        keep: int = 3,
        workers: int = 2,
        write_rate_limit: float = 0.0,
        nice: int = 10,
        group: str | int | None = None,
        remote: Any = None,
        remote_keep: int = 3,
        remote_keep_every: int = 0,
        commit_timeout: float = 600.0,
        metrics_port: int = 0,
        idle_priority: bool = True,
    ) -> None:
        # access: the owner only, or also one configured group (socket, segments, checkpoint root)
        self.gid = resolve_group(group)
        self.file_mode = 0o600 if self.gid is None else 0o660
        self.root = os.path.abspath(root)
        self._make_root()
        self.endpoint = endpoint
        self.budget = shm_budget if shm_budget is not None else default_budget()
        self.keep = keep
        self.write_rate_limit = write_rate_limit
        self.nice = nice
        self.idle_priority = idle_priority
        self.ns = shm.namespace(self.root)
        self.slots: dict[str, Slot] = {}
        self.tracks: dict[tuple[str, int], StepTrack] = {}
        self.deferred: list[tuple[bytes, dict[str, Any]]] = []
        self.hot: dict[str, tuple[int, str, dict[str, Any] | None]] = {}  # job -> newest durable (step, path, manifest)
        self._counter = 0
        self._running = False
        self._started = time.monotonic()
        self.metrics_port = metrics_port
        self._metrics: Any = None
        self._status_snapshot: dict[str, Any] | None = None
        # persist threads yield the CPU to training: on a busy node the trainer's step time matters more
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptd-persist", initializer=self._lower_priority)
        self._done: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._job_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._tls = threading.local()
        self.stats: dict[str, Any] = {
            "persisted_bytes": 0,
            "persist_seconds": 0.0,
            "steps_committed": 0,
            "uploaded_bytes": 0,
            "upload_seconds": 0.0,
            "steps_uploaded": 0,
            "errors": 0,
            "last_error": None,
        }
        self.uploaded: dict[str, int] = {}  # job -> newest step complete in the bucket (this run)
        self.fetches: dict[int, dict[str, Any]] = {}
        self._node_done: dict[tuple[str, int], bool] = {}
        self._fetch_waiters: dict[int, list[tuple[bytes, Any, float]]] = {}
        self._fetch_ids = itertools.count(1)
        self.fetching: tuple[str, int, list[int]] | None = None  # job, step, [bytes done, total]
        # the object-storage tier (optional): an upload thread after local durability, fetches on restore
        self.store = None
        self.uploader: tier.Uploader | None = None
        self.remote_keep, self.remote_keep_every = remote_keep, remote_keep_every
        if remote is not None:
            from .objstore import ObjectStore

            self.store = ObjectStore(remote)
            self.uploader = tier.Uploader(
                self.store,
                self.root,
                self._uploaded,
                keep=remote_keep,
                keep_every=remote_keep_every,
                commit_timeout=commit_timeout,
                initializer=self._lower_priority,
            )
        self._fetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-fetch")
        self._ctx = zmq.Context()
        self._wake_addr = f"inproc://ckptd-wake-{id(self)}"

    # ------------------------------------------------------------------ lifecycle

    def serve(self) -> None:
        self._bind()
        if self.store is not None:
            self._fetch_pool.submit(self._check_store)  # off the loop: READY must not wait for the network
        self._recover()
        if self.uploader is not None:
            # a previous run may have stopped before uploading some steps: catch up with the newest and
            # with those the bucket keeps forever (the upload thread skips any the bucket already has)
            for job in persist.list_jobs(self.root):
                steps = persist.committed_steps(self.root, job)
                every = self.remote_keep_every
                for step in [s for s in steps[:-1] if every and s % every == 0] + steps[-1:]:
                    self.uploader.submit(job, step, 0, catch_up=True)  # world size: only multi-node uploads use it
        if self.metrics_port:
            from . import metrics

            self._status_snapshot = self._op_status(b"", {})
            try:
                self._metrics = metrics.serve(self.metrics_port, lambda: self._status_snapshot)
            except OSError as e:
                raise CheckpointError(f"cannot serve metrics on 127.0.0.1:{self.metrics_port}: {e.strerror or e}") from None
            log.info("metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
        self._running = True
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        log.info("ckptd %s serving %s, root %s, shm budget %.2f GiB", __version__, self.endpoint, self.root, self.budget / 2**30)
        notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {self.endpoint}")
        watchdog = watchdog_interval()
        last_ping = 0.0
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        last_house = 0.0
        try:
            while self._running:
                events = dict(poller.poll(int(HOUSEKEEPING_S * 1000)))
                if self._wake in events:
                    while self._wake.poll(0):
                        self._wake.recv()
                self._drain_done()
                if self._sock in events:
                    for _ in range(256):
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._handle(frames)
                        except Exception:  # no message, however malformed, may take the daemon down
                            log.exception("dropped a message that could not be handled")
                now = time.monotonic()
                if watchdog is not None and now - last_ping >= watchdog:
                    notify("WATCHDOG=1")  # the loop is alive: systemd restarts a daemon that stops pinging
                    last_ping = now
                if now - last_house >= HOUSEKEEPING_S:
                    last_house = now
                    self._housekeeping(now)
        finally:
            self._shutdown()

    def stop(self) -> None:
        self._running = False

    def _restrict(self, path: str, mode: int) -> None:
        os.chmod(path, mode)
        if self.gid is not None:
            os.chown(path, -1, self.gid)

    def _make_root(self) -> None:
        if not os.path.isdir(self.root):
            os.makedirs(self.root)
            # setgid: every step directory and file below inherits the group, so its members can restore
            self._restrict(self.root, 0o700 if self.gid is None else 0o2750)
        elif (mode := os.stat(self.root).st_mode) & 0o007:
            log.warning("checkpoint root %s is accessible to every user on this node (mode %o)", self.root, mode & 0o7777)

    def _bind(self) -> None:
        if self.endpoint.startswith("ipc://"):
            path = self.endpoint[len("ipc://") :]
            d = os.path.dirname(path)
            if d and not os.path.isdir(d):
                os.makedirs(d)
                self._restrict(d, 0o700 if self.gid is None else 0o750)
            if os.path.exists(path):
                # a live daemon answers on it; a dead one left a stale socket file behind
                if endpoint_answers(self._ctx, self.endpoint, 0.5):
                    raise CheckpointError(f"another daemon is already serving {self.endpoint}")
                os.unlink(path)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        # the socket file is created with the umask's mode: restrict it from birth, not after a race
        old = os.umask(0o777 & ~self.file_mode)
        try:
            self._sock.bind(self.endpoint)
        finally:
            os.umask(old)
        if self.endpoint.startswith("ipc://"):
            self._restrict(self.endpoint[len("ipc://") :], self.file_mode)
        self._wake = self._ctx.socket(zmq.PULL)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.bind(self._wake_addr)

    def _shutdown(self) -> None:
        notify("STOPPING=1")
        log.info("shutting down: finishing %d pending persist(s)", sum(t.inflight for t in self.tracks.values()))
        self._pool.shutdown(wait=True)
        self._drain_done()
        if self.uploader is not None:
            log.info("shutting down: finishing %d queued upload(s)", len(self.uploader.backlog()) + (self.uploader.current is not None))
            self.uploader.close()
            self._drain_done()
        self._fetch_pool.shutdown(wait=True)
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
        if self.store is not None:
            self.store.close()
        for slot in list(self.slots.values()):
            if slot.state != "committed":
                self._unlink(slot)
            elif slot.mapping is not None:
                slot.mapping.close()
                slot.mapping = None
        self._sock.close(0)
        self._wake.close(0)
        self._ctx.term()
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://") :])
            except FileNotFoundError:
                pass

    def _recover(self) -> None:
        """Adopt committed-but-not-durable segments; finish or remove partial step directories."""
        for name in shm.list_segments(self.ns):
            self._counter = max(self._counter, int(name.rsplit("-", 1)[1]) + 1)
            rec = shm.read_record(name)
            if rec is None:
                shm.unlink(name)
                continue
            try:
                if os.path.isdir(persist.step_dir(self.root, rec["job"], rec["step"])):
                    shm.unlink(name)  # finalized just before the crash: nothing left to do
                    continue
                slot = Slot(name, shm.size_of(name), state="committed", owner=(rec["job"], rec["rank"]), lease=rec)
                track = self.tracks.setdefault((rec["job"], rec["step"]), StepTrack(rec["world_size"], rec.get("local_world_size", 0)))
                track.committed.add(rec["rank"])
            except (KeyError, TypeError, OSError):
                log.warning("dropping segment %s with an unreadable commit record", name)
                shm.unlink(name)
                continue
            self.slots[name] = slot
            log.info("recovered committed shard %s: job %s step %s rank %s", name, rec["job"], rec["step"], rec["rank"])
        for job in persist.list_jobs(self.root):
            for step in persist.partial_steps(self.root, job):
                present = persist.fragments_present(self.root, job, step)
                track = self.tracks.get((job, step))
                ws, lws = (track.world_size, track.local_world_size) if track else self._fragment_sizes(job, step)
                if ws and present >= set(range(ws)):
                    try:
                        path = persist.finalize_step(self.root, job, step, ws)
                        log.info("finalized step %s of job %s left complete by a previous run: %s", step, job, path)
                    except (CheckpointError, OSError, ValueError) as e:
                        log.error("cannot finalize leftover step %s of job %s: %s; removing it", step, job, e)
                        persist.remove_partial(self.root, job, step)
                elif track is None and ws and lws and lws < ws and len(present) == lws and self.uploader is not None:
                    # this node's whole part of a multi-node step, durable here: the previous run may have
                    # died before the bucket had it, and the other nodes wait for it (commit_timeout)
                    log.info("uploading this node's part of step %s of job %s again (ranks %s)", step, job, sorted(present))
                    track = self.tracks[(job, step)] = StepTrack(ws, lws)
                    track.committed |= present
                    self._node_done[(job, step)] = True
                    self.uploader.submit(job, step, ws, sorted(present))
                elif track is None:
                    log.info("removing partial step %s of job %s (no staged shard can complete it)", step, job)
                    persist.remove_partial(self.root, job, step)
                else:
                    track.committed |= present
        for slot in self.slots.values():
            self._submit_persist(slot)

    def _fragment_sizes(self, job: str, step: int) -> tuple[int | None, int | None]:
        """World size and local world size recorded in a partial step's fragments, if one is readable."""
        d = persist.tmp_dir(self.root, job, step)
        for r in sorted(persist.fragments_present(self.root, job, step)):
            try:
                with open(os.path.join(d, f"rank-{r:05d}.json"), "rb") as f:
                    frag = json.loads(f.read())
                ws = int(frag["world_size"])
                return ws, int(frag.get("local_world_size", ws))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return None, None

    # ------------------------------------------------------------------ requests

    def _handle(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            if len(frames) < 2:
                raise ProtocolError("empty message")
            msg = decode_request(frames[1])
            want = 2 + EXTRA_FRAMES.get(msg["op"], 0)
            if len(frames) != want:
                raise ProtocolError(f"op {msg['op']!r} takes {want - 1} frame(s), got {len(frames) - 1}")
            msg["frames"] = frames[2:]
        except ProtocolError as e:
            self._send(ident, reply_error(None, "bad_request", str(e)))
            return
        op = msg["op"]
        try:
            out = getattr(self, f"_op_{op}")(ident, msg)
        except CheckpointError as e:
            self._send(ident, reply_error(msg["id"], "refused", str(e)))
            return
        except Exception as e:  # a bug or an OS error must not take the daemon down
            log.exception("op %s failed", op)
            self._send(ident, reply_error(msg["id"], "internal", f"{type(e).__name__}: {e}"))
            return
        if out is not None:
            self._send(ident, reply_ok(msg["id"], **out))

    def _send(self, ident: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([ident, data], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("reply dropped: %s", e)

    def _op_hello(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        return {"server_version": __version__, "root": self.root, "pid": os.getpid()}

    def _op_status(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        states: dict[str, int] = {}
        for s in self.slots.values():
            states[s.state] = states.get(s.state, 0) + 1
        jobs: dict[str, Any] = {}
        for (job, step), t in self.tracks.items():
            if t.state == "pending":
                jobs.setdefault(job, {"in_flight": []})["in_flight"].append(step)
        for job in persist.list_jobs(self.root):
            jobs.setdefault(job, {"in_flight": []})["latest"] = persist.latest_path(self.root, job)[0]
        for job, step in self.uploaded.items():
            jobs.setdefault(job, {"in_flight": []})["uploaded"] = step
        held = {sl.holds[:2] for sl in self.slots.values() if sl.holds is not None and sl.state == "free"}
        for job, (step, _, _) in self.hot.items():
            if job in jobs and (job, step) in held:
                jobs[job]["in_memory"] = step  # a hot restore can read it (if every rank's shard is held)
        st = self.stats
        uploading = None
        if self.uploader is not None and (u := self.uploader.current) is not None:
            uploading = {"job": u.job, "step": u.step, "bytes_done": u.bytes_done, "bytes_total": u.bytes_total,
                         "seconds": time.monotonic() - u.started if u.started else 0.0}  # fmt: skip
        fetching = None
        if (f := self.fetching) is not None:
            fetching = {"job": f[0], "step": f[1], "bytes_done": f[2][0]}
        return {
            "version": __version__,
            "root": self.root,
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - self._started,
            "remote": f"s3://{self.store.config.bucket}/{self.store.config.prefix}" if self.store is not None else None,
            "shm_budget": self.budget,
            "shm_bytes": sum(s.size for s in self.slots.values()),
            "staged_bytes": sum((s.lease or {}).get("nbytes", 0) for s in self.slots.values() if s.state == "committed"),
            "slots": states,
            "deferred_allocs": len(self.deferred),
            "hot_pins": {s.name: sorted(s.pins) for s in self.slots.values() if s.pins},
            "jobs": jobs,
            "persist_bytes_per_s": st["persisted_bytes"] / st["persist_seconds"] if st["persist_seconds"] else None,
            "upload_bytes_per_s": st["uploaded_bytes"] / st["upload_seconds"] if st["upload_seconds"] else None,
            "uploading": uploading,
            "upload_backlog": [list(x) for x in self.uploader.backlog()] if self.uploader is not None else [],
            "fetching": fetching,
            **st,
        }

    def _op_alloc(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        if msg["nbytes"] > self.budget:
            raise ProtocolError(f"a shard of {msg['nbytes']} bytes exceeds the shared-memory budget of {self.budget} bytes")
        slot = self._try_lease(msg)
        if slot is None:
            self.deferred.append((ident, msg))  # backpressure: answered when a slot frees up
            return None
        return {"segment": slot.name, "size": slot.size}

    def _try_lease(self, msg: dict[str, Any]) -> Slot | None:
        owner = (msg["job"], msg["rank"])
        need = msg["nbytes"]
        free = [s for s in self.slots.values() if s.state == "free" and not s.pins and s.size >= need]
        # the rank's own slot first: the trainer already holds a warm mapping of it
        slot = min((s for s in free if s.owner == owner), key=lambda s: s.size, default=None)
        if slot is None:
            used = sum(s.size for s in self.slots.values())
            rounded = max(shm.ALIGN, -(-need // shm.ALIGN) * shm.ALIGN)
            if used + rounded > self.budget:
                slot = min(free, key=lambda s: s.size, default=None)
        if slot is None:
            # evict free slots, least recently used first, until a new one fits the budget
            for victim in sorted((s for s in self.slots.values() if s.state == "free" and not s.pins), key=lambda s: s.used_at):
                if used + rounded <= self.budget:
                    break
                used -= victim.size
                self._unlink(victim)
            if used + rounded > self.budget:
                return None
            name = f"{self.ns}-{self._counter:08d}"
            self._counter += 1
            size = shm.create(name, need, mode=self.file_mode, gid=self.gid)
            slot = Slot(name, size)
            self.slots[name] = slot
        slot.state, slot.owner, slot.pid, slot.used_at = "leased", owner, msg["pid"], time.monotonic()
        slot.holds = None
        slot.lease = {k: msg[k] for k in ("job", "rank", "world_size", "step")}
        return slot

    def _leased(self, name: str) -> Slot:
        slot = self.slots.get(name)
        if slot is None:
            raise ProtocolError(f"unknown segment {name!r}")
        if slot.state != "leased":
            raise ProtocolError(f"segment {name!r} is not leased (it is {slot.state})")
        return slot

    def _op_release(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        self._free(self._leased(msg["segment"]))
        return {}

    def _op_commit(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        slot = self._leased(msg["segment"])
        lease = slot.lease or {}
        if any(lease.get(k) != msg[k] for k in ("job", "rank", "world_size", "step")):
            raise ProtocolError(f"commit for {msg['job']}/{msg['step']}/rank {msg['rank']} does not match the lease of {slot.name}")
        if msg["nbytes"] > slot.size:
            raise ProtocolError(f"commit of {msg['nbytes']} bytes exceeds segment size {slot.size}")
        key = (msg["job"], msg["step"])
        if os.path.isdir(persist.step_dir(self.root, *key)):
            raise ProtocolError(f"step {msg['step']} of job {msg['job']} is already committed")
        lws = msg["local_world_size"]
        if not 1 <= lws <= msg["world_size"]:
            raise ProtocolError(f"commit: local_world_size {lws} is not within 1..world_size ({msg['world_size']})")
        if lws < msg["world_size"] and self.store is None:
            raise ProtocolError(
                f"step {msg['step']} of job {msg['job']} spans several nodes ({lws} of {msg['world_size']} ranks on this one):"
                " a multi-node job is committed through a shared bucket; configure [remote] on every node's daemon"
            )
        track = self.tracks.setdefault(key, StepTrack(msg["world_size"], lws))
        if (track.world_size, track.local_world_size or lws) != (msg["world_size"], lws):
            raise ProtocolError(
                f"step {msg['step']}: world_size {msg['world_size']} / local_world_size {lws} differ from"
                f" {track.world_size} / {track.local_world_size} of other ranks"
            )
        track.local_world_size = lws
        if msg["rank"] in track.committed:
            raise ProtocolError(f"rank {msg['rank']} already committed step {msg['step']} of job {msg['job']}")
        if track.state == "failed":
            raise ProtocolError(f"step {msg['step']} of job {msg['job']} already failed: {track.error}")
        for cid, dig in msg["replicas"].items():
            if not isinstance(dig, str) or len(dig) != 16 or len(cid) > 4096:
                raise ProtocolError("commit: 'replicas' must map chunk ids to 16-digit digests")
        record = {k: msg[k] for k in ("job", "rank", "world_size", "local_world_size", "step", "nbytes", "replicas")}
        shm.write_record(slot.name, record, tree=msg["frames"][0])  # from here on the shard survives any crash
        record["tree"] = msg["frames"][0]  # raw JSON: parsed on the persist thread
        slot.state, slot.lease = "committed", record
        track.committed.add(msg["rank"])
        self._submit_persist(slot)
        return {}

    def _op_wait(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        key = (msg["job"], msg["step"])
        track = self.tracks.get(key)
        if track is None or track.state != "pending":
            return self._step_state(key, track)
        deadline = time.monotonic() + max(0.0, min(float(msg["timeout"]), WAIT_CAP_S))
        track.waiters.append((ident, msg["id"], deadline))
        return None

    def _step_state(self, key: tuple[str, int], track: StepTrack | None) -> dict[str, Any]:
        if track is not None:
            return {"state": track.state, "path": track.path, "error": track.error}
        path = persist.step_dir(self.root, *key)
        if os.path.exists(os.path.join(path, "manifest.json")):
            return {"state": "durable", "path": path, "error": None}
        return {"state": "failed", "path": None, "error": f"the daemon has no record of step {key[1]} of job {key[0]}"}

    def _op_latest(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        step, path = persist.latest_path(self.root, msg["job"])
        return {"step": step, "path": path}

    def _op_locate(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        path = persist.step_dir(self.root, msg["job"], msg["step"])
        if not os.path.exists(os.path.join(path, "manifest.json")):
            raise ProtocolError(f"step {msg['step']} of job {msg['job']} is not a committed checkpoint under {self.root}")
        return {"step": msg["step"], "path": path}

    def _op_hot_open(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        job, want = msg["job"], msg["step"]
        newest = self.hot.get(job)
        if newest is None:
            return {"step": None, "reason": f"this daemon has made no step of job {job!r} durable since it started"}
        step, path, man = newest
        if want is not None and want != step:
            return {"step": None, "reason": f"the daemon holds only step {step} of job {job!r} in memory"}
        if man is None or not os.path.isdir(path):
            return {"step": None, "reason": f"step {step} of job {job!r} is no longer on disk"}
        held = {s.holds[2]: s for s in self.slots.values() if s.state == "free" and s.holds is not None and s.holds[:2] == (job, step)}
        missing = sorted(set(range(man["world_size"])) - set(held))
        if missing:
            return {"step": None, "reason": f"the shards of ranks {missing[:8]} of step {step} are no longer in memory"}
        segments = {}
        for rank, slot in held.items():
            slot.pins[msg["pid"]] = time.monotonic() + HOT_PIN_MAX_S
            segments[persist.shard_name(rank)] = slot.name
        return {"step": step, "path": path, "manifest": man, "segments": segments, "reason": None}

    def _op_hot_close(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        for name in msg["segments"]:
            slot = self.slots.get(name) if isinstance(name, str) else None
            if slot is not None:
                slot.pins.pop(msg["pid"], None)
        self._retry_deferred()
        return {}

    # ------------------------------------------------------------------ persistence

    def _job_lock(self, job: str) -> threading.Lock:
        with self._locks_guard:
            return self._job_locks.setdefault(job, threading.Lock())

    def _submit_persist(self, slot: Slot) -> None:
        rec = dict(slot.lease or {})
        key = (rec["job"], rec["step"])
        self.tracks[key].inflight += 1
        self._pool.submit(self._persist_worker, slot, rec)

    def _lower_priority(self) -> None:
        """Run in each persist and upload thread: they yield the CPU and the disk to training."""
        tid = threading.get_native_id()  # Linux: priorities are per thread
        try:
            if self.nice:
                os.setpriority(os.PRIO_PROCESS, tid, self.nice)
            if self.idle_priority:
                # only CPU time and disk time that nothing else on the node wants
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                import psutil

                psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_IDLE)
        except (OSError, AttributeError, ImportError) as e:
            log.warning("cannot lower the priority of %s: %s", threading.current_thread().name, e)

    def _persist_worker(self, slot: Slot, rec: dict[str, Any]) -> None:
        """Worker thread: write one shard, and finalize its step if every rank's fragment is there.

        The slot is committed, so nothing else touches it until the main thread sees the result.
        """
        name = slot.name
        job, step, ws = rec["job"], rec["step"], rec["world_size"]
        lws = rec.get("local_world_size", ws)
        final = None
        node_ranks = None
        try:
            t0 = time.monotonic()
            if slot.mapping is None:  # mapped here, not on the main loop: ~0.1 s per GB with MAP_POPULATE
                slot.mapping = shm.Mapping(name, writable=False)
            view = slot.mapping.view
            persist.write_shard(
                self.root,
                job,
                step,
                rec["rank"],
                ws,
                view,
                rec["nbytes"],
                _tree(rec["tree"]),
                self.write_rate_limit,
                rec.get("replicas", {}),
                lws,
            )
            dt = time.monotonic() - t0
            with self._job_lock(job):
                present = persist.fragments_present(self.root, job, step)
                if lws < ws:
                    # multi-node: this node's part is durable; the upload thread commits it through the bucket
                    if len(present) == lws and not self._node_done.get((job, step)):
                        self._node_done[(job, step)] = True
                        node_ranks = sorted(present)
                elif present >= set(range(ws)) and os.path.isdir(persist.tmp_dir(self.root, job, step)):
                    final = persist.finalize_step(self.root, job, step, ws)
                    # here, off the main loop (deleting GBs takes a while), and before wait() is answered
                    self._local_retention(job)
            manifest = None
            if final is not None:
                with open(os.path.join(final, MANIFEST), "rb") as f:
                    manifest = json.loads(f.read())  # kept in memory for hot restores: they read no disk
            self._notify("persisted", name, job, step, rec["rank"], None, final, rec["nbytes"], dt, manifest, node_ranks)
        except Exception as e:  # reported to every waiter of the step, never swallowed
            log.error("persisting %s (job %s step %s rank %s) failed: %s", name, job, step, rec["rank"], e)
            self._notify("persisted", name, job, step, rec["rank"], f"{e}", None, 0, 0.0, None, None)

    def _local_retention(self, job: str) -> None:
        """Keep the newest ``keep`` local steps, except those still to be uploaded. Off the main loop."""
        protect = self.uploader.pending(job) if self.uploader is not None else set()
        removed = persist.apply_retention(self.root, job, self.keep, protect)
        if removed:
            log.info("retention: removed steps %s of job %s", removed, job)

    def _uploaded(self, res: tier.UploadResult) -> None:
        """Upload thread: a step's upload ended. Local steps it protected may go now."""
        if res.error is None and not res.multi_node:
            with self._job_lock(res.job):
                self._local_retention(res.job)
        self._notify("uploaded", res)

    def _notify(self, *item: Any) -> None:
        self._done.put(item)
        sock = getattr(self._tls, "wake", None)
        if sock is None:
            sock = self._tls.wake = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._wake_addr)
        sock.send(b"", zmq.NOBLOCK)

    def _drain_done(self) -> None:
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return
            if item[0] == "uploaded":
                self._upload_done(item[1])
                continue
            if item[0] == "fetched":
                self._fetch_done(item[1], item[2])
                continue
            if item[0] == "error":
                self._error(item[1])
                continue
            _, name, job, step, rank, err, final, nbytes, dt, manifest, node_ranks = item
            slot = self.slots.get(name)
            if slot is not None:
                shm.drop_record(name)
                self._free(slot)
                slot.holds = (job, step, rank) if err is None else None
            track = self.tracks.get((job, step))
            if track is None:
                continue
            track.inflight -= 1
            self.stats["persisted_bytes"] += nbytes
            self.stats["persist_seconds"] += dt
            if err is not None and track.state == "pending":
                track.state, track.error = "failed", err
                self._error(f"job {job} step {step}: {err}")
            if node_ranks is not None and track.state == "pending":
                assert self.uploader is not None
                self.uploader.submit(job, step, track.world_size, node_ranks)
            if final is not None:
                track.state, track.path = "durable", final
                self.hot[job] = (step, final, manifest)
                if self.uploader is not None:
                    self.uploader.submit(job, step, track.world_size)
                self.stats["steps_committed"] += 1
                log.info("committed job %s step %s -> %s", job, step, final)
                self._after_commit(job, step)
            if track.state == "failed" and track.inflight == 0:
                persist.remove_partial(self.root, job, step)  # rare: before waiters hear of it
            if track.state != "pending":
                self._answer_waiters((job, step), track)

    def _check_store(self) -> None:
        assert self.store is not None
        try:
            self.store.check()
            log.info("object-storage tier: s3://%s/%s", self.store.config.bucket, self.store.config.prefix)
        except CheckpointError as e:  # local durability still works; each upload is tried and reported
            log.error("object-storage tier unreachable: %s", e)
            self._notify("error", f"object storage: {e}")

    def _error(self, message: str) -> None:
        """Main thread: remember the newest error for ``status`` and count it for metrics."""
        self.stats["last_error"] = message
        self.stats["errors"] += 1

    def _upload_done(self, res: tier.UploadResult) -> None:
        self.stats["uploaded_bytes"] += res.nbytes
        self.stats["upload_seconds"] += res.seconds
        if res.error is not None:
            self._error(f"upload of job {res.job} step {res.step}: {res.error}")
        elif res.committed:
            self.stats["steps_uploaded"] += 1
            self.uploaded[res.job] = max(res.step, self.uploaded.get(res.job, -1))
            log.info("uploaded job %s step %s -> %s (%.2f GB in %.1f s)", res.job, res.step, res.url, res.nbytes / 1e9, res.seconds)
        if not res.multi_node:
            return
        # a multi-node step is durable once it is complete in the bucket
        key = (res.job, res.step)
        self._node_done.pop(key, None)
        track = self.tracks.get(key)
        if track is None or track.state != "pending":
            return
        if res.error is not None:
            track.state, track.error = "failed", res.error
            persist.remove_partial(self.root, res.job, res.step)
        else:
            track.state, track.path = "durable", res.url
            self.stats["steps_committed"] += 1
            log.info("committed job %s step %s across nodes -> %s", res.job, res.step, res.url)
            self._after_commit(res.job, res.step)
        self._answer_waiters(key, track)

    # ------------------------------------------------------------------ fetch: which step a restore reads

    def _op_fetch(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        fid = next(self._fetch_ids)
        self.fetches[fid] = {"state": "pending", "step": None, "path": None, "source": None, "error": None}
        for old in [f for f, r in self.fetches.items() if r["state"] != "pending"][:-FETCHES_KEPT]:
            del self.fetches[old]  # answers nobody asked for: a client that died mid-restore
        self._fetch_pool.submit(self._fetch_worker, fid, msg["job"], msg["step"])
        return {"fetch": fid}

    def _op_fetch_wait(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        fid = msg["fetch"]
        res = self.fetches.get(fid)
        if res is None:
            raise ProtocolError(f"unknown fetch {fid}")
        if res["state"] != "pending":
            return self._fetch_reply(fid)
        deadline = time.monotonic() + max(0.0, min(float(msg["timeout"]), WAIT_CAP_S))
        self._fetch_waiters.setdefault(fid, []).append((ident, msg["id"], deadline))
        return None

    def _fetch_reply(self, fid: int) -> dict[str, Any]:
        res = self.fetches[fid]
        if res["state"] != "pending":
            # answered once: forget it (a client that lost the answer asks for a new fetch)
            self.fetches.pop(fid, None)
        return dict(res)

    def _fetch_worker(self, fid: int, job: str, step: int | None) -> None:
        """Fetch thread: the newest complete step (or ``step``) under the root or in the bucket; a step
        only the bucket holds is downloaded into the root first."""
        want = step  # the step being looked for, once chosen
        try:
            if step is None:
                local, path = persist.latest_path(self.root, job)
            else:
                path = persist.step_dir(self.root, job, step)
                local = step if os.path.exists(os.path.join(path, MANIFEST)) else None
            remote: list[int] = []
            if self.store is not None:
                remote = tier.remote_steps(self.store, job)[0]
            where = f"under {self.root}" + (f" or in s3://{self.store.config.bucket}/{self.store.config.prefix}" if self.store else "")
            if step is None:
                want = max([s for s in (local, remote[-1] if remote else None) if s is not None], default=None)
                if want is None:
                    raise _NoStep(f"job {job!r} has no committed checkpoint {where}")
            else:
                want = step
                if local is None and step not in remote:
                    raise _NoStep(f"step {step} of job {job!r} is not a committed checkpoint {where}")
            if want == local:
                result = {"state": "done", "step": want, "path": path, "source": "local", "error": None}
            else:
                prog = [0, 0]
                self.fetching = (job, want, prog)

                def cb(n: int) -> None:
                    prog[0] += n

                log.info("fetching job %s step %s from the bucket", job, want)
                t0 = time.monotonic()
                path = tier.download_step(self.store, self.root, job, want, cb)
                log.info("fetched job %s step %s: %.2f GB in %.1f s", job, want, prog[0] / 1e9, time.monotonic() - t0)
                result = {"state": "done", "step": want, "path": path, "source": "remote", "error": None}
        except Exception as e:  # the restore that asked gets it
            result = {"state": "failed", "step": step, "path": None, "source": None, "error": str(e)}
            if not isinstance(e, _NoStep):
                log.error("fetch of job %s step %s failed: %s", job, want, e)
                result["report"] = f"fetch of job {job} step {want}: {e}"
        finally:
            self.fetching = None
        self._notify("fetched", fid, result)

    def _fetch_done(self, fid: int, result: dict[str, Any]) -> None:
        report = result.pop("report", None)
        if report is not None:
            self._error(report)
        if fid not in self.fetches:
            return
        self.fetches[fid] = result
        waiters = self._fetch_waiters.pop(fid, [])
        if waiters:
            for ident, req_id, _ in waiters:
                self._send(ident, reply_ok(req_id, **result))
            self.fetches.pop(fid, None)

    def _after_commit(self, job: str, step: int) -> None:
        # older steps some rank never committed can no longer complete: fail them, free their shards
        for (j, s), t in list(self.tracks.items()):
            if j == job and s < step and t.state == "pending" and len(t.committed) < (t.local_world_size or t.world_size):
                t.state, t.error = "failed", f"superseded: step {step} was committed before every rank committed step {s}"
                if t.inflight == 0:
                    persist.remove_partial(self.root, job, s)  # rare: a rank never committed
                self._answer_waiters((j, s), t)
        # remember finished steps (even those retention removed) so a late wait() gets the truth
        done = sorted(s for (j, s), t in self.tracks.items() if j == job and t.state != "pending" and not t.waiters)
        for s in done[:-TRACKS_KEPT]:
            del self.tracks[(job, s)]

    def _answer_waiters(self, key: tuple[str, int], track: StepTrack) -> None:
        for ident, req_id, _ in track.waiters:
            self._send(ident, reply_ok(req_id, **self._step_state(key, track)))
        track.waiters.clear()

    # ------------------------------------------------------------------ slots

    def _free(self, slot: Slot) -> None:
        slot.state, slot.pid, slot.lease, slot.used_at = "free", None, None, time.monotonic()
        self._retry_deferred()

    def _unlink(self, slot: Slot) -> None:
        if slot.mapping is not None:
            slot.mapping.close()
            slot.mapping = None
        shm.unlink(slot.name)
        self.slots.pop(slot.name, None)

    def _retry_deferred(self) -> None:
        waiting, self.deferred = self.deferred, []
        for ident, msg in waiting:
            try:
                slot = self._try_lease(msg)
            except CheckpointError as e:
                self._send(ident, reply_error(msg["id"], "refused", str(e)))
                continue
            if slot is None:
                self.deferred.append((ident, msg))
            else:
                self._send(ident, reply_ok(msg["id"], segment=slot.name, size=slot.size))

    def _housekeeping(self, now: float) -> None:
        if self._metrics is not None:
            self._status_snapshot = self._op_status(b"", {})  # what the next scrape reports
        for slot in list(self.slots.values()):
            if slot.state == "leased" and slot.pid is not None and not _pid_alive(slot.pid):
                log.warning("trainer pid %s died holding %s uncommitted: slot freed, nothing of it is persisted", slot.pid, slot.name)
                self._free(slot)
            for pid, deadline in list(slot.pins.items()):
                if deadline < now or not _pid_alive(pid):
                    slot.pins.pop(pid)  # a hot restore's reader died, or holds the slot longer than any restore takes
        self.deferred = [(i, m) for i, m in self.deferred if _pid_alive(m["pid"])]
        for fid, waiters in list(self._fetch_waiters.items()):
            due = [w for w in waiters if w[2] <= now]
            if due:
                self._fetch_waiters[fid] = [w for w in waiters if w[2] > now]
                for ident, req_id, _ in due:
                    self._send(ident, reply_ok(req_id, **self.fetches.get(fid, {"state": "failed", "error": "fetch forgotten"})))
        for key, track in self.tracks.items():
            if track.waiters:
                due = [w for w in track.waiters if w[2] <= now]
                if due:
                    track.waiters = [w for w in track.waiters if w[2] > now]
                    for ident, req_id, _ in due:
                        self._send(ident, reply_ok(req_id, **self._step_state(key, track)))
