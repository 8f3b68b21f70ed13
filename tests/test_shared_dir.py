"""Multi-node jobs on a shared directory instead of a bucket: one daemon per "node", each with its own root and
socket and its own view of one shared directory (``--remote-path``). Each test runs twice: on a local directory, and
on a real network file system (each node its own sshfs mount of one export over a loopback sshd), where caching and
rename semantics are a network file system's. 2 nodes x 2 ranks, FSDP2 on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _dist import run_ranks
from _models import assert_same, full_state, make
from _workers import _load_expected, resave_multinode, restore_via_daemon, save_multinode, snapshot_multinode_no_wait
from conftest import SharedFS
from test_remote import wait_uploaded

import ckptd
from ckptd.client.restore import fetch
from ckptd.layout import MANIFEST, bucket_key
from ckptd.storage.posix import DirStore
from ckptd.storage.remote import remote_steps

pytestmark = pytest.mark.multiproc


def _node(make_daemon, fs: SharedFS, i: int, *extra: str):  # noqa: ANN001, ANN202
    """Node ``i``'s daemon, on its own root, socket and mount of the shared directory (``.mount``)."""
    mount = fs.mount(f"m{i}")
    d = make_daemon("--remote-path", mount, "--config", _toml(fs), *extra, sub=f"node{i}")
    d.mount = mount
    return d


def _toml(fs: SharedFS) -> str:
    """A config holding the shared tier's wait: the multi-node commit gets 120 s on a loaded machine."""
    path = Path(fs.export).parent / "remote.toml"
    if not path.exists():
        path.write_text(f'[remote]\npath = "{fs.export}"\ncommit_timeout = 120\n')  # --remote-path replaces the path
    return str(path)


