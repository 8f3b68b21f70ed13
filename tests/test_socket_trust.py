"""Impersonating the daemon: another user's socket directory, socket or fake daemon is refused.

The attack: where ``XDG_RUNTIME_DIR`` is unset the socket lives in ``/tmp/ckptd-<uid>``, a name any
user can create first. Whoever owns (or can write) that directory can bind a socket of their own there
and receive every trainer's requests. The daemon refuses to start in such a directory, and the client
refuses to connect to a socket its user does not trust. Tests that act as a second user run a helper
as ``nobody`` (``tests/_as_user.py``), so they need root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _as_user import NOBODY, needs_nobody, python_as_nobody
from conftest import REPO, DaemonProc

from ckptd.client.rpc import Channel, check_socket
from ckptd.errors import CheckpointError, DaemonUnavailable

HANG = 30.0  # a refused daemon must exit well before this


def _nobodys_dir(path: Path) -> Path:
    """A directory ``nobody`` owns (and could fill with sockets of its own), as if it had made it."""
    path.mkdir(mode=0o755)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)  # type: ignore[union-attr]
    return path


def _serve(endpoint: str | None, root: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``ckptd serve`` in the foreground; the cases here are all refused, so it returns."""
    cmd = [sys.executable, "-m", "ckptd", "serve", "--root", str(root)]
    if endpoint is not None:
        cmd += ["--endpoint", endpoint]
    env = env or {k: v for k, v in os.environ.items() if k != "CKPTD_ENDPOINT"}
    shm_dir = root.parent / "shm"  # what a refused daemon made before it checked the socket stays here, not in /dev/shm
    shm_dir.mkdir(exist_ok=True)
    env["CKPTD_SHM_DIR"] = str(shm_dir)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG)


def _refused(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode != 0, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


# ---------------------------------------------------------------------------- the daemon refuses to start


@needs_nobody
def test_daemon_refuses_a_socket_directory_another_user_made_first(short_tmp: Path) -> None:
    """The issue's scenario: no XDG_RUNTIME_DIR, a shared sticky temp dir, and ``nobody`` has made
    ``ckptd-0`` there before the daemon starts. The daemon names the directory and its owner, and
    binds nothing there."""
    os.chmod(short_tmp, 0o755)
    tmp = short_tmp / "tmp"
    tmp.mkdir(mode=0o1777)
    os.chmod(tmp, 0o1777)  # like /tmp
    trap = tmp / f"ckptd-{os.getuid()}"
    subprocess.run(python_as_nobody("os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o755)", str(trap)), check=True, timeout=HANG)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "CKPTD_ENDPOINT")}
    env["TMPDIR"] = str(tmp)
    r = _serve(None, short_tmp / "root", env)
    _refused(r, str(trap), "belongs to another user", "nobody (uid 65534)", "mode 755", "XDG_RUNTIME_DIR")
    assert os.listdir(trap) == []


@needs_nobody
def test_daemon_refuses_an_explicit_endpoint_in_another_users_directory(short_tmp: Path) -> None:
    run = _nobodys_dir(short_tmp / "run")
    r = _serve(f"ipc://{run}/d.sock", short_tmp / "root")
    _refused(r, f"socket directory {run} belongs to another user", "nobody (uid 65534)", "mode 755")
    assert os.listdir(run) == []


def test_daemon_refuses_a_symlinked_socket_directory(short_tmp: Path) -> None:
    """Even one that points at a private directory of the daemon's user: a symlink can be repointed."""
    real = short_tmp / "real"
    real.mkdir(mode=0o700)
    link = short_tmp / "link"
    link.symlink_to(real)
    r = _serve(f"ipc://{link}/d.sock", short_tmp / "root")
    _refused(r, f"socket directory {link} is a symlink (to {real})")
    assert os.listdir(real) == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o722])
def test_daemon_refuses_a_socket_directory_others_can_write(short_tmp: Path, mode: int) -> None:
    run = short_tmp / "run"
    run.mkdir()
    os.chmod(run, mode)
    r = _serve(f"ipc://{run}/d.sock", short_tmp / "root")
    _refused(r, f"socket directory {run} is writable by other users", f"mode {mode:o}")
    assert os.listdir(run) == []


