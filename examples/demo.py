"""End-to-end demo: kill a trainer with SIGKILL, resume from ckptd, and get the exact same losses.

Run with ``make demo`` (or ``python examples/demo.py``). What it does:

1. starts a ``ckptd serve`` daemon on an ipc socket in a temporary directory;
2. trains a small MLP (with dropout, so the global RNG matters) for 40 steps without interruption
   (job ``demo-ref``), as the reference;
3. trains it again (job ``demo``), snapshotting every 5 steps, and kills the trainer with SIGKILL
   right after the snapshot of step 20 returns;
4. starts a fresh trainer, which builds the model and AdamW from scratch, restores the newest
   committed step from the daemon and trains on to step 40;
5. checks that the losses of steps 21..40 are bitwise equal to the uninterrupted run's.

The same file is the trainer: ``python examples/demo.py --train [--die-at N]``, which talks to the
daemon named by ``CKPTD_ENDPOINT`` as job ``CKPTD_JOB``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

STEPS = 40
EVERY = 5
DIE_AT = 20
JOB = "demo"
REF_JOB = "demo-ref"

START_TIMEOUT_S = 60.0  # the daemon imports torch: a few seconds on a small machine
CHILD_TIMEOUT_S = 120.0
DURABLE_TIMEOUT_S = 30.0

_LOSS_RE = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)$")
_RESUMED_RE = re.compile(r"^resumed from step (\d+)$")
_KILL_RE = re.compile(r"^step (\d+) committed, killing myself")


class DemoError(Exception):
    pass


# ---------------------------------------------------------------------------------------- trainer


def train(steps: int, every: int, die_at: int | None) -> int:
    """The trainer: deterministic data per step, snapshot every ``every`` steps, resume if possible."""
    import torch

    import ckptd

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # a pure function of the step: a resumed run sees exactly the data the killed one would have
        teacher = torch.Generator().manual_seed(1234)
        w = torch.randn(16, 1, generator=teacher)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(64, 16, generator=g)
        y = torch.tanh(x @ w) + 0.1 * torch.randn(64, 1, generator=g)
        return x, y

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),  # draws from the global RNG: restoring it is part of being exact
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    start = 1
    if ckptd.latest() is not None:
        # model and optimizer are fresh: everything else comes from the checkpoint
        extra = ckptd.restore(model, optim)
        torch.set_rng_state(extra["rng"])
        start = int(extra["step"]) + 1
        print(f"resumed from step {extra['step']}", flush=True)

    model.train()
    for step in range(start, steps + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        print(f"step {step:3d} loss {loss.item()!r}", flush=True)
        if step % every == 0:
            extra = {"step": step, "rng": torch.get_rng_state()}
            if step == die_at:
                ckptd.snapshot(model, optim, step=step, extra=extra, blocking=True)
                print(f"step {step} committed, killing myself with SIGKILL", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            ckptd.snapshot(model, optim, step=step, extra=extra)  # non-blocking: copies while we train on
    paths = ckptd.wait(timeout=60)  # every snapshot of this process is on disk (or was, before retention)
    if paths:
        print(f"newest snapshot durable at {paths[-1]}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------- driver


def run_trainer(name: str, env: dict[str, str], *extra_args: str, echo: bool = True) -> tuple[int, dict[int, str], list[str]]:
    """Run this script as a trainer; echo its output prefixed by ``name``; return (rc, losses, lines)."""
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--train", *extra_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        proc.kill()

    watchdog = threading.Timer(CHILD_TIMEOUT_S, expire)
    watchdog.start()
    losses: dict[int, str] = {}
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            if echo:
                print(f"  [{name}] {line}", flush=True)
            m = _LOSS_RE.match(line)
            if m:
                losses[int(m.group(1))] = m.group(2)
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if timed_out.is_set():
        raise DemoError(f"trainer {name} did not finish within {CHILD_TIMEOUT_S:.0f} s")
    if rc not in (0, -signal.SIGKILL) and not echo:
        print("\n".join(f"  [{name}] {x}" for x in lines), flush=True)
    return rc, losses, lines


def start_daemon(tmp: str, endpoint: str, log_path: str) -> subprocess.Popen[bytes]:
    import ckptd

    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--root", os.path.join(tmp, "ckpts"), "--endpoint", endpoint],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if daemon.poll() is not None:
            raise DemoError(f"the daemon exited with code {daemon.returncode} before answering:\n{read(log_path)}")
        try:
            with ckptd.Client(endpoint=endpoint, job=JOB, timeout=2) as c:
                info = c.hello()
            print(f"daemon up (pid {daemon.pid}): {info}")
            return daemon
        except ckptd.DaemonUnavailable:
            if time.monotonic() > deadline:
                raise DemoError(f"the daemon did not answer on {endpoint} within {START_TIMEOUT_S:.0f} s:\n{read(log_path)}") from None
            time.sleep(0.2)


def wait_durable(endpoint: str, job: str, step: int) -> float:
    """Poll the daemon until ``step`` of ``job`` is its newest committed step; return the seconds waited."""
    import ckptd

    t0 = time.monotonic()
    with ckptd.Client(endpoint=endpoint, job=job, timeout=5) as c:
        while True:
            latest = c.latest()
            if latest is not None and latest >= step:
                return time.monotonic() - t0
            if time.monotonic() - t0 > DURABLE_TIMEOUT_S:
                raise DemoError(f"step {step} of job {job} not committed after {DURABLE_TIMEOUT_S:.0f} s (latest: {latest})")
            time.sleep(0.05)


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError as e:
        return f"<could not read {path}: {e}>"


def committed_dirs(root: str, job: str) -> list[str]:
    d = os.path.join(root, job)
    names = [n for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))]
    return sorted(names, key=lambda n: int(n.split("-")[1]) if re.fullmatch(r"step-\d+", n) else 1 << 62)


def demo(tmp: str, endpoint: str, daemon_log: str, state: dict[str, object]) -> None:
    root = os.path.join(tmp, "ckpts")
    daemon = start_daemon(tmp, endpoint, daemon_log)
    state["daemon"] = daemon

    base_env = {**os.environ, "CKPTD_ENDPOINT": endpoint, "PYTHONUNBUFFERED": "1"}
    args = ["--steps", str(STEPS), "--every", str(EVERY)]

    print(f"\n(a) uninterrupted reference run, job {REF_JOB!r}, {STEPS} steps")
    rc, ref, _ = run_trainer("ref", {**base_env, "CKPTD_JOB": REF_JOB}, *args, echo=False)
    if rc != 0 or sorted(ref) != list(range(1, STEPS + 1)):
        raise DemoError(f"the reference run failed (exit code {rc}, steps {sorted(ref)})")
    print(f"  [ref] trained steps 1..{STEPS}: loss {ref[1]} -> {ref[STEPS]} (full table below)")

    print(f"\n(b) trainer, job {JOB!r}, killed with SIGKILL right after the snapshot of step {DIE_AT}")
    env = {**base_env, "CKPTD_JOB": JOB}
    killed_rc, first, lines = run_trainer("killed", env, *args, "--die-at", str(DIE_AT))
    if killed_rc != -signal.SIGKILL:
        raise DemoError(f"expected the trainer to die of SIGKILL (exit code -9), got {killed_rc}")
    reached = max(first, default=0)
    if not any(_KILL_RE.match(x) for x in lines) or reached != DIE_AT:
        raise DemoError(f"the trainer died at step {reached}, not right after its snapshot of step {DIE_AT}")
    if any(first[s] != ref[s] for s in first):
        raise DemoError("the killed trainer's losses before the kill differ from the reference run's")
    waited = wait_durable(endpoint, JOB, DIE_AT)
    after_kill = committed_dirs(root, JOB)
    print(f"daemon has step {DIE_AT} on disk {waited:.2f} s after the trainer died; committed: {', '.join(after_kill)}")

    print(f"\n(c) a fresh trainer, job {JOB!r}, restores from the daemon and trains on to step {STEPS}")
    rc, resumed, lines = run_trainer("resumed", env, *args)
    if rc != 0:
        raise DemoError(f"the resumed trainer failed with exit code {rc}")
    restored = next((int(m.group(1)) for x in lines if (m := _RESUMED_RE.match(x))), None)
    if restored is None:
        raise DemoError("the resumed trainer found no checkpoint to restore")

    print("\n" + "=" * 72)
    report = [
        ("killed trainer reached step", f"{reached} (exit code {rc_name(killed_rc)})"),
        (f"committed steps of {JOB!r} at the kill", ", ".join(after_kill)),
        ("restored step", str(restored)),
        (f"committed steps of {JOB!r} now", ", ".join(committed_dirs(root, JOB)) + " (the daemon keeps 3)"),
        (f"committed steps of {REF_JOB!r}", ", ".join(committed_dirs(root, REF_JOB))),
    ]
    width = max(len(k) for k, _ in report)
    for k, v in report:
        print(f"{k:<{width}} : {v}")
    print()
    print(f"{'step':>4}  {'resumed run':>22}  {'uninterrupted run':>22}  match")
    mismatches = []
    for step in range(restored + 1, STEPS + 1):
        a, b = resumed.get(step), ref.get(step)
        ok = a is not None and a == b
        if not ok:
            mismatches.append(step)
        print(f"{step:>4}  {a or '-':>22}  {b or '-':>22}  {'==' if ok else 'DIFFERS'}")
    print("=" * 72)
    if restored != DIE_AT:
        raise DemoError(f"restored step {restored}, expected the step committed just before the kill ({DIE_AT})")
    if sorted(resumed) != list(range(restored + 1, STEPS + 1)):
        raise DemoError(f"the resumed run trained steps {sorted(resumed)}, expected {restored + 1}..{STEPS}")
    if mismatches:
        raise DemoError(f"losses of steps {mismatches} differ between the resumed and the uninterrupted run")
    print(f"losses of steps {restored + 1}..{STEPS} are bitwise identical to the uninterrupted run")


def rc_name(rc: int) -> str:
    return f"{rc}, {signal.Signals(-rc).name}" if rc < 0 else str(rc)


def stop_daemon(daemon: subprocess.Popen[bytes]) -> int:
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            print("warning: the daemon ignored SIGTERM for 30 s and was killed", file=sys.stderr)
    return daemon.returncode


def main() -> int:
    import ckptd.shm

    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="ckptd-demo-")
    endpoint = f"ipc://{tmp}/ckptd.sock"
    daemon_log = os.path.join(tmp, "daemon.log")
    ckpts = os.path.join(tmp, "ckpts")
    state: dict[str, object] = {}
    failure: str | None = None
    print(f"ckptd demo in {tmp}")
    try:
        demo(tmp, endpoint, daemon_log, state)
    except DemoError as e:
        failure = str(e)
    except Exception as e:  # an unexpected error is a failed demo too, with its traceback
        import traceback

        traceback.print_exc()
        failure = f"{type(e).__name__}: {e}"
    finally:
        daemon = state.get("daemon")
        if isinstance(daemon, subprocess.Popen):
            rc = stop_daemon(daemon)
            if rc != 0 and failure is None:
                failure = f"the daemon exited with code {rc} on SIGTERM"
            if failure is not None:
                print(f"--- daemon log ({daemon_log}) ---\n{read(daemon_log)}--- end of daemon log ---", file=sys.stderr)
        left = ckptd.shm.purge(ckpts)  # clean up anyway: shared memory outlives us
        if left:
            if failure is None:
                failure = f"the daemon left shared-memory segments behind: {left}"
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is not None:
        print(f"\ndemo FAILED: {failure}", file=sys.stderr)
        return 1
    print(f"no shared-memory segments left behind; temp dir removed ({time.monotonic() - t0:.1f} s in all)")
    print("demo OK")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="run as the trainer (uses CKPTD_ENDPOINT and CKPTD_JOB)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--every", type=int, default=EVERY, help="snapshot every N steps")
    p.add_argument("--die-at", type=int, default=None, help="SIGKILL the trainer right after the snapshot of this step")
    a = p.parse_args()
    sys.exit(train(a.steps, a.every, a.die_at) if a.train else main())
