"""Peer links without training: the cluster key file, a daemon's replica store (:mod:`ckptd.daemon.replicas`) and the
store that talks to it (:mod:`ckptd.storage.peer`) over real CurveZMQ on loopback; the attacks: a peer without the
key, malformed and hostile messages, damaged chunks, writes past the budget or into another connection's upload;
and a step replicated and pulled back whole, verified, by the bucket tier's own upload and download."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from ckptd import peerwire, shm
from ckptd.daemon.replicas import ReplicaServer
from ckptd.errors import CheckpointError, FormatError, ProtocolError
from ckptd.format import digest
from ckptd.peerkey import KeyFileError, keygen, load_key
from ckptd.storage.peer import Pacer, PeerError, PeerStore


@pytest.fixture
def key(tmp_path: Path):  # noqa: ANN201
    return keygen(str(tmp_path / "cluster.key"))


class Peer:
    """A replica store serving on a loopback port, and what it needs: a context, a segment directory."""

    def __init__(self, root: Path, key, budget: int = 64 << 20) -> None:  # noqa: ANN001
        self.segments = shm.SegmentDir(str(root))
        self.server = ReplicaServer("tcp://127.0.0.1:*", key, self.segments, budget)
        self.server.start()
        self.endpoint = f"tcp://127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.segments.close()


@pytest.fixture
def peer(tmp_path: Path, key) -> Iterator[Peer]:  # noqa: ANN001
    root = tmp_path / "peer-root"
    root.mkdir()
    p = Peer(root, key)
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(os.path.join(shm.SHM_DIR, p.segments.name), ignore_errors=True)


@pytest.fixture
def store(peer: Peer, key) -> Iterator[PeerStore]:  # noqa: ANN001
    s = PeerStore(peer.endpoint, key, timeout=5.0)
    try:
        yield s
    finally:
        s.close()


# ---------------------------------------------------------------------------- the key file


def test_keygen_writes_a_0600_key_pair_that_loads_and_is_never_overwritten(tmp_path: Path) -> None:
    path = str(tmp_path / "k")
    made = keygen(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = load_key(path)
    assert (loaded.public, loaded.secret) == (made.public, made.secret)
    assert made.secret.decode() not in repr(loaded)
    with pytest.raises(KeyFileError, match="never overwritten"):
        keygen(path)
    assert load_key(path).secret == made.secret


def test_a_key_file_others_may_read_is_refused_naming_the_fix(tmp_path: Path) -> None:
    path = str(tmp_path / "k")
    keygen(path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match=r"mode 0644.*chmod 600"):
        load_key(path)


def test_a_key_file_of_another_user_a_symlink_or_a_fifo_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "k")
    keygen(path)
    link = str(tmp_path / "link")
    os.symlink(path, link)
    with pytest.raises(KeyFileError, match="cannot open"):
        load_key(link)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_key(fifo)
    if os.geteuid() == 0:
        os.chown(path, 65534, -1)  # planted by another user: not this daemon's secret
        with pytest.raises(KeyFileError, match="belongs to uid 65534"):
            load_key(path)


@pytest.mark.parametrize(
    "body, match",
    [
        (b"not json", "not JSON"),
        (b'{"kind": "something-else", "version": 1}', "not a ckptd peer key file"),
        (b'{"kind": "ckptd-peer-key", "version": 1, "public": "short", "secret": "short"}', "40-character"),
        (b"x" * 5000, "larger than"),
    ],
)
def test_a_file_that_holds_no_key_pair_is_refused(tmp_path: Path, body: bytes, match: str) -> None:
    path = tmp_path / "k"
    path.write_bytes(body)
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match=match):
        load_key(str(path))


def test_a_key_pair_whose_halves_do_not_match_is_refused(tmp_path: Path) -> None:
    a, b = keygen(str(tmp_path / "a")), keygen(str(tmp_path / "b"))
    path = tmp_path / "mixed"
    path.write_text(json.dumps({"kind": "ckptd-peer-key", "version": 1, "public": a.public.decode(), "secret": b.secret.decode()}))
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match="not the secret key's"):
        load_key(str(path))


# ---------------------------------------------------------------------------- the store over the link


def test_objects_go_to_a_peer_and_come_back_byte_for_byte(store: PeerStore, peer: Peer, tmp_path: Path) -> None:
    big = os.urandom(peerwire.CHUNK_BYTES * 2 + 12345)  # three chunks, held in a segment of the peer's
    src = tmp_path / "shard"
    src.write_bytes(big)
    store.put_file("job/step-3/rank-00000.safetensors", str(src))
    store.put_bytes("job/step-3/manifest.json", b'{"small": true}')  # held in the peer's memory
    listed = store.list_sized("job/")
    assert {k: size for k, (_, size) in listed.items()} == {"job/step-3/rank-00000.safetensors": len(big), "job/step-3/manifest.json": 15}
    assert store.get_bytes("job/step-3/manifest.json") == b'{"small": true}'
    out = tmp_path / "back"
    store.get_file("job/step-3/rank-00000.safetensors", str(out))
    assert out.read_bytes() == big
    assert store.get_head("job/step-3/rank-00000.safetensors", 100) == (big[:100], len(big))
    with pytest.raises(FormatError, match="more than"):
        store.get_bytes("job/step-3/rank-00000.safetensors", limit=1000)
    with pytest.raises(FileNotFoundError):
        store.get_bytes("job/step-3/missing.json")
    assert peer.server.summary()["steps_held"] == {"job": [3]}
    held = peer.server.summary()["replica_bytes"]
    assert held >= len(big) and any(os.scandir(os.path.join(shm.SHM_DIR, peer.segments.name)))
    store.delete(["job/step-3/rank-00000.safetensors", "job/step-3/manifest.json"])
    assert store.list("job/") == [] and peer.server.summary()["replica_bytes"] == 0


def test_a_completed_step_replaces_the_jobs_older_replica(store: PeerStore, peer: Peer) -> None:
    for step in (1, 2):
        store.put_bytes(f"j/step-{step}/rank-00000.safetensors", b"x" * 10)
        store.put_bytes(f"j/step-{step}/manifest.json", b"{}")
    store.put_bytes("other/step-1/manifest.json", b"{}")
    assert store.list("") == ["j/step-2/manifest.json", "j/step-2/rank-00000.safetensors", "other/step-1/manifest.json"]


def test_an_incomplete_step_its_sender_moved_on_from_is_dropped_once_a_later_one_completes(store: PeerStore) -> None:
    store.put_bytes("j/step-7/rank-00000.safetensors", b"superseded while it was sent")
    store.put_bytes("other/step-1/rank-00000.safetensors", b"another job's, still arriving")
    store.put_bytes("j/step-8/rank-00000.safetensors", b"x")
    store.put_bytes("j/step-8/manifest.json", b"{}")
    assert store.list("") == ["j/step-8/manifest.json", "j/step-8/rank-00000.safetensors", "other/step-1/rank-00000.safetensors"]


def test_a_put_past_the_replica_budget_is_refused_and_takes_nothing(tmp_path: Path, key) -> None:  # noqa: ANN001
    root = tmp_path / "small"
    root.mkdir()
    p = Peer(root, key, budget=4 << 20)
    s = PeerStore(p.endpoint, key, timeout=5.0)
    try:
        with pytest.raises(PeerError, match="no room for a replica"):
            s.put_bytes("j/step-1/rank-00000.safetensors", bytes(5 << 20))
        assert p.server.summary()["replica_bytes"] == 0 and p.server.summary()["refused"] == 1
        s.put_bytes("j/step-1/rank-00000.safetensors", bytes(3 << 20))  # what fits still goes
    finally:
        s.close()
        p.close()


def test_a_peer_without_the_cluster_key_is_refused_before_it_sends_a_byte(peer: Peer, tmp_path: Path) -> None:
    stranger = keygen(str(tmp_path / "stranger.key"))
    s = PeerStore(peer.endpoint, stranger, timeout=1.0)
    try:
        with pytest.raises(PeerError, match="not connected|did not answer"):
            s.put_bytes("j/step-1/manifest.json", b"{}")
    finally:
        s.close()
    plain = zmq.Context.instance().socket(zmq.DEALER)  # no encryption at all
    plain.linger = 0
    plain.connect(peer.endpoint)
    plain.send_multipart([peerwire.request("put", 1, key="j/step-1/manifest.json", size=2)])
    assert not plain.poll(1000)
    plain.close(0)
    summary = peer.server.summary()
    assert summary["uploads_open"] == 0 and summary["bytes_received"] == 0 and summary["steps_held"] == {}


def raw(peer: Peer, key) -> zmq.Socket:  # noqa: ANN001
    """A DEALER holding the key that speaks the wire protocol by hand: what a buggy or hostile member sends."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.curve_secretkey, s.curve_publickey, s.curve_serverkey = key.secret, key.public, key.public
    s.connect(peer.endpoint)
    return s