@pytest.mark.parametrize("how", ["0o777", "0o757", "0o1777", "other user's"])
def test_daemon_refuses_a_checkpoint_root_others_can_write(short_tmp: Path, how: str) -> None:
    """A root someone else made (under /tmp, on a shared disk): whoever owns or can write it renamed a job's
    directory away and put a forged one in its place, and a restore loaded the forged weights. Refused, before
    anything is written there."""
    root = short_tmp / "root"
    root.mkdir(mode=0o755)
    if how == "other user's":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the directory to another user")
        os.chown(root, 65534, 65534)
    else:
        os.chmod(root, int(how, 8))
    run = short_tmp / "run"
    run.mkdir(mode=0o700)
    r = _serve(f"ipc://{run}/d.sock", root)
    _refused(r, f"checkpoint root {root}", "belongs to another user" if how == "other user's" else "is writable by every user")
    assert os.listdir(root) == []


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_daemon_never_removes_what_is_not_its_socket(short_tmp: Path, kind: str) -> None:
    """The daemon removes a stale socket before binding; a symlink or a plain file in its place is left
    alone (and so is the file a symlink points to)."""
    run = short_tmp / "run"
    run.mkdir(mode=0o700)
    victim = short_tmp / "victim"
    victim.write_text("keep me")
    sock = run / "d.sock"
    if kind == "symlink":
        sock.symlink_to(victim)
    else:
        shutil.copy(victim, sock)
    r = _serve(f"ipc://{sock}", short_tmp / "root")
    _refused(r, str(sock), "a symlink" if kind == "symlink" else "is not a socket", "will not remove it")
    assert os.path.lexists(sock) and victim.read_text() == "keep me"


def test_daemon_makes_its_socket_directory_private_and_reuses_it(make_daemon) -> None:  # noqa: ANN001
    """A directory the daemon creates is 0700 and its own; after a crash (stale socket left behind) the
    same directory and socket path are accepted again."""
    d: DaemonProc = make_daemon(start=False)
    run = d.base / "run" / "sub"
    d.endpoint = f"ipc://{run}/d.sock"
    d.start()
    st = os.lstat(run)
    assert (st.st_mode & 0o7777, st.st_uid) == (0o700, os.geteuid())
    with d.client() as c:
        assert c.hello()["pid"] == d.proc.pid  # type: ignore[union-attr]
    d.kill()
    assert os.path.exists(run / "d.sock")  # stale, ours: removed and bound again
    d.start()
    with d.client() as c:
        assert c.hello()["pid"] == d.proc.pid  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- the client refuses to connect

_FAKE_DAEMON = """
import json, sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0); s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    ident, frame = s.recv_multipart()[:2]
    req = json.loads(frame)
    print("got", req["op"], flush=True)
    rep = {"v": 1, "id": req["id"], "ok": True, "server_version": "impostor", "root": "/impostor", "pid": 0}
    s.send_multipart([ident, json.dumps(rep).encode()])
"""
_FAKE_DAEMON_IMPORTS = ("json", "zmq")


@contextmanager
def _fake_daemon(endpoint: str, as_nobody: bool = True) -> Iterator[subprocess.Popen]:
    """A ROUTER at ``endpoint`` that answers every request; its stdout logs each op it received."""
    argv = [sys.executable, "-c", _FAKE_DAEMON, endpoint]
    if as_nobody:
        argv = python_as_nobody(_FAKE_DAEMON, endpoint, imports=_FAKE_DAEMON_IMPORTS)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _ops_received(proc: subprocess.Popen) -> list[str]:
    proc.kill()
    proc.wait()
    assert proc.stdout is not None
    return [line.split()[1] for line in proc.stdout.read().splitlines() if line.startswith("got ")]


