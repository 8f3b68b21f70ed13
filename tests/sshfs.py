"""A real network file system for the tests: one exported directory, served by an ``sshd`` on loopback and mounted
with ``sshfs`` (FUSE) once per "node", so that each node daemon sees the directory through its own mount, with that
mount's attribute and directory caches and SFTP's rename and link, not through local ext4.

``make test`` installs ``sshfs`` and ``openssh-server`` (root with apt); :func:`missing` says why the tests must skip
where they cannot run (no FUSE device, not installed, not root).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def missing() -> str | None:
    """Why sshfs mounts cannot be made here, or ``None`` when they can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: this machine cannot mount FUSE file systems"
    for tool in ("sshfs", "fusermount3", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make test installs sshfs and openssh-server where it runs as root with apt)"
    if not os.path.exists(SSHD):
        return f"{SSHD} is not installed (make test installs openssh-server where it runs as root with apt)"
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not usable by this user"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SshfsServer:
    """An ``sshd`` on 127.0.0.1 that serves ``export`` over SFTP to one key made for it; :meth:`mount` makes a new
    sshfs mount of the export."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.export = base / "export"
        self.mounts: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> SshfsServer:
        self.export.mkdir(parents=True, exist_ok=True)
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.base / key)], check=True)
        auth = self.base / "authorized_keys"
        auth.write_text((self.base / "client_key.pub").read_text())
        auth.chmod(0o600)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        for _ in range(5):  # a port picked free may be taken before sshd binds it: pick another
            self.port = _free_port()
            conf = self.base / "sshd_config"
            conf.write_text(
                f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.base / 'host_key'}\nAuthorizedKeysFile {auth}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                f"PidFile {self.base / 'sshd.pid'}\nStrictModes no\nSubsystem sftp internal-sftp\nMaxStartups 100\n"
            )
            log = open(self.base / "sshd.log", "ab")  # noqa: SIM115
            self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(conf)], stdout=log, stderr=log)
            log.close()
            if self._listening():
                return self
            self.proc.kill()
            self.proc.wait()
        raise RuntimeError(f"sshd did not start: {(self.base / 'sshd.log').read_text()[-2000:]}")

    def _listening(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def mount(self, name: str) -> Path:
        """A new sshfs mount of the export at ``base/name``: what one node sees."""
        where = self.base / name
        where.mkdir()
        opts = [
            f"IdentityFile={self.base / 'client_key'}", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null",
            "LogLevel=ERROR", "BatchMode=yes",
        ]  # fmt: skip
        cmd = ["sshfs", "-p", str(self.port), f"root@127.0.0.1:{self.export}", str(where)]
        for o in opts:
            cmd += ["-o", o]
        subprocess.run(cmd, check=True, timeout=60, capture_output=True)
        self.mounts.append(where)
        return where

    def stop(self) -> None:
        for where in self.mounts:
            subprocess.run(["fusermount3", "-u", "-z", str(where)], capture_output=True, timeout=60)
        self.mounts.clear()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
