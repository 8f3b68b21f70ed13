"""A real S3 endpoint on loopback for tests: moto's standalone server in a subprocess.

The server runs in its own session and process group, so :meth:`MotoServer.stop` signals the whole
group and a Ctrl-C in the terminal does not reach it before the fixture's teardown does. Ports
are picked free by the OS; if another process takes the port before moto binds it, start-up is
retried on a new one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# dummy credentials for boto3: set in os.environ so daemon subprocesses inherit them too
S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    # a developer's ~/.aws (profiles, endpoints, addressing style) must not leak into the tests
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}

# variables that would send the tests' boto3 clients somewhere else (a profile, a global endpoint)
S3_UNSET_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def s3_test_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``S3_TEST_ENV`` plus a ``NO_PROXY`` that keeps loopback away from any proxy in ``environ``."""
    no_proxy = ",".join(p for p in (environ.get("NO_PROXY") or environ.get("no_proxy") or "", "127.0.0.1,localhost") if p)
    return {**S3_TEST_ENV, "NO_PROXY": no_proxy, "no_proxy": no_proxy}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 and a free port; ``endpoint_url`` once started."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        """A boto3 S3 client for set-up and inspection, made once (making one costs ~0.1 s)."""
        if self._client is None:
            import boto3.session

            self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")
        return self._client

    def start(self, timeout: float = 30.0, tries: int = 3) -> MotoServer:
        for attempt in range(tries):
            self.port = _free_port()
            cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
            env = dict(os.environ)
            env.pop("MOTO_PORT", None)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
                )
            if self._wait_ready(timeout):
                return self
            self.stop()
            if attempt == tries - 1:
                break
        raise RuntimeError(f"moto server did not come up:\n{self.log_path.read_text(errors='replace')[-4000:]}")

    def _wait_ready(self, timeout: float) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False  # e.g. the port was taken meanwhile
            try:
                opener.open(f"{self.endpoint_url}/moto-api/", timeout=1.0).close()
                return True
            except urllib.error.HTTPError:
                return True  # any HTTP answer means it is serving
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers; safe to call twice."""
        if self._client is not None:
            self._client.close()
            self._client = None
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            proc.wait()
