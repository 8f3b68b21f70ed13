"""Fixtures: daemons on private ipc endpoints, cleaned up (process and /dev/shm) even on failure."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd import shm
from ckptd.client import Client
from ckptd.client.rpc import Channel

REPO = Path(__file__).resolve().parent.parent


class DaemonProc:
    """A ``ckptd serve`` subprocess with its own root and endpoint."""

    def __init__(self, base: Path, args: list[str]) -> None:
        self.base = base
        self.root = str(base / "root")
        self.endpoint = f"ipc://{base / 'd.sock'}"
        self.args = args
        self.log = base / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.shm_dirs: set[str | None] = set()
        self.launcher = ["-m", "ckptd"]  # or ["-c", code]: a daemon with a part replaced by a double (code runs ckptd.cli.main)
        self.open_files: tuple[int, int] | None = None  # RLIMIT_NOFILE (soft, hard) to start it with, as systemd sets them

    def start(self, extra_args: list[str] | None = None, wait: bool = True) -> DaemonProc:
        cmd = [sys.executable, *self.launcher, "serve", "--root", self.root, "--endpoint", self.endpoint, *(extra_args or self.args)]
        self._logf = open(self.log, "ab")
        limits = self.open_files
        preexec = None if limits is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits))
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=preexec)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with Client(endpoint=self.endpoint, job="probe", timeout=0.5) as c:
                    c.hello()
                self.shm_dirs.add(shm.SegmentDir.read_marker(self.root))  # cleaned up even if the root goes first
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError(f"daemon did not come up:\n{self.log.read_text()}")

    def client(self, job: str = "t", **kw: object) -> Client:
        return Client(endpoint=self.endpoint, job=job, **kw)  # type: ignore[arg-type]

    def rpc(self, timeout: float = 30.0) -> Channel:
        """A bare channel to this daemon: requests as the wire protocol spells them."""
        return Channel(self.endpoint, timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        rc = self.proc.returncode
        self.proc = None
        return rc

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self._logf.close()
        self.proc = None

    def segments(self) -> list[str]:
        return shm.segments_of(self.root)

    def cleanup(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait()
            finally:
                self._logf.close()
                self.proc = None
        shm.purge(self.root)
        for name in self.shm_dirs - {None}:
            shutil.rmtree(os.path.join(shm.SHM_DIR, name), ignore_errors=True)  # type: ignore[arg-type]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory (ipc socket paths are limited to ~107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="ckt"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_daemon(short_tmp: Path) -> Iterator:
    made: list[DaemonProc] = []

    def make(*args: str, start: bool = True, sub: str = "") -> DaemonProc:
        base = short_tmp / sub if sub else short_tmp
        base.mkdir(parents=True, exist_ok=True)
        d = DaemonProc(base, list(args))
        made.append(d)
        return d.start() if start else d

    try:
        yield make
    finally:
        for d in made:
            d.cleanup()


@pytest.fixture
def daemon(make_daemon) -> DaemonProc:  # noqa: ANN001
    return make_daemon()


def env_for(daemon: DaemonProc, job: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CKPTD_ENDPOINT=daemon.endpoint, CKPTD_JOB=job, PYTHONPATH=str(REPO))
    return env


@pytest.fixture
def cpu_accelerator() -> Iterator:
    """A real ``accelerate.Accelerator`` on the CPU; accelerate's process-wide state reset afterwards, and the
    clients that integrations of this process made (``ckptd.dcp.shared``) closed."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from ckptd.dcp import shared

    try:
        yield accelerate.Accelerator(cpu=True)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        for c in shared._clients.values():
            c.close()
        shared._clients.clear()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A moto S3 server on loopback for the whole session, with dummy AWS credentials in ``os.environ``.

    The credentials go into ``os.environ`` (not a per-test monkeypatch) so that daemon
    subprocesses started by any test inherit them; both are undone at session end.
    """
    from s3server import S3_UNSET_ENV, MotoServer, s3_test_env

    with pytest.MonkeyPatch.context() as mp:
        for name in S3_UNSET_ENV:
            mp.delenv(name, raising=False)
        for name, value in s3_test_env(os.environ).items():
            mp.setenv(name, value)
        server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
        try:
            yield server.start()
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> Iterator:  # noqa: ANN001
    """A fresh, uniquely named bucket on ``s3_server``: yields its ``RemoteConfig`` (prefix ``ckpts``)."""
    import uuid

    from ckptd.storage.s3 import RemoteConfig

    bucket = f"ckptd-test-{uuid.uuid4().hex[:16]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    try:
        yield RemoteConfig(bucket=bucket, prefix="ckpts", endpoint_url=s3_server.endpoint_url, region="us-east-1")
    finally:
        # best effort: the server lives for the session, so free what this test stored
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=bucket)
        except Exception:
            pass


MULTI_RANK_TIMEOUT_S = 600  # run_ranks joins each rank for up to 150 s in turn: 4 ranks on 2 loaded cores outlast 180 s


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start several ranks (they call ``run_ranks``, or their module is marked ``multiproc``) get a longer
    pytest-timeout than the suite's 180 s, unless they name their own: their ranks' deadlines should fail them first.
    Single-process tests beside them keep the 180 s."""
    for item in items:
        code = getattr(getattr(item, "function", None), "__code__", None)
        calls = code is not None and "run_ranks" in (*code.co_names, *code.co_varnames)
        if (calls or item.get_closest_marker("multiproc")) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(MULTI_RANK_TIMEOUT_S))


