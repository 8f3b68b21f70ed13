"""Multi-node commit: one daemon per node, each with its own root and endpoint, one shared bucket.
A step is committed (its manifest written to the bucket) only when every rank's shard is durable
there; the trainers' process groups play no part. Restored on a third layout through a third daemon."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from _dist import run_ranks
from _workers import resave_multinode, restore_via_daemon, save_multinode, snapshot_multinode_no_wait
from test_remote import remote_toml

from ckptd.client.restore import fetch
from ckptd.storage.remote import remote_steps
from ckptd.storage.s3 import RemoteConfig, S3Store

pytestmark = pytest.mark.multiproc


def test_two_nodes_four_ranks_restore_on_a_third_layout(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    conf = remote_toml(short_tmp / "r.toml", s3_bucket, commit_timeout=120)
    nodes = [make_daemon("--config", conf, sub=f"node{i}") for i in range(2)]
    expected = str(short_tmp / "expected.safetensors")
    outs = run_ranks(4, save_multinode, "fsdp2", [n.endpoint for n in nodes], "mn", expected)
    url = f"s3://{s3_bucket.bucket}/{s3_bucket.prefix}/mn/step-4"
    assert all(o["paths"][1] == url for o in outs)  # wait() answers once the step is whole in the bucket
    with S3Store(s3_bucket) as store:
        assert remote_steps(store, "mn") == ([2, 4], [])
        names = sorted(k.rsplit("/", 1)[1] for k in store.list("mn/step-4/"))
        assert names == ["manifest.json"] + [f"rank-{r:05d}.{ext}" for r in range(4) for ext in ("json", "safetensors")]
    for node in nodes:
        # neither node holds a whole step; their parts went to the bucket and were dropped locally
        assert not os.path.exists(Path(node.root) / "mn" / "step-4")
        assert not any(n.startswith("step-") for n in os.listdir(Path(node.root) / "mn"))
        with node.client("mn") as c:
            st = c.status()
            assert st["jobs"]["mn"]["uploaded"] == 4 and st["last_error"] is None

    # a third node, with an empty root, restores into 3 FSDP1 ranks from the bucket
    third = make_daemon("--config", conf, sub="node2")
    outs = run_ranks(3, restore_via_daemon, "fsdp1", third.endpoint, "mn", expected)
    assert [o["step"] for o in outs] == [4, 4, 4]
    assert {o["source"] for o in outs} <= {"bucket", "disk"} and "bucket" in {o["source"] for o in outs}
    assert [o["extra"]["rank"] for o in outs] == [0, 1, 2]


def test_a_rolled_back_launch_saving_a_step_again_replaces_it_in_the_bucket(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    """Two nodes save steps 2 and 4; a new launch restores step 2 and saves step 4 again. The bucket's step 4
    must become the new launch's, whole: not the old manifest over overwritten shards, nor a merge of the
    two launches' fragments (the first node to finish would otherwise find the old manifest and stop)."""
    import json

    from ckptd.layout import MANIFEST, bucket_key

    conf = remote_toml(short_tmp / "r.toml", s3_bucket, commit_timeout=120)
    slow = remote_toml(
        short_tmp / "slow.toml", s3_bucket, commit_timeout=120, max_bandwidth=1_000_000
    )  # bytes/s: node 1 lags (about 9 s for its 8.8 MB)
    nodes = [make_daemon("--config", conf, sub="node0"), make_daemon("--config", conf, sub="node1")]
    expected = str(short_tmp / "expected.safetensors")
    run_ranks(4, save_multinode, "fsdp2", [n.endpoint for n in nodes], "rb", expected)
    with S3Store(s3_bucket) as store:
        old_run = json.loads(store.get_bytes(bucket_key("rb", 4, MANIFEST)))["run"]
    nodes[1].stop()
    nodes[1].start(["--config", slow])  # same root: node 1 uploads the re-save's ranks slowly
    outs = run_ranks(4, resave_multinode, "fsdp2", [n.endpoint for n in nodes], "rb", expected)
    assert {o["path"] for o in outs} == {f"s3://{s3_bucket.bucket}/{s3_bucket.prefix}/rb/step-4"}
    with S3Store(s3_bucket) as store:
        manifest = json.loads(store.get_bytes(bucket_key("rb", 4, MANIFEST)))
        assert manifest["run"] != old_run
        assert remote_steps(store, "rb") == ([2, 4], [])
    logs = nodes[0].log.read_text() + nodes[1].log.read_text()
    assert re.search(r"saved by an earlier attempt: this one \(\d+, 2\) \(a run rolled back to step 2\) replaces it", logs)
    # every manifest written for step 4 in the re-save is the new attempt's (never a merge of the two)
    wrote = re.findall(r"step 4 of job rb is complete in the bucket: wrote its manifest \(attempt \((\d+), (\w+)\)\)", logs)
    resave = {w for w in wrote if w[1] == "2"}  # either node may write it (the first to find every rank's part)
    assert len(resave) == 1 and all(w[1] in ("None", "2") for w in wrote) and int(resave.pop()[0]) == manifest["run"]
    # a third node restores the newest step from the bucket: the new launch's state, every rank's
    third = make_daemon("--config", conf, sub="node2")
    outs = run_ranks(2, restore_via_daemon, "fsdp2", third.endpoint, "rb", expected)
    assert [o["step"] for o in outs] == [4, 4]
    assert [o["extra"] for o in outs] == [{"rank": 0, "line": "new"}, {"rank": 1, "line": "new"}]