@needs_nobody
def test_client_refuses_another_users_daemon_unless_told_to_trust_its_group(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``nobody`` runs an impostor in a directory of its own. A root client refuses it before sending
    anything (Client, Channel, ``ckptd status``); with ``CKPTD_TRUST_GROUP`` naming nobody's group it
    connects, by name or by gid."""
    from ckptd.client import Client

    assert NOBODY is not None
    os.chmod(short_tmp, 0o755)
    evil = _nobodys_dir(short_tmp / "evil")
    endpoint = f"ipc://{evil}/d.sock"
    group = __import__("grp").getgrgid(NOBODY.pw_gid).gr_name
    monkeypatch.delenv("CKPTD_TRUST_GROUP", raising=False)
    with _fake_daemon(endpoint) as impostor:
        with Client(endpoint=endpoint, job="t", timeout=5.0) as c, pytest.raises(CheckpointError) as e:
            c.hello()
        assert not isinstance(e.value, DaemonUnavailable)
        msg = str(e.value)
        for word in (f"refusing to connect to {endpoint}", f"{evil}/d.sock belongs to another user", "owner nobody (uid 65534)"):
            assert word in msg, msg
        assert f"CKPTD_TRUST_GROUP={group}" in msg, msg
        with Channel(endpoint, 5.0) as ch:
            with pytest.raises(CheckpointError, match="belongs to another user"):
                ch.call("status")
            with pytest.raises(CheckpointError, match="belongs to another user"):
                ch.alive()
        env = {k: v for k, v in os.environ.items() if k != "CKPTD_TRUST_GROUP"}
        r = subprocess.run([sys.executable, "-m", "ckptd", "status", "--endpoint", endpoint], capture_output=True, text=True, env=env)
        _refused(r, "belongs to another user", "nobody")

        monkeypatch.setenv("CKPTD_TRUST_GROUP", "no-such-group-ckptd")
        with Channel(endpoint, 5.0) as ch, pytest.raises(CheckpointError, match="CKPTD_TRUST_GROUP='no-such-group-ckptd' names no group"):
            ch.call("hello")
        for trusted in (group, str(NOBODY.pw_gid)):
            monkeypatch.setenv("CKPTD_TRUST_GROUP", trusted)
            with Client(endpoint=endpoint, job="t", timeout=5.0) as c:
                assert c.hello()["server_version"] == "impostor"
        assert _ops_received(impostor) == ["hello", "hello"]  # nothing reached it while it was refused


@needs_nobody
def test_a_trusted_group_does_not_let_a_member_squat_the_users_own_default_endpoint(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CKPTD_TRUST_GROUP, any member of the group (not only the daemon's user) made the client's default
    directory (``ckptd-<uid>`` in a shared temp dir) and bound an impostor there, which the client trusted. The
    group is trusted for an endpoint named explicitly only; the user's own default is its own daemon's."""
    from ckptd.client import Client

    assert NOBODY is not None
    os.chmod(short_tmp, 0o1777)  # a shared temp dir, as /tmp
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_tmp))
    monkeypatch.delenv("CKPTD_ENDPOINT", raising=False)
    squat = _nobodys_dir(short_tmp / f"ckptd-{os.getuid()}")
    endpoint = f"ipc://{squat}/ckptd.sock"
    monkeypatch.setenv("CKPTD_TRUST_GROUP", __import__("grp").getgrgid(NOBODY.pw_gid).gr_name)
    with _fake_daemon(endpoint) as impostor:
        with Client(job="t", timeout=5.0) as c, pytest.raises(CheckpointError, match="your own user's default endpoint") as e:
            c.hello()
        assert "belongs to another user" in str(e.value)
        assert _ops_received(impostor) == []


@needs_nobody
def test_client_refuses_a_root_socket_in_a_directory_another_user_owns(short_tmp: Path) -> None:
    """The socket is root's, but the directory is nobody's: nobody could swap the socket for its own
    between the check and the connect."""
    os.chmod(short_tmp, 0o755)
    evil = _nobodys_dir(short_tmp / "evil")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(evil / "d.sock"))  # root binds, in nobody's directory
        with pytest.raises(CheckpointError, match=f"directory {evil} belongs to another user .*owner nobody"):
            check_socket(f"ipc://{evil}/d.sock")
    finally:
        sock.close()


@pytest.mark.parametrize("case", ["world-writable directory", "symlink", "not a socket"])
def test_client_refuses_a_socket_it_cannot_trust_even_of_its_own_user(short_tmp: Path, case: str) -> None:
    run = short_tmp / "run"
    run.mkdir(mode=0o700)
    endpoint = f"ipc://{run}/d.sock"
    with _fake_daemon(endpoint, as_nobody=False) as fake:
        if case == "world-writable directory":
            os.chmod(run, 0o1777)
            want = f"directory {run} is writable by other users"
        elif case == "symlink":
            endpoint = f"ipc://{run}/link.sock"
            os.symlink(run / "d.sock", run / "link.sock")
            want = f"{run}/link.sock is a symlink"
        else:
            endpoint = f"ipc://{run}/file.sock"
            (run / "file.sock").write_text("")
            want = f"{run}/file.sock is not a socket"
        with Channel(endpoint, 5.0) as ch, pytest.raises(CheckpointError, match=want) as e:
            ch.call("hello")
        assert not isinstance(e.value, DaemonUnavailable)
        assert _ops_received(fake) == []


