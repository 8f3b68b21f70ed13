"""Crash consistency: the daemon SIGKILLed at random moments of persist, retention and upload, many times.

One daemon (local ``keep`` 2, a bucket on moto's S3 server with ``keep`` 2, disk writes and uploads
slow enough that a kill lands mid-persist or mid-upload). Each round takes a few blocking snapshots in
increasing step order (a snapshot that returned is *acknowledged*: the daemon recorded its commit),
sleeps a random short time, SIGKILLs the daemon, and sometimes kills it again while it recovers.

* **Right after each kill** (nothing runs, so nothing races the check): every ``step-N`` directory
  that holds a manifest is sound (``verify_checkpoint``) and is an acknowledged step; the newest one
  is not older than a step already seen durable and ``latest``, it is the step a reader without a
  daemon takes (``restore(path=job_dir)``: the step committed last), and it is bit-identical to the
  state saved at that step; in the bucket, every step whose manifest is there has every object that
  manifest lists, at its size (no half-uploaded or half-deleted step looks complete).
* **After each restart:** each of the ``keep`` newest acknowledged steps becomes durable and is
  complete on disk (older ones may be dropped by retention); ``latest`` names the newest acknowledged
  step; ``ckptd verify`` accepts it; once the daemon is idle nothing a crash left half done remains
  (no ``step-N.tmp``, ``step-N.del``, or ``step-N`` without its manifest).
* **Two rounds are harder:** in one, a client holds 1,100 connections open (at systemd's soft limit of 1,024
  descriptors the daemon aborted in libzmq, EMFILE); from another on, a daemon runs on a copy of the live root
  (``cp -a``). Neither may cost an acknowledged step.
* **At the end:** the newest step reaches the bucket; a restore through the daemon from the disk, and
  from the bucket after the job's directory is wiped, is bit-identical to the state saved at it.

The schedule (steps per round, sleeps, double kills) follows from ``CKPTD_CRASH_SEED`` (printed in
every failure); ``CKPTD_CRASH_ROUNDS`` sets the number of rounds. No timing is asserted: every wait
has a generous deadline. ``pytest -s`` prints in which phase each kill landed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import assert_same, full_state, make, train_step
from conftest import REPO, DaemonProc
from test_exhaustion import _HOLD_ZMQ
from test_remote import remote_toml

import ckptd
from ckptd.storage.s3 import RemoteConfig
from ckptd.storage.verify import verify_checkpoint

SEED = int(os.environ.get("CKPTD_CRASH_SEED", "20240611"))
ROUNDS = int(os.environ.get("CKPTD_CRASH_ROUNDS", "10"))  # the flood and copy rounds (3, 5) and four after them
KEEP = 2  # local and bucket retention: the newest 2 steps
JOB = "cc"
BULK = 1 << 18  # float32 elements of a buffer that makes each shard ~1 MiB: big enough for the upload cap to bite
WRITE_RATE = "2M"  # bytes/s: a shard takes ~0.5 s to write
UPLOAD_RATE = 2_000_000  # bytes/s: a step takes ~0.5 s to upload (s3transfer paces only past 256 KiB per file)
SETTLE_S = 90.0  # how long a step may take to become durable after a restart (a loaded 2-core machine)
SYSTEMD_LIMITS = (1024, 4096)  # RLIMIT_NOFILE (soft, hard) as systemd gives a service
FLOOD_ROUND = 3  # the round in which a client holds more connections than the soft limit allows
COPY_ROUND = 5  # the round from which a daemon on a copy of the root runs beside the job's


class Run:
    """The test's bookkeeping: what was acknowledged, what was seen durable, and messages for failures."""

    def __init__(self, daemon: DaemonProc, bucket: RemoteConfig, s3: Any) -> None:
        self.d, self.bucket, self.s3 = daemon, bucket, s3
        self.jobdir = Path(daemon.root) / JOB
        self.acked: list[int] = []  # in commit order, which is step order here
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.floor: int | None = None  # the newest step seen durable and named by latest: never goes back
        self.settled = 0  # acknowledged steps (a prefix of acked) whose outcome a restart already checked
        self.round = -1
        self.phases: Counter[str] = Counter()

    def why(self, what: str) -> str:
        log = self.d.log.read_text(errors="replace") if self.d.log.exists() else ""
        tail = "\n".join(log.splitlines()[-60:])
        return (
            f"{what}\n[seed {SEED} (CKPTD_CRASH_SEED), round {self.round}, acknowledged {self.acked}, floor {self.floor}]"
            f"\n--- daemon log, last lines ---\n{tail}"
        )

    # ---------------------------------------------------------------- the disk and the bucket, frozen

    def local_dirs(self) -> tuple[list[int], list[int]]:
        """``(complete, incomplete)`` ``step-N`` directories (``.tmp``/``.fetch`` ones are neither)."""
        complete, incomplete = [], []
        for p in self.jobdir.iterdir() if self.jobdir.is_dir() else ():
            if p.name.startswith("step-") and p.name[5:].isdigit() and p.is_dir():
                (complete if (p / "manifest.json").exists() else incomplete).append(int(p.name[5:]))
        return sorted(complete), sorted(incomplete)

    def leftovers(self) -> list[str]:
        """What is neither a complete step nor ``latest``: partial (``.tmp``), half-deleted (``.del``) and
        half-fetched (``.fetch``) steps, and ``step-N`` directories without a manifest."""
        complete = {f"step-{s}" for s in self.local_dirs()[0]}
        names = os.listdir(self.jobdir) if self.jobdir.is_dir() else []
        return sorted(n for n in names if n not in complete and not n.startswith("latest"))

    def bucket_objects(self) -> dict[int, dict[str, int]]:
        """Per step, the objects of this job in the bucket and their sizes."""
        prefix = f"{self.bucket.prefix}/{JOB}/"
        out: dict[int, dict[str, int]] = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket.bucket, Prefix=prefix):
            for o in page.get("Contents", ()):
                step, _, name = o["Key"][len(prefix) :].partition("/")
                assert step.startswith("step-") and step[5:].isdigit() and name, self.why(f"unexpected key in the bucket: {o['Key']}")
                out.setdefault(int(step[5:]), {})[name] = o["Size"]
        return out

    def bucket_complete(self) -> list[int]:
        return sorted(s for s, objs in self.bucket_objects().items() if "manifest.json" in objs)

    def check_frozen(self, when: str) -> None:
        """The daemon is dead or stopped: what the disk and the bucket hold now is what a restart finds."""
        complete, incomplete = self.local_dirs()
        for s in complete:
            assert s in self.states, self.why(f"{when}: step-{s} is complete on disk but was never acknowledged")
            problems = verify_checkpoint(str(self.jobdir / f"step-{s}"))
            assert not problems, self.why(f"{when}: step-{s} has a manifest but is unsound (half-written or half-deleted): {problems}")
        newest = complete[-1] if complete else None
        if self.floor is not None:
            assert newest is not None and newest >= self.floor, self.why(
                f"{when}: the newest complete step on disk is {newest}, older than step {self.floor} already durable (complete: {complete})"
            )
        if complete:
            # what a reader without a daemon takes (the job directory's latest: the complete step
            # committed last, which is the highest here), bit-identical to what was saved at that step
            model, optim = new_model(99)
            with quiet():
                resolved = ckptd.restore(model, optim, path=str(self.jobdir))["step"]
            assert resolved == newest, self.why(f"{when}: the job directory resolves to step {resolved}; complete steps: {complete}")
            assert_same(full_state(model, optim), self.states[resolved])
        # the bucket: a step whose manifest is there is whole
        objects = self.bucket_objects()
        for s, objs in sorted(objects.items()):
            if "manifest.json" not in objs:
                continue
            assert s in self.states, self.why(f"{when}: step {s} is complete in the bucket but was never acknowledged")
            key = f"{self.bucket.prefix}/{JOB}/step-{s}/manifest.json"
            manifest = json.loads(self.s3.get_object(Bucket=self.bucket.bucket, Key=key)["Body"].read())
            for name, ent in manifest["files"].items():
                assert objs.get(name) == ent["size"], self.why(
                    f"{when}: step {s} is complete in the bucket but {name} is {objs.get(name)} bytes there, not {ent['size']}"
                )
        # where the kill landed, for the summary
        acked_after = [s for s in self.acked if self.floor is None or s > self.floor]
        if any(p.endswith(".tmp") for p in self.leftovers()):
            self.phases["mid-persist (a step-N.tmp left)"] += 1
        if incomplete or any(p.endswith(".del") for p in self.leftovers()):
            self.phases["mid-retention (a step half deleted)"] += 1
        if any(s not in complete for s in acked_after[-KEEP:]):
            self.phases["acknowledged step not yet complete"] += 1
        if newest is not None and newest not in objects:
            self.phases["newest local step not yet in the bucket"] += 1
        if any("manifest.json" not in objs for objs in objects.values()):
            self.phases["upload or bucket retention half done"] += 1
        if len(complete) > KEEP:
            self.phases["local retention still to run"] += 1

    # ---------------------------------------------------------------- a running daemon

    def wait_settled(self, step: int) -> dict[str, Any]:
        """The ``wait`` answer for ``step`` once it is no longer pending."""
        deadline = time.monotonic() + SETTLE_S
        with self.d.rpc() as rpc:
            while time.monotonic() < deadline:
                rep = rpc.call("wait", job=JOB, step=step, timeout=5.0)
                if rep["state"] != "pending":
                    return rep
        raise AssertionError(self.why(f"step {step} still pending {SETTLE_S:g} s after the restart"))

    def wait_idle(self) -> None:
        """No upload queued or running, no step in flight: retention has nothing left to do for now."""
        deadline = time.monotonic() + SETTLE_S
        with self.d.client(JOB) as c:
            while time.monotonic() < deadline:
                st = c.status()
                busy = st.get("uploading") or st.get("upload_backlog") or (st.get("jobs", {}).get(JOB, {}).get("in_flight"))
                if not busy:
                    return
                time.sleep(0.1)
        raise AssertionError(self.why(f"the daemon is still busy {SETTLE_S:g} s after the restart: {st}"))

    def check_settled(self) -> None:
        """After a restart: no acknowledged step among the newest ``KEEP`` is lost, ``latest`` names the
        newest, ``ckptd verify`` accepts it, and nothing a crash left half done remains once it is idle."""
        must = self.acked[-KEEP:]
        for s in sorted(set(self.acked[self.settled :]) | set(must)):
            rep = self.wait_settled(s)
            if s in must:
                assert rep["state"] == "durable", self.why(f"acknowledged step {s} was lost after the restart: {rep}")
        for s in must:
            problems = verify_checkpoint(str(self.jobdir / f"step-{s}"))
            assert not problems, self.why(f"acknowledged step {s} is durable but not sound on disk: {problems}")
        with self.d.client(JOB) as c:
            latest = c.latest()
        assert latest == self.acked[-1], self.why(f"latest names step {latest}, the newest acknowledged step is {self.acked[-1]}")
        path = self.jobdir / f"step-{latest}"
        r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(path)], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert r.returncode == 0, self.why(f"ckptd verify {path} exited {r.returncode}:\n{r.stdout}{r.stderr}")
        self.wait_idle()
        # nothing a crash left half done survives the restart: partial steps are finished or removed, a
        # half-deleted one is deleted (polled: a deletion may still be running when the daemon looks idle)
        deadline = time.monotonic() + 30.0
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        complete = self.local_dirs()[0]
        assert not self.leftovers(), self.why(f"left under {self.jobdir} after the restart: {self.leftovers()} (complete: {complete})")
        assert set(must) <= set(complete) <= set(self.acked), self.why(f"complete steps on disk {complete}")
        self.floor, self.settled = self.acked[-1], len(self.acked)

    def kill(self, when: str) -> None:
        self.d.kill()
        self.check_frozen(when)
        self.d.start()