def test_two_nodes_save_to_a_shared_directory_and_a_third_restores_elsewhere(make_daemon, short_tmp: Path, shared_fs: SharedFS) -> None:  # noqa: ANN001
    nodes = [_node(make_daemon, shared_fs, i) for i in range(2)]
    expected = str(short_tmp / "expected.safetensors")
    outs = run_ranks(4, save_multinode, "fsdp2", [n.endpoint for n in nodes], "sd", expected)
    for rank, o in enumerate(outs):  # wait() answers once the step is whole in the shared directory, as that node sees it
        assert o["paths"][1] == os.path.join(nodes[rank // 2].mount, "sd", "step-4")
    store = DirStore(shared_fs.export)
    assert remote_steps(store, "sd") == ([2, 4], [])
    manifest = json.loads(store.get_bytes(bucket_key("sd", 4, MANIFEST)))
    folder = f"run-{manifest['run']}-after-none/"
    assert sorted(store.list("sd/step-4/")) == [f"sd/step-4/{MANIFEST}"] + sorted(
        f"sd/step-4/{folder}rank-{r:05d}.{ext}" for r in range(4) for ext in ("json", "safetensors")
    )
    assert not [n for n in _all_names(shared_fs.export) if n.startswith(".ckptd-")], "temporary files were left behind"
    for node in nodes:  # neither node keeps a whole step: their parts went to the shared directory
        assert not any(n.startswith("step-") for n in os.listdir(Path(node.root) / "sd"))
        with node.client("sd") as c:
            assert c.status()["last_error"] is None
    # the step is a checkpoint in place: verify and restore read the shared directory directly
    step = os.path.join(shared_fs.export, "sd", "step-4")
    r = _cli("verify", step)
    assert r.returncode == 0 and r.stdout.strip().endswith(": OK"), r.stdout + r.stderr
    # a fresh mount: a mount that listed the job's folder before may show the old listing for its cache's lifetime
    listed = _cli("ls", "--root", shared_fs.mount("ls"), "--job", "sd").stdout
    assert [line.split()[1] for line in listed.splitlines()[1:]] == ["2", "4"] and "<- latest" in listed.splitlines()[-1], listed
    out = short_tmp / "model.safetensors"
    r = _cli("export", "--job", "sd", "--root", shared_fs.mount("exporting"), "--out", str(out))  # a fresh mount, as for ls
    assert r.returncode == 0 and out.stat().st_size > 0, r.stdout + r.stderr
    model, optim = make(seed=5)
    ckptd.restore(model, optim, path=step)
    assert_same(full_state(model, optim), _load_expected(expected))
    # a third node with an empty root and its own mount restores into 3 FSDP1 ranks
    third = _node(make_daemon, shared_fs, 2)
    outs = run_ranks(3, restore_via_daemon, "fsdp1", third.endpoint, "sd", expected)
    assert [o["step"] for o in outs] == [4, 4, 4]
    assert "bucket" in {o["source"] for o in outs}  # the shared tier, as restore names it
    assert [o["extra"]["rank"] for o in outs] == [0, 1, 2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=120)


def _all_names(top: str) -> list[str]:
    return [n for _, dirs, files in os.walk(top) for n in dirs + files]


def test_a_node_daemon_killed_mid_persist_completes_the_step_after_its_restart(make_daemon, short_tmp: Path, shared_fs: SharedFS) -> None:  # noqa: ANN001
    """Node 1 persists slowly (a write rate limit) and is killed while its ranks' shards are being written: the step is
    not complete anywhere. Restarted on the same root, it persists its committed shards and puts its part in the shared
    directory, where node 0 was waiting: the step completes, and a third node restores it bit-exact."""
    node0 = _node(make_daemon, shared_fs, 0)
    node1 = _node(make_daemon, shared_fs, 1, "--write-rate-limit", "20K", "--workers", "1")
    expected = str(short_tmp / "expected.safetensors")
    run_ranks(4, snapshot_multinode_no_wait, "fsdp2", [node0.endpoint, node1.endpoint], "mk", expected)
    with node1.client("mk") as c:  # its ranks are committed and being written, slowly
        st = c.status()
        assert st["staged_bytes"] > 0, st
    node1.kill()
    store = DirStore(shared_fs.export)
    assert remote_steps(store, "mk")[0] == []  # not complete: node 1's part is missing
    node1.start(["--remote-path", node1.mount, "--config", _toml(shared_fs)])  # same root and mount, no rate limit
    wait_uploaded(node1, "mk", 2, timeout=120)
    wait_uploaded(node0, "mk", 2, timeout=120)  # node 0 was waiting in the shared directory for node 1's part
    assert remote_steps(store, "mk") == ([2], [])
    third = _node(make_daemon, shared_fs, 2)
    with third.rpc() as rpc:
        path = fetch(rpc, "mk", 2)["path"]  # copied to its root and verified; restored into one plain process
    model, optim = make(seed=7)
    ckptd.restore(model, optim, path=path)
    assert_same(full_state(model, optim), _load_expected(expected))


def test_a_rolled_back_launch_replaces_a_step_across_nodes(make_daemon, short_tmp: Path, shared_fs: SharedFS) -> None:  # noqa: ANN001
    """Two nodes save steps 2 and 4; a new launch restores step 2 and saves step 4 again: the shared directory's step 4
    becomes the new launch's, whole, and the old attempt's files go once they are settled."""
    nodes = [_node(make_daemon, shared_fs, i) for i in range(2)]
    expected = str(short_tmp / "expected.safetensors")
    run_ranks(4, save_multinode, "fsdp2", [n.endpoint for n in nodes], "rb", expected)
    store = DirStore(shared_fs.export)
    old_run = json.loads(store.get_bytes(bucket_key("rb", 4, MANIFEST)))["run"]
    outs = run_ranks(4, resave_multinode, "fsdp2", [n.endpoint for n in nodes], "rb", expected)
    assert all(o["path"].endswith("/rb/step-4") for o in outs)
    manifest = json.loads(store.get_bytes(bucket_key("rb", 4, MANIFEST)))
    assert manifest["run"] != old_run and manifest["after"] == 2
    assert remote_steps(store, "rb") == ([2, 4], [])
    third = _node(make_daemon, shared_fs, 2)
    outs = run_ranks(2, restore_via_daemon, "fsdp2", third.endpoint, "rb", expected)
    assert [o["step"] for o in outs] == [4, 4] and [o["extra"]["line"] for o in outs] == ["new", "new"]


def test_a_shared_directory_that_is_not_mounted_is_reported_not_used(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    """A mount point that is not there (the file system failed to mount) is reported at start, naming it, as an
    unreachable bucket is: the daemon still serves local checkpoints."""
    d = make_daemon("--remote-path", str(short_tmp / "not-mounted"))
    deadline = time.monotonic() + 60
    with d.client("nm") as c:
        while (c.status()["last_error"] or "") == "" and time.monotonic() < deadline:
            time.sleep(0.1)
        error = c.status()["last_error"]
    assert f"shared directory {short_tmp / 'not-mounted'} is not usable" in error and "is it mounted?" in error
    assert not (short_tmp / "not-mounted").exists(), "the daemon made the mount point itself"


def test_a_full_shared_file_system_fails_the_step_clearly_and_loses_none(make_daemon, small_fs: str) -> None:  # noqa: ANN001
    """The shared directory is a 3 MiB tmpfs. Step 1 completes; then the file system fills up: step 2 fails on both
    nodes with an error naming ENOSPC and the file, is never complete, and step 1 stays the newest complete step.
    With room again, step 3 completes."""
    from test_multinode import _commit_raw

    nodes = [make_daemon("--remote-path", small_fs, "--config", _commit_timeout_toml(small_fs), sub=f"node{i}") for i in range(2)]
    store = DirStore(small_fs)

    def save(step: int) -> list[Any]:
        answers = []
        with nodes[0].rpc() as rpc0, nodes[1].rpc() as rpc1:
            for rank in range(4):
                _commit_raw(rpc0 if rank < 2 else rpc1, "full", step, rank, run=7)
            for rpc in (rpc0, rpc1):
                answers.append(rpc.call("wait", job="full", step=step, timeout=60.0, rpc_timeout=65.0))
        return answers

    assert [a["state"] for a in save(1)] == ["durable", "durable"]
    filler = os.path.join(small_fs, "filler")
    with open(filler, "wb") as f:  # another user's file takes the room that is left
        f.write(b"\0" * (os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize - 4096))
    failed = save(2)
    assert [a["state"] for a in failed] == ["failed", "failed"], failed
    assert all("No space left on device" in a["error"] and "/full/step-2/" in a["error"] for a in failed), failed
    assert remote_steps(store, "full")[0] == [1]  # step 2 never complete; step 1 still the newest complete step
    assert not [n for n in _all_names(small_fs) if n.startswith(".ckptd-")], "temporary files were left behind"
    os.unlink(filler)
    assert [a["state"] for a in save(3)] == ["durable", "durable"]
    assert remote_steps(store, "full")[0] == [1, 3]


def _commit_timeout_toml(path: str) -> str:
    conf = Path(path).parent / "full.toml"
    conf.write_text(f'[remote]\npath = "{path}"\ncommit_timeout = 30\n')
    return str(conf)


def test_a_single_node_job_keeps_its_steps_in_the_shared_directory(make_daemon, shared_fs: SharedFS) -> None:  # noqa: ANN001
    """A one-node job uses the shared directory as it uses a bucket: every step copied there once durable, the
    directory's retention (the newest 2 and every 2nd), a step protected by name kept, and a node that lost its root
    restoring from the directory, newest first or any kept step, bit-exact; a step copied back is read locally after."""
    import shutil

    from _models import train_step

    from ckptd.errors import CheckpointError

    mount = shared_fs.mount("single")
    conf = Path(shared_fs.export).parent / "single.toml"
    conf.write_text(f'[remote]\npath = "{shared_fs.export}"\nkeep = 2\nkeep_every = 2\n')
    d = make_daemon("--remote-path", mount, "--config", str(conf), "--keep", "2", sub="single")
    model, optim = make()
    states = {}
    with d.client("one") as c:
        for step in range(1, 6):
            train_step(model, optim, step)
            states[step] = full_state(model, optim)
            c.snapshot(model, optim, step=step, extra={"step": step}, blocking=True).wait()
            if step == 1:
                c.protect(1, "baseline")
    wait_uploaded(d, "one", 5)
    store = DirStore(shared_fs.export)
    deadline = time.monotonic() + 30
    while remote_steps(store, "one") != ([1, 2, 4, 5], []) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert remote_steps(store, "one") == ([1, 2, 4, 5], [])  # 3 went; 1 is protected by name
    for name in os.listdir(Path(d.root) / "one" / "step-5"):  # byte-identical to the local files they came from
        assert store.get_bytes(f"one/step-5/{name}") == (Path(d.root) / "one" / "step-5" / name).read_bytes()
    assert not [n for n in _all_names(shared_fs.export) if n.startswith(".ckptd-")]
    d.stop()
    shutil.rmtree(Path(d.root) / "one")  # the node lost its disk
    d.start()
    with d.client("one") as c:
        m2, o2 = make(seed=9)
        assert c.restore(m2, o2) == {"step": 5} and c.last_restore["source"] == "bucket"
        assert_same(full_state(m2, o2), states[5])
        assert c.restore(m2, o2, step=2) == {"step": 2}
        assert_same(full_state(m2, o2), states[2])
        c.restore(m2, o2, step=5)
        assert c.last_restore["source"] == "disk"  # copied back once, local from then on
        with pytest.raises(CheckpointError, match="step 3 of job 'one' is not a committed checkpoint"):
            c.restore(m2, o2, step=3)
