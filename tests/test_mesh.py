"""A job that spans nodes, its steps held in the memory of its daemons (no bucket): several daemons on loopback as
nodes, each its own root, socket, segment directory and peer port, ranks under gloo. Losing a node loses no step: a
fresh daemon in its place and the relaunched ranks restore the newest step bit-exact, and so does another layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _dist import run_ranks
from _workers import restore_via_daemon, save_mesh
from test_remote import remote_toml
from test_replication import free_port, lose

from ckptd import shm
from ckptd.peerkey import keygen
from ckptd.storage.remote import remote_steps
from ckptd.storage.s3 import RemoteConfig, S3Store

pytestmark = pytest.mark.multiproc
JOB = "mesh"


class Ring:
    """Daemons as nodes that hold each other's parts of a job's steps (``--peer-listen``, ``--replicas``)."""

    def __init__(self, make_daemon, tmp: Path, n: int, *extra: str) -> None:  # noqa: ANN001
        self.make, self.key, self.extra = make_daemon, str(tmp / "cluster.key"), extra
        keygen(self.key)
        self.urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
        self.nodes = [self.start(i) for i in range(n)]

    def start(self, i: int, sub: str | None = None):  # noqa: ANN201
        return self.make(
            "--peer-listen",
            self.urls[i],
            "--peer-key",
            self.key,
            "--replicas",
            "1",
            "--shm-budget",
            "512M",
            *self.extra,
            sub=sub or f"node{i}",
        )

    @property
    def endpoints(self) -> list[str]:
        return [n.endpoint for n in self.nodes]


@pytest.mark.parametrize("world", [2, 4], ids=["2x1", "2x2"])
def test_a_lost_node_loses_no_step_of_a_job_that_spans_nodes(make_daemon, short_tmp: Path, world: int) -> None:  # noqa: ANN001
    ring = Ring(make_daemon, short_tmp, 2)
    expected = str(short_tmp / "expected.safetensors")
    outs = run_ranks(world, save_mesh, "fsdp2", ring.endpoints, JOB, expected, [1, 2, 3, 4, 5])
    for o in outs:
        assert o["memory"] == "memory" and o["durable"] == "held in memory"
        assert o["replicated"]["state"] == "replicated" and len(o["replicated"]["peers"]) == 1
    for node in ring.nodes:
        with node.client("probe") as c:
            st = c.status()
        assert st["jobs"][JOB]["memory_only"] == [5] and st["jobs"][JOB].get("latest") is None  # nothing on disk
        assert st["replicas_held"]["steps_held"] == {JOB: [5]}  # the manifest, beside its own part and the other's copy
        assert st["mesh"]["rings"] == {JOB: ring.urls} and st["last_error"] is None
    shown = subprocess.run([sys.executable, "-m", "ckptd", "status", "--endpoint", ring.nodes[0].endpoint], capture_output=True, text=True)
    assert f"spans       {JOB}: 2 daemons, this one {ring.urls[0]}; step 5 replicated ({ring.urls[1]})" in shown.stdout, shown
    lose(ring.nodes[1])
    if world == 2:  # a replacement: empty root, empty shared memory; here on another address (a new host), there the same
        ring.urls[1] = f"tcp://127.0.0.1:{free_port()}"
    ring.nodes[1] = ring.start(1, sub="node1b")
    outs = run_ranks(world, restore_via_daemon, "fsdp2", ring.endpoints, JOB, expected)
    assert [o["step"] for o in outs] == [5] * world
    per_node = world // 2  # each node's first fetch pulls the step from the daemons; its other ranks find it on disk then
    assert all("peer" in {o["source"] for o in outs[n * per_node : (n + 1) * per_node]} for n in range(2))
    assert {o["source"] for o in outs} <= {"peer", "disk"}
    assert [o["extra"] for o in outs] == [{"rank": r, "step": 5} for r in range(world)]
    # and into another layout: three FSDP1 ranks on the surviving node (the step is on its disk now)
    outs = run_ranks(3, restore_via_daemon, "fsdp1", ring.nodes[0].endpoint, JOB, expected)
    assert [o["step"] for o in outs] == [5, 5, 5]


def status_of(d) -> dict:  # noqa: ANN001
    with d.client("probe") as c:
        return c.status()


def held_segment(d, job: str, step: int, rank: int) -> str:  # noqa: ANN001
    """The segment that holds ``rank``'s shard of ``step`` in daemon ``d``'s memory tier (by its commit record)."""
    base = os.path.join(shm.SHM_DIR, shm.SegmentDir.read_marker(d.root))
    for name in os.listdir(base):
        if name.endswith(shm.RECORD_SUFFIX):
            with open(os.path.join(base, name), "rb") as f:
                rec = json.loads(f.readline())
            if (rec["job"], rec["step"], rec["rank"]) == (job, step, rank):
                return os.path.join(base, name.removesuffix(shm.RECORD_SUFFIX))
    raise AssertionError(f"no segment of {d.root} holds {job} step {step} rank {rank}")


def test_a_copy_that_fails_its_checksums_is_read_again_from_the_other_daemon(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    ring = Ring(make_daemon, short_tmp, 2)
    expected = str(short_tmp / "expected.safetensors")
    run_ranks(2, save_mesh, "fsdp2", ring.endpoints, JOB, expected, [1, 2, 3])
    with open(held_segment(ring.nodes[0], JOB, 3, 0), "r+b") as f:  # node 0's own copy of its part, damaged in memory
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    outs = run_ranks(2, restore_via_daemon, "fsdp2", ring.endpoints, JOB, expected)  # node 1's copy of that part is whole
    assert [o["step"] for o in outs] == [3, 3] and [o["extra"] for o in outs] == [{"rank": r, "step": 3} for r in range(2)]
    log = ring.nodes[0].log.read_text()
    assert "is corrupt" in log and "trying the next source" in log


def test_both_copies_of_a_part_lost_is_an_error_naming_the_step_and_what_is_missing(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    ring = Ring(make_daemon, short_tmp, 3)
    expected = str(short_tmp / "expected.safetensors")
    run_ranks(3, save_mesh, "ddp", ring.endpoints, JOB, expected, [1, 2])
    lose(ring.nodes[2])  # node 2's part: its own copy, and the one on node 0 (the next in the ring)
    lose(ring.nodes[0])
    ring.nodes[0], ring.nodes[2] = ring.start(0, sub="node0b"), ring.start(2, sub="node2b")
    with pytest.raises(AssertionError) as e:
        run_ranks(3, restore_via_daemon, "ddp", ring.endpoints, JOB, expected)
    said = str(e.value)
    assert "step 2 of job 'mesh' could not be fetched from any source" in said
    assert "rank-00002.safetensors" in said and "no daemon of the job" in said
    assert "no earlier step of job 'mesh' is restorable" in said


def test_the_ring_a_rank_names_is_checked(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    from ckptd.errors import ProtocolError

    ring = Ring(make_daemon, short_tmp, 1)
    plain = make_daemon(sub="plain")
    other = f"tcp://127.0.0.1:{free_port()}"
    with ring.nodes[0].rpc() as rpc:
        for bad in ([ring.urls[0]], [ring.urls[0], ring.urls[0]], [ring.urls[0], "ipc:///tmp/x"], [ring.urls[0], "tcp://a b:1"], "x"):
            with pytest.raises(ProtocolError, match="ring"):
                rpc.call("ring", job=JOB, ring=bad)
        assert rpc.call("ring", job=JOB, ring=[other, f"tcp://127.0.0.1:{free_port()}"])["used"] is False  # not this daemon's
        got = rpc.call("ring", job=JOB, ring=[ring.urls[0], other])
        assert got["used"] is True and got["reason"] is None
    with plain.rpc() as rpc:
        got = rpc.call("ring", job=JOB, ring=[ring.urls[0], other])
        assert got["used"] is False and "--peer-listen" in got["reason"]


def test_with_a_bucket_the_steps_numbered_a_multiple_of_n_go_through_it_the_others_stay_in_memory(
    make_daemon,
    short_tmp: Path,
    s3_bucket: RemoteConfig,  # noqa: ANN001
) -> None:
    conf = remote_toml(short_tmp / "r.toml", s3_bucket, commit_timeout=120)
    ring = Ring(make_daemon, short_tmp, 2, "--config", conf)
    expected = str(short_tmp / "expected.safetensors")
    outs = run_ranks(2, save_mesh, "fsdp2", ring.endpoints, JOB, expected, [1, 2, 3, 4, 5], 3)
    assert [o["durable"] for o in outs] == ["held in memory"] * 2 and [o["memory"] for o in outs] == ["memory"] * 2
    with S3Store(s3_bucket) as store:  # 3, a multiple of persist_every (nobody waited for its upload); 1, 2, 4, 5 in memory only
        deadline = time.monotonic() + 120
        while (found := remote_steps(store, JOB)) != ([3], []):
            assert time.monotonic() < deadline and found in (([], []), ([], [3])), found
            time.sleep(0.2)
    for node in ring.nodes:
        deadline = time.monotonic() + 60  # the node that did not write the manifest sees it at its next poll
        while (st := status_of(node))["jobs"][JOB].get("uploaded") != 3:
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        assert st["jobs"][JOB]["memory_only"] == [5] and st["last_error"] is None
    lose(ring.nodes[1])
    ring.nodes[1] = ring.start(1, sub="node1b")
    outs = run_ranks(2, restore_via_daemon, "fsdp2", ring.endpoints, JOB, expected)  # the newest: 5, from the daemons
    assert [o["step"] for o in outs] == [5, 5] and [o["source"] for o in outs] == ["peer", "peer"]