def test_multinode_step_without_a_bucket_is_refused(make_daemon) -> None:  # noqa: ANN001
    from ckptd.errors import CheckpointError

    d = make_daemon()
    with d.rpc() as rpc:
        rep = rpc.call("alloc", job="mn", rank=0, world_size=2, step=1, nbytes=4096, pid=os.getpid())
        seg = rep["segment"]
        fields = dict(job="mn", rank=0, world_size=2, local_world_size=1, step=1, segment=seg, lease=rep["lease"], nbytes=4096, replicas={})
        with pytest.raises(CheckpointError, match=r"spans several nodes .* configure \[remote\]"):
            rpc.call("commit", frames=(b"{}",), **fields)
        rpc.call("release", segment=seg, lease=rep["lease"])


def test_a_node_daemon_killed_mid_upload_uploads_its_part_after_the_restart(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    import time

    from _models import assert_same, full_state, make
    from _workers import _load_expected
    from test_remote import wait_uploaded

    import ckptd

    conf = remote_toml(short_tmp / "r.toml", s3_bucket, commit_timeout=120)
    slow = remote_toml(short_tmp / "slow.toml", s3_bucket, commit_timeout=120, max_bandwidth=2000)  # bytes/s
    node0 = make_daemon("--config", conf, sub="node0")
    node1 = make_daemon("--config", slow, sub="node1")
    expected = str(short_tmp / "expected.safetensors")
    run_ranks(4, snapshot_multinode_no_wait, "fsdp2", [node0.endpoint, node1.endpoint], "mk", expected)
    with node1.client("mk") as c:  # node 1's part is on its way to the bucket, slowly: kill its daemon
        deadline = time.monotonic() + 60
        while c.status()["uploading"] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.status()["uploading"]["step"] == 2
    node1.proc.kill()
    node1.proc.wait()
    with S3Store(s3_bucket) as store:
        assert remote_steps(store, "mk")[0] == []  # not committed: node 1's part is missing
    node1.start(["--config", conf])  # same root; recovery finds its durable part and uploads it again
    wait_uploaded(node1, "mk", 2)
    wait_uploaded(node0, "mk", 2)  # node 0 was waiting in the bucket for node 1's shards
    assert "uploading this node's part of step 2 of job mk again (ranks [2, 3])" in node1.log.read_text()
    third = make_daemon("--config", conf, sub="node2")
    with third.rpc() as rpc:
        path = fetch(rpc, "mk", 2)["path"]  # downloaded and verified; restored into one plain process
        model, optim = make(seed=7)
        ckptd.restore(model, optim, path=path)
        assert_same(full_state(model, optim), _load_expected(expected))


def _commit_raw(rpc: Any, job: str, step: int, rank: int, run: int, ws: int = 4, lws: int = 2) -> None:
    """Rank ``rank``'s shard of ``step``, leased, written and committed over the wire, as launch ``run``."""
    from _rig import shard, tree

    from ckptd import shm

    data = shard(step, rank, ws)
    rep = rpc.call("alloc", job=job, rank=rank, world_size=ws, step=step, nbytes=len(data), pid=os.getpid())
    with open(shm.path_of(rep["segment"]), "r+b") as f:
        f.write(data)
    fields = dict(job=job, rank=rank, world_size=ws, local_world_size=lws, step=step, segment=rep["segment"], lease=rep["lease"])
    rpc.call("commit", frames=(tree(rank),), nbytes=len(data), replicas={}, run=run, **fields)


def test_a_relaunch_saves_a_step_a_dead_run_left_half_committed_across_nodes_at_once(
    make_daemon, short_tmp: Path, s3_bucket: RemoteConfig
) -> None:  # noqa: ANN001
    """Run 11's ranks on node 0 committed step 4, its ranks on node 1 died first: node 0's part went up and waits in
    the bucket for node 1's. The relaunch (run 22) reaches step 4 again. Node 0 refused it ("still being made
    durable") until commit_timeout, 10 minutes by default, and its uploader, waiting, held every upload behind it. Now
    node 0 gives run 11's attempt up and the relaunch's step 4 completes in the bucket at once, its own bytes only."""
    import json
    import time

    from ckptd.layout import MANIFEST, bucket_key

    conf = remote_toml(short_tmp / "r.toml", s3_bucket, commit_timeout=90)
    nodes = [make_daemon("--config", conf, sub=f"node{i}") for i in range(2)]
    with nodes[0].rpc() as rpc0, nodes[1].rpc() as rpc1:
        for rank in (0, 1):
            _commit_raw(rpc0, "hc", 4, rank, run=11)
        with nodes[0].client("hc") as c:  # its part is up; the uploader waits for node 1's ranks, which never come
            deadline = time.monotonic() + 60
            while (c.status()["uploading"] or {}).get("step") != 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (c.status()["uploading"] or {}).get("step") == 4
        t0 = time.monotonic()
        for rank in (0, 1):
            _commit_raw(rpc0, "hc", 4, rank, run=22)  # refused before: "still being made durable"
        for rank in (2, 3):
            _commit_raw(rpc1, "hc", 4, rank, run=22)
        got = rpc0.call("wait", job="hc", step=4, timeout=80.0, rpc_timeout=85.0)
    assert got["state"] == "durable" and got["path"].endswith("/hc/step-4"), got
    assert time.monotonic() - t0 < 45, "the relaunch waited for the dead run's attempt to time out"
    with S3Store(s3_bucket) as store:
        assert json.loads(store.get_bytes(bucket_key("hc", 4, MANIFEST)))["run"] == 22
        assert remote_steps(store, "hc") == ([4], [])
    log0 = nodes[0].log.read_text()
    assert "this attempt was given up (a new run saves the step again)" in log0
    assert not any(".node-" in n for n in os.listdir(Path(nodes[0].root) / "hc")), "the given-up part was not removed"
    with nodes[0].client("hc") as c:
        assert c.status()["last_error"] is None