def ask(s: zmq.Socket, *frames: bytes) -> dict:
    s.send_multipart(list(frames))
    assert s.poll(5000), "the peer stopped answering"
    return json.loads(s.recv_multipart()[0])


@pytest.mark.parametrize(
    "frames, code",
    [
        ([b"\xff\xfe garbage"], "bad_request"),
        ([b"[]"], "bad_request"),
        ([peerwire.encode({"v": 99, "op": "ping", "id": 1})], "bad_request"),
        ([peerwire.request("put", 1, key="../../etc/passwd", size=1)], "bad_request"),
        ([peerwire.request("put", 1, key="j/step-1/../../x", size=1)], "bad_request"),
        ([peerwire.request("put", 1, key="j/notastep/x", size=1)], "bad_request"),
        ([peerwire.request("put", 1, key="j/step-1/x", size=-1)], "bad_request"),
        ([peerwire.request("put", 1, key="j/step-1/x", size=True)], "bad_request"),
        ([peerwire.request("put", 1, key="j/step-1/x", size=1, extra=1)], "bad_request"),
        ([peerwire.request("get", 1, key="j/step-1/x", offset=0)], "bad_request"),
        ([peerwire.request("chunk", 1, upload=1, offset=0, xxh3="00")], "bad_request"),  # its data frame missing
        ([peerwire.request("list", 1, prefix="../")], "bad_request"),
        ([peerwire.request("chunk", 1, upload=999, offset=0, xxh3="00"), b"x"], "bad_request"),  # nobody's upload
    ],
)
def test_malformed_and_hostile_requests_are_refused_and_the_peer_goes_on(peer: Peer, key, frames: list[bytes], code: str) -> None:  # noqa: ANN001
    s = raw(peer, key)
    try:
        assert ask(s, *frames)["code"] == code
        assert ask(s, peerwire.request("ping", 7)) == {"v": 1, "id": 7, "ok": True}
    finally:
        s.close(0)


