"""Multi-node commit: one daemon per node, each with its own root and endpoint, one shared bucket.
A step is committed (its manifest written to the bucket) only when every rank's shard is durable
there; the trainers' process groups play no part. Restored on a third layout through a third daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _dist import run_ranks
from _workers import restore_via_daemon, save_multinode
from test_remote import remote_toml

from ckptd import tier
from ckptd.objstore import ObjectStore, RemoteConfig

pytestmark = pytest.mark.multiproc


def test_two_nodes_four_ranks_restore_on_a_third_layout(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    conf = remote_toml(short_tmp / "r.toml", s3_bucket, commit_timeout=120)
    nodes = [make_daemon("--config", conf, sub=f"node{i}") for i in range(2)]
    expected = str(short_tmp / "expected.safetensors")
    outs = run_ranks(4, save_multinode, "fsdp2", [n.endpoint for n in nodes], "mn", expected)
    url = f"s3://{s3_bucket.bucket}/{s3_bucket.prefix}/mn/step-4"
    assert all(o["paths"][1] == url for o in outs)  # wait() answers once the step is whole in the bucket
    with ObjectStore(s3_bucket) as store:
        assert tier.remote_steps(store, "mn") == ([2, 4], [])
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


def test_multinode_step_without_a_bucket_is_refused(make_daemon) -> None:  # noqa: ANN001
    from ckptd.errors import CheckpointError

    d = make_daemon()
    with d.client("mn") as c:
        seg = c._call("alloc", job="mn", rank=0, world_size=2, step=1, nbytes=4096, pid=os.getpid())["segment"]
        fields = dict(job="mn", rank=0, world_size=2, local_world_size=1, step=1, segment=seg, nbytes=4096, replicas={})
        with pytest.raises(CheckpointError, match=r"spans several nodes .* configure \[remote\]"):
            c._call("commit", frames=(b"{}",), **fields)
        c._call("release", segment=seg)