@pytest.fixture
def small_fs(short_tmp):  # noqa: ANN001, ANN201
    """A 3 MiB tmpfs: a real full disk. Skipped where this process may not mount."""
    yield from _small_mount(short_tmp, "tmpfs")


@pytest.fixture(params=["tmpfs", "ext4"])
def small_disk(request, short_tmp):  # noqa: ANN001, ANN201
    """A full disk of either kind: a 3 MiB tmpfs (page cache only) or a 4 MiB ext4 on a loop device (the kind a
    node's checkpoint disk is: shards are written to it with direct I/O). Skipped where this process may not mount."""
    yield from _small_mount(short_tmp, request.param)


def _small_mount(short_tmp: Path, kind: str) -> Iterator[str]:
    mnt = short_tmp / "small"
    mnt.mkdir()
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", "size=3m,mode=0755", "tmpfs", str(mnt)]
    else:
        image = short_tmp / "small.img"
        with open(image, "wb") as f:
            f.truncate(4 << 20)
        made = subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", str(image)], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make an ext4 image here: {made.stderr.strip()}")
        cmd = ["mount", "-o", "loop", str(image), str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small {kind} here: {r.stderr.strip()}")
    try:
        os.chmod(mnt, 0o755)
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class SharedFS:
    """One shared directory, and what each "node" sees of it: ``kind`` "dir" (every node the same local path) or
    "sshfs" (each node its own sshfs mount of one export over a loopback sshd: a real network file system)."""

    def __init__(self, kind: str, base: Path) -> None:
        self.kind = kind
        self.server = None
        if kind == "sshfs":
            from sshfs import SshfsServer

            self.server = SshfsServer(base).start()
            self.export = str(self.server.export)
        else:
            self.export = str(base / "export")
            os.makedirs(self.export)

    def mount(self, name: str) -> str:
        """The directory as node ``name`` sees it (its own mount, for sshfs)."""
        return self.export if self.server is None else str(self.server.mount(name))

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(params=["dir", "sshfs"])
def shared_fs(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[SharedFS]:
    """A shared directory for multi-node tests, on local disk and on sshfs; the sshfs case skips, saying why, where
    FUSE or sshfs is not available."""
    if request.param == "sshfs":
        from sshfs import missing

        why = missing()
        if why is not None:
            pytest.skip(f"no network file system to test on: {why}")
    base = short_tmp / "fs"
    base.mkdir()
    fs = SharedFS(request.param, base)
    try:
        yield fs
    finally:
        fs.close()