def test_missing_socket_is_daemon_unavailable_at_once(short_tmp: Path) -> None:
    """No socket file: no daemon, nothing to wait for, even with a 30 s timeout."""
    from ckptd.client import Client

    endpoint = f"ipc://{short_tmp}/none.sock"
    with Channel(endpoint, 30.0) as ch, Client(endpoint=endpoint, job="t", timeout=30.0) as c:
        for call in (lambda: ch.call("status"), c.hello):
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable) as e:
                call()
            assert time.monotonic() - t0 < 0.5
            assert endpoint in str(e.value) and "ckptd serve" in str(e.value)
        t0 = time.monotonic()
        assert not ch.alive()
        assert time.monotonic() - t0 < 0.5


def test_own_daemon_passes_the_check(daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_TRUST_GROUP", "no-such-group-ckptd")  # only consulted for another user's socket
    check_socket(daemon.endpoint)
    with daemon.rpc(timeout=5.0) as ch:
        assert ch.call("hello")["pid"] == daemon.proc.pid  # type: ignore[union-attr]
        assert ch.alive()
    check_socket("tcp://127.0.0.1:1")  # tcp: trusted networks only, nothing to check


def test_a_daemon_shutting_down_leaves_the_socket_file_a_newer_daemon_bound(short_tmp: Path) -> None:
    # daemon A stops answering while it drains its queues at shutdown; daemon B, started on the same endpoint,
    # finds no answer and replaces A's socket file with its own. A's exit then removed B's file, and no client
    # could reach B again. A removes the file only if it is still the one it bound.
    import zmq

    from ckptd.daemon.access import Access
    from ckptd.daemon.endpoint import bind, identity, unlink_own

    endpoint = f"ipc://{short_tmp}/run/d.sock"
    path = endpoint[len("ipc://") :]
    ctx = zmq.Context()
    try:
        a = bind(Access(), ctx, endpoint)
        a_id = identity(endpoint)
        b = bind(Access(), ctx, endpoint)  # B replaces the file of a daemon that does not answer
        a.close(0)
        unlink_own(endpoint, a_id)  # A's shutdown
        assert os.path.exists(path), "A's shutdown removed the socket file B serves"
        b_id = identity(endpoint)
        b.close(0)
        unlink_own(endpoint, b_id)
        assert not os.path.exists(path)
    finally:
        ctx.term()


def test_a_socket_whose_mode_cannot_be_set_is_closed_and_removed(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a bound socket left open when chmod/chown failed hung the context's term() at shutdown, with the file left
    import threading

    import zmq

    from ckptd.daemon.access import Access
    from ckptd.daemon.endpoint import bind

    endpoint = f"ipc://{short_tmp}/run/d.sock"
    access = Access()

    restrict, sock_path = access.restrict, endpoint[len("ipc://") :]

    def refuse(path: str, mode: int) -> None:  # the socket file's chmod/chown fails (its directory's does not)
        if path == sock_path:
            raise PermissionError(1, "Operation not permitted", path)
        restrict(path, mode)

    monkeypatch.setattr(access, "restrict", refuse)
    ctx = zmq.Context()
    with pytest.raises(PermissionError) as got:  # kept, as the daemon's start keeps it while it shuts down
        bind(access, ctx, endpoint)
    assert not os.path.exists(sock_path), "the failed bind left its socket file"
    t = threading.Thread(target=ctx.term, daemon=True)
    t.start()
    t.join(5.0)
    assert not t.is_alive(), "the context's term() hung on a socket bind() left open"
    del got


def test_a_checkpoint_root_its_group_may_write_is_used_with_a_warning(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A mkdir under a umask of 002 or a Kubernetes fsGroup volume gives 0775 / 2775, whose group is often the user's
    own: such a root is taken, with a warning naming the group (a root every user may write is refused, above)."""
    from ckptd.daemon.access import Access

    root = short_tmp / "root"
    root.mkdir()
    os.chmod(root, 0o2775)
    with caplog.at_level("WARNING", logger="ckptd.daemon"):
        fd = Access().make_root(str(root))
    os.close(fd)
    assert f"checkpoint root {root} is writable by its group" in caplog.text and "mode 2775" in caplog.text