def new_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optim = make(seed=seed)
    model.register_buffer("bulk", torch.zeros(BULK))
    return model, optim


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Restoring into a fresh model may warn (the stale-data guard); only the restored state matters here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def _flood(endpoint: str, n: int = 1100) -> Iterator[None]:
    """``n`` ZeroMQ connections held open by another process of the daemon's user, closed on leaving."""
    code = "import sys\n" + _HOLD_ZMQ  # prints "held N", holds until its stdin has a line or closes
    proc = subprocess.Popen([sys.executable, "-c", code, endpoint, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == f"held {n}\n"
        yield
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # the flood ends: its connections close
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _start_on_a_copy(d: DaemonProc, base: Path) -> DaemonProc:
    """A daemon on a copy of ``d``'s live root (``cp -a``), without the bucket (a copy must not upload as ``d``)."""
    (base / "copy").mkdir()
    shutil.copytree(d.root, base / "copy" / "root", symlinks=True)
    return DaemonProc(base / "copy", []).start()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_loses_no_acknowledged_step(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig, s3_server) -> None:  # noqa: ANN001
    rng = random.Random(SEED)
    conf = remote_toml(short_tmp / "r.toml", s3_bucket, keep=KEEP, max_bandwidth=UPLOAD_RATE)
    d = make_daemon("--config", conf, "--keep", str(KEEP), "--write-rate-limit", WRITE_RATE, "--workers", "2", start=False)
    d.open_files = SYSTEMD_LIMITS  # as systemd starts it: the flood round below would exhaust 1,024 descriptors
    d.start()
    run = Run(d, s3_bucket, s3_server.client())
    copy: DaemonProc | None = None
    model, optim = new_model(1)
    step = 0
    t0 = time.monotonic()
    for run.round in range(ROUNDS):
        with d.client(JOB) as c:
            for _ in range(rng.choice((1, 2, 3))):
                step += 1
                train_step(model, optim, step)
                model.bulk[step % BULK] = step
                run.states[step] = full_state(model, optim)
                c.snapshot(model, optim, step=step, extra={"step": step}, blocking=True)
                run.acked.append(step)  # returned: the daemon recorded the commit
        if run.round == FLOOD_ROUND:  # a client holds 1,100 connections (before: libzmq aborted the daemon, EMFILE)
            with _flood(d.endpoint):
                time.sleep(1.0)
        if run.round == COPY_ROUND:  # the root copied (cp -a) while persisting, a daemon started on the copy
            copy = _start_on_a_copy(d, short_tmp)
        # a kill right after the commits (mid-persist), or anywhere in persist, retention and upload
        time.sleep(rng.uniform(0.0, 0.15) if rng.random() < 0.3 else rng.uniform(0.0, 1.5))
        run.kill(f"kill after step {step}")
        if rng.random() < 0.35:  # again, while the restarted daemon finishes what it adopted
            time.sleep(rng.uniform(0.0, 0.6))
            run.kill(f"kill during recovery after step {step}")
        run.check_settled()  # with a daemon on a copy of the root running too, from COPY_ROUND on
    loop_s = time.monotonic() - t0
    if copy is not None:
        assert copy.stop() == 0, copy.log.read_text()[-2000:]
        assert "a copied root?" in copy.log.read_text()
        assert "committed job" not in copy.log.read_text(), copy.log.read_text()[-2000:]  # it took none of the job's staged shards
        copy.cleanup()

    # the newest step reaches the bucket
    newest = run.acked[-1]
    deadline = time.monotonic() + SETTLE_S
    while newest not in run.bucket_complete() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert newest in run.bucket_complete(), run.why(f"step {newest} never reached the bucket: {run.bucket_complete()}")
    # restored through the daemon from the disk, bit-identical to the state saved at that step
    with d.client(JOB) as c:
        m2, o2 = new_model(7)
        with quiet():
            assert c.restore(m2, o2, hot=False) == {"step": newest}
        assert c.last_restore["source"] == "disk" and c.last_restore["step"] == newest
        assert_same(full_state(m2, o2), run.states[newest])
    assert d.stop() == 0, run.why("the daemon did not stop cleanly")
    assert d.segments() == [], run.why(f"shared memory left after SIGTERM: {d.segments()}")
    run.check_frozen("after the final stop")
    # the node is lost: a fresh root restores the newest step from the bucket
    shutil.rmtree(run.jobdir)
    d.start()
    with d.client(JOB) as c:
        m3, o3 = new_model(8)
        with quiet():
            assert c.restore(m3, o3) == {"step": newest}
        assert c.last_restore["source"] == "bucket" and c.last_restore["step"] == newest, run.why(f"{c.last_restore}")
        assert_same(full_state(m3, o3), run.states[newest])
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(run.jobdir)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and f"step-{newest}: OK" in r.stdout, run.why(f"ckptd verify of the downloaded step:\n{r.stdout}{r.stderr}")
    assert d.stop() == 0
    assert d.segments() == []
    print(f"\ncrash consistency: seed {SEED}, {ROUNDS} rounds, {len(run.acked)} steps in {loop_s:.0f} s; kills landed: {dict(run.phases)}")
