"""The suite's as-another-user helpers (``_as_user.py``) work from a checkout only its owner can enter.

A root user who clones into root's 0700 home or a ``mktemp -d`` directory has the virtual environment there
too, and ``nobody`` can read none of it: a test that started its helper as ``nobody`` failed with ``No
module named 'zmq'`` instead of testing the product. These tests build such a checkout's interpreter (a
virtual environment in a 0700 directory that sees this suite's packages) and run the helpers through it.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from _as_user import NOBODY, needs_nobody, python_as_nobody
from test_socket_trust import _FAKE_DAEMON, _FAKE_DAEMON_IMPORTS

TIMEOUT = 60.0


def _private_python(base: Path) -> Path:
    """A virtual environment's interpreter in a 0700 directory, seeing this suite's packages (zmq, ckptd)."""
    private = base / "private"
    private.mkdir(mode=0o700)
    venv = private / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT)
    python = venv / "bin" / "python"
    where = [str(python), "-c", "import site; print(site.getsitepackages()[0])"]
    own = subprocess.run(where, check=True, capture_output=True, text=True, timeout=TIMEOUT).stdout.strip()
    # addsitedir, not a bare path: the suite's site-packages has .pth files of its own (ckptd is installed editable)
    Path(own, "suite.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()))
    return python


def _nobodys_dir(path: Path) -> Path:
    assert NOBODY is not None
    path.mkdir(mode=0o755)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    return path


@needs_nobody
def test_a_python_started_as_nobody_in_a_private_checkout_cannot_import_the_suites_packages(short_tmp: Path) -> None:
    """The condition the helpers exist for, shown: started as nobody, the private checkout's interpreter
    finds no zmq (so a helper written that way fails for a reason that is not the product's)."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed: the naive way cannot even be tried here")
    assert NOBODY is not None
    python = _private_python(short_tmp)
    ok = subprocess.run([str(python), "-c", "import zmq, ckptd"], capture_output=True, text=True, timeout=TIMEOUT)
    assert ok.returncode == 0, ok.stderr  # as root the private interpreter sees the suite's packages
    naive = ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups", str(python), "-c", "import zmq"]
    r = subprocess.run(naive, capture_output=True, text=True, timeout=TIMEOUT, cwd="/")
    assert r.returncode != 0, "nobody could read the private virtual environment: this test shows nothing"


@needs_nobody
def test_a_helper_from_a_private_checkout_acts_as_nobody(short_tmp: Path) -> None:
    """The helper imports as root, then is nobody for good: what it binds and creates is nobody's, the
    private directory stays closed to it, and it cannot become root again."""
    python = _private_python(short_tmp)
    os.chmod(short_tmp, 0o755)
    run = _nobodys_dir(short_tmp / "run")
    code = """
import zmq
from ckptd.client.rpc import Channel
s = zmq.Context().socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0); s.bind("ipc://" + sys.argv[1] + "/d.sock")
open(sys.argv[1] + "/made", "w").close()
for attempt in (lambda: os.listdir(sys.argv[2]), lambda: os.setuid(0)):
    try:
        attempt()
        print("allowed")
    except PermissionError:
        print("denied")
print(os.stat(sys.argv[1] + "/d.sock").st_uid, os.stat(sys.argv[1] + "/made").st_uid, Channel.__name__)
"""
    argv = python_as_nobody(code, str(run), str(python.parent.parent.parent), imports=["zmq", "ckptd.client.rpc"], executable=str(python))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, cwd="/")
    assert r.returncode == 0, r.stderr
    assert NOBODY is not None
    assert r.stdout.split() == ["denied", "denied", str(NOBODY.pw_uid), str(NOBODY.pw_uid), "Channel"], r.stdout


@needs_nobody
def test_the_fake_daemon_of_the_trust_tests_runs_from_a_private_checkout(short_tmp: Path) -> None:
    """``test_socket_trust``'s impostor, exactly as it starts there, through the private checkout's interpreter:
    it binds as nobody and answers."""
    python = _private_python(short_tmp)
    os.chmod(short_tmp, 0o755)
    sock = _nobodys_dir(short_tmp / "evil") / "d.sock"
    argv = python_as_nobody(_FAKE_DAEMON, f"ipc://{sock}", imports=_FAKE_DAEMON_IMPORTS, executable=str(python))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.stderr.read() if proc.stderr else ""
        assert NOBODY is not None and os.stat(sock).st_uid == NOBODY.pw_uid
        s.connect(f"ipc://{sock}")
        s.send(json.dumps({"v": 1, "id": 7, "op": "hello"}).encode())
        assert s.poll(int(TIMEOUT * 1000)), "the fake daemon did not answer"
        assert json.loads(s.recv())["server_version"] == "impostor"
    finally:
        s.close()
        ctx.term()
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