def test_a_damaged_chunk_is_refused_and_the_object_never_appears(peer: Peer, key) -> None:  # noqa: ANN001
    s = raw(peer, key)
    try:
        upload = ask(s, peerwire.request("put", 1, key="j/step-1/manifest.json", size=4))["upload"]
        bad = ask(s, peerwire.request("chunk", 2, upload=upload, offset=0, xxh3=digest(b"abcd")), b"abcX")
        assert not bad["ok"] and "damaged" in bad["error"]
        past = ask(s, peerwire.request("chunk", 3, upload=upload, offset=0, xxh3=digest(b"abcde")), b"abcde")
        assert past["code"] == "bad_request"  # more than the put declared
        early = ask(s, peerwire.request("end", 4, upload=upload))
        assert early["code"] == "bad_request" and "ended at 0 of 4" in early["error"]
        assert ask(s, peerwire.request("list", 5, prefix=""))["objects"] == {}
        assert peer.server.summary()["bad_chunks"] == 1
    finally:
        s.close(0)


def test_one_connection_cannot_write_or_end_anothers_upload(peer: Peer, key) -> None:  # noqa: ANN001
    a, b = raw(peer, key), raw(peer, key)
    try:
        upload = ask(a, peerwire.request("put", 1, key="j/step-1/manifest.json", size=2))["upload"]
        theirs = ask(b, peerwire.request("chunk", 1, upload=upload, offset=0, xxh3=digest(b"no")), b"no")
        assert theirs["code"] == "bad_request" and "no upload" in theirs["error"]
        assert ask(b, peerwire.request("end", 2, upload=upload))["code"] == "bad_request"
        assert ask(a, peerwire.request("chunk", 2, upload=upload, offset=0, xxh3=digest(b"ok")), b"ok")["ok"]
        assert ask(a, peerwire.request("end", 3, upload=upload))["ok"]
    finally:
        a.close(0)
        b.close(0)


def test_a_peer_that_is_down_is_an_error_naming_it_not_a_hang(key) -> None:  # noqa: ANN001
    s = PeerStore("tcp://127.0.0.1:9", key, timeout=1.0)  # nothing listens on the discard port
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerError, match="127.0.0.1:9"):
            s.check()
    finally:
        s.close()
    assert time.monotonic() - t0 < 10


def test_a_peer_that_vanishes_mid_stream_is_an_error_in_seconds_and_its_partial_object_never_appears(
    tmp_path: Path,
    key,  # noqa: ANN001
) -> None:
    import threading

    root = tmp_path / "vanishing"
    root.mkdir()
    p = Peer(root, key)
    s = PeerStore(p.endpoint, key, pacer=Pacer(8 << 20), timeout=2.0)  # 64 MiB at 8 MiB/s: 8 s if nothing happens
    errors: list[BaseException] = []

    def put() -> None:
        try:
            s.put_bytes("j/step-1/rank-00000.safetensors", bytes(64 << 20))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=put)
    th.start()
    deadline = time.monotonic() + 10
    while p.server.summary()["bytes_received"] == 0:  # streaming
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    p.close()  # the peer's daemon is gone, its half-received object with it
    th.join(30)
    s.close()
    assert not th.is_alive() and time.monotonic() - t0 < 15
    assert len(errors) == 1 and isinstance(errors[0], PeerError) and p.endpoint in str(errors[0])


def test_the_pacer_keeps_to_its_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(t: float) -> None:
        slept.append(t)
        now[0] += t

    p = Pacer(1000.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        p.take(500)
    assert now[0] == pytest.approx(2.0)  # 2500 bytes at 1000/s: the first 500 go at once
    assert Pacer(0).take(10**12) is None  # no limit: no wait


def test_the_wire_refuses_keys_outside_the_bucket_layout() -> None:
    for bad in ("", "/abs/step-1/x", "j", "j/step-1", "j/step-x/y", "j/step-1/a/b/c", "j/step-1/.", "j/step-1/..", "..", "j/step-1/a b"):
        with pytest.raises(ProtocolError):
            peerwire.check_key(bad)
    assert peerwire.check_key("j/step-12/run-1-after-none/rank-00001.json")


def test_a_step_goes_up_and_comes_back_verified_and_a_corrupt_replica_is_caught(
    store: PeerStore,
    peer: Peer,
    tmp_path: Path,
    daemon,  # noqa: ANN001
) -> None:
    from _models import make, train_step

    from ckptd.storage.remote import download_step, upload_step

    model, optim = make()
    train_step(model, optim, 1)
    with daemon.client("job") as c:
        src = c.snapshot(model, optim, step=4, blocking=True).wait()  # a complete step, as the daemon writes it
    upload_step(store, src, "job", 4)
    got = download_step(store, str(tmp_path / "dst"), "job", 4)
    from ckptd.format import fragments_of

    manifest = json.loads(Path(src, "manifest.json").read_bytes())
    on_disk = json.loads(Path(src, "rank-00000.json").read_bytes())  # the fragment the persist thread wrote
    rebuilt = fragments_of(manifest)[0]  # what a memory-only step's replica carries instead
    assert {k: v for k, v in rebuilt.items() if k not in ("replicas", "chunks")} == {
        k: v for k, v in on_disk.items() if k not in ("replicas", "chunks")
    }
    assert sorted(rebuilt["chunks"], key=lambda c: c["name"]) == sorted(on_disk["chunks"], key=lambda c: c["name"])
    names = [n for n in os.listdir(got) if not n.startswith(".")]  # the manifest and the files it lists
    assert "manifest.json" in names and any(n.endswith(".safetensors") for n in names)
    for name in names:
        assert Path(got, name).read_bytes() == Path(src, name).read_bytes()
    # the peer's copy damaged in its memory (a bad DIMM, a bug): the download fails naming the object, leaves nothing
    with peer.server._lock:
        shard = next(o for k, o in peer.server.objects.items() if k.endswith(".safetensors"))
    view = shard.view()
    view[-1] ^= 0xFF
    view.release()
    with pytest.raises(CheckpointError, match="corrupt"):
        download_step(store, str(tmp_path / "dst2"), "job", 4)
    assert not (tmp_path / "dst2" / "job" / "step-4").exists()


def test_a_step_completed_after_a_later_one_was_queued_never_takes_its_place() -> None:
    """A durable step (persisted slowly) completes after a memory-only step committed later: the later one stays queued
    and the earlier one is superseded (it once replaced the later one, which was then never sent)."""
    from ckptd.daemon.events import Replicated
    from ckptd.daemon.replicator import ReplicaSource, Replicator

    reported: list[Replicated] = []
    r = Replicator([], 1, lambda name: -1, reported.append)
    r.shutdown()  # the thread gone: what is queued stays there to be looked at
    r.submit(ReplicaSource("j", 4, committed_at=40, manifest={}))
    r.submit(ReplicaSource("j", 3, committed_at=30, path="/nonexistent"))
    assert [s.step for s in r._queue.values()] == [4] and reported == [Replicated("j", 3, "superseded")]
    r.submit(ReplicaSource("j", 5, committed_at=50, manifest={}))  # a later one still replaces it
    assert [s.step for s in r._queue.values()] == [5] and reported[-1] == Replicated("j", 4, "superseded")
