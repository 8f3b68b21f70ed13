"""Replication to a peer daemon (issue 38): its throughput against the floor, what it costs a training loop, and a
restore after a node loss from a peer against one from disk and from a bucket (moto S3). Every daemon is a process
on this machine, peers on loopback TCP.

    .venv/bin/python benchmarks/replication.py [--mib 1024] [--params 5.5e6] [--steps 48] [--every 4] [--rounds 3]

1. **Throughput.** ``--mib`` of bytes (four shards) put into a peer daemon's replica store (:mod:`ckptd.storage.peer`
   to a ``ckptd serve --peer-listen`` process: CurveZMQ, 4 MiB chunks each with its XXH3-64, checked by the peer
   before it acknowledges, 8 in flight, held in its shared memory), against the floor: the same bytes in the same
   chunks over a plain ZeroMQ DEALER/ROUTER pair on loopback (two threads of this process), 8 in flight,
   acknowledged, no checksum, copied into one preallocated buffer; and that floor with CurveZMQ on (what encryption
   alone costs: every byte of a peer link is encrypted). Alternating, ``--rounds`` times each; medians.
2. **Training loop.** ``training_loop.py``'s loop (forward, backward, AdamW; a snapshot every ``--every`` steps, memory
   tier, nothing persisted within the run) through a daemon with ``--replicas 1`` and through one without, each round
   against its own baseline loop; overhead per checkpoint, the median of the rounds. On this one machine the peer's
   receiving competes for the same cores as the trainer: on a cluster it is another node's work.
3. **Restore after a node loss.** The newest step of that loop restored by a replacement daemon (empty root, empty
   shared memory) from the peer's replica, against the same step restored from the bucket (moto's S3 server on
   loopback, ``tests/s3server.py``; install it with ``.[test]``) and from the local disk; each ``--rounds`` times.

Prints a table; writes ``bench-out/replication.json``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import training_loop as tl  # noqa: E402
from _harness import DaemonProcess, alternate, loop_state, machine_info, write_json  # noqa: E402
from s3server import S3_UNSET_ENV, MotoServer, s3_test_env  # noqa: E402

import ckptd  # noqa: E402
from ckptd import peerwire  # noqa: E402
from ckptd.client.rpc import Channel  # noqa: E402
from ckptd.peerkey import PeerKey, keygen, load_key  # noqa: E402
from ckptd.storage.peer import WINDOW, PeerStore  # noqa: E402

JOB = "repl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- 1. throughput


def plain_copy(data: memoryview, key: PeerKey | None = None, chunk: int = peerwire.CHUNK_BYTES) -> float:
    """Seconds to move ``data`` over a plain ZeroMQ pair on loopback, chunked and acknowledged as replication is
    (``key``: encrypted with CurveZMQ, as a peer link is, and nothing else of it)."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    if key is not None:
        router.curve_server, router.curve_secretkey, router.curve_publickey = True, key.secret, key.public
        dealer.curve_secretkey, dealer.curve_publickey, dealer.curve_serverkey = key.secret, key.public, key.public
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    sink = bytearray(len(data))

    def serve() -> None:
        got = 0
        while got < len(data):
            ident, off, frame = router.recv_multipart(copy=False)
            o = int(off.bytes)
            sink[o : o + len(frame.buffer)] = frame.buffer
            got += len(frame.buffer)
            router.send_multipart([ident.bytes, b"ok"])

    th = threading.Thread(target=serve)
    th.start()
    t0 = time.perf_counter()
    pending = 0
    for off in range(0, len(data), chunk):
        dealer.send_multipart([str(off).encode(), data[off : off + chunk]], copy=False)
        pending += 1
        if pending >= WINDOW:
            dealer.recv()
            pending -= 1
    for _ in range(pending):
        dealer.recv()
    dt = time.perf_counter() - t0
    th.join()
    router.close(0)
    dealer.close(0)
    ctx.term()
    return dt


def throughput(args: argparse.Namespace, work: str, key_path: str) -> dict[str, Any]:
    """``--mib`` put into a peer daemon's replica store (a ``ckptd serve --peer-listen`` process) in four objects,
    against :func:`plain_copy` of the same bytes, without and with encryption; alternating, round 0 untimed."""
    key = load_key(key_path)
    nbytes = args.mib << 20
    data = memoryview(os.urandom(nbytes))
    url = f"tcp://127.0.0.1:{free_port()}"
    budget = [f"--replica-budget={3 * nbytes}", f"--shm-budget={4 * nbytes + (1 << 30)}"]
    peer = DaemonProcess(os.path.join(work, "tp"), f"ipc://{work}/tp.sock", os.path.join(work, "tp.log"),
                         ["--peer-listen", url, "--peer-key", key_path, *budget])  # fmt: skip
    store = PeerStore(url, key)
    floor, curve = "plain ZeroMQ copy (floor)", "ZeroMQ copy with CurveZMQ (floor + encryption)"
    times: dict[str, list[float]] = {"ckptd replication": [], floor: [], curve: []}
    per = nbytes // 4

    def replicate() -> None:
        t0 = time.perf_counter()
        for i in range(4):
            store.put_bytes(f"{JOB}/step-1/rank-{i:05d}.safetensors", data[i * per : (i + 1) * per])
        times["ckptd replication"].append(time.perf_counter() - t0)

    try:
        peer.wait_ready()
        for r in range(args.rounds + 1):  # round 0: untimed
            alternate(r, replicate, lambda: times[floor].append(plain_copy(data)))
            times[curve].append(plain_copy(data, key))
            if r == 0:
                for v in times.values():
                    v.clear()
    finally:
        store.close()
        peer.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bytes": nbytes,
        "seconds": times,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "ratio_to_floor": med["ckptd replication"] / med[floor],
        "ratio_to_encrypted_floor": med["ckptd replication"] / med[curve],
    }


# ---------------------------------------------------------------------------- 2. the training loop, 3. restores


def loop_overhead(args: argparse.Namespace, plain: DaemonProcess, replicating: DaemonProcess) -> tuple[dict[str, Any], Any, Any]:
    """The loop through each daemon (memory tier, nothing persisted in the run); its summary, the model and the
    optimizer as the last snapshot of the replicating daemon's job saved them."""
    model, optim, x, _ = loop_state(args.params, args.batch)
    tl.run_loop(model, optim, x, 3, args.every, None)  # warm-up
    far = 1_000_000
    with (
        ckptd.Client(endpoint=plain.endpoint, job=JOB, persist_every=far) as c0,
        ckptd.Client(endpoint=replicating.endpoint, job=JOB, persist_every=far) as c1,
    ):
        for c in (c0, c1):
            c.prepare(model, optim)
        modes = [
            ("memory tier, no replication", lambda first: tl.measure(model, optim, x, args, c0, False, first, True)),
            ("memory tier, --replicas 1", lambda first: tl.measure(model, optim, x, args, c1, False, first, True)),
        ]
        runs, _, base_steps = tl.run_rounds(modes, args, model, optim, x)
    n_ckpt = args.steps // args.every
    quiet = statistics.median(base_steps)
    return {m: tl.summarize(got, n_ckpt, quiet) for m, got in runs.items()} | {"quiet_step_s": quiet}, model, optim


def wait_replicated(d: DaemonProcess, timeout: float = 300.0) -> int:
    """The step the daemon's newest replication of the job sent (waiting for one to be replicated, and its queue to empty)."""
    deadline = time.monotonic() + timeout
    with ckptd.Client(endpoint=d.endpoint, job="probe") as c:
        while True:
            rep = c.status()["replication"]
            got = rep["jobs"].get(JOB)
            if got is not None and not rep["queued"] and rep["current"] is None:
                if got["state"] != "replicated":
                    raise RuntimeError(f"the newest step was not replicated: {rep}")
                return got["step"]
            if time.monotonic() > deadline:
                raise RuntimeError(f"replication did not finish: {rep}")
            time.sleep(0.2)


def timed_restore(endpoint: str, args: argparse.Namespace, step: int) -> tuple[float, str]:
    model, optim, _, _ = loop_state(args.params, args.batch)
    with ckptd.Client(endpoint=endpoint, job=JOB) as c:
        t0 = time.perf_counter()
        c.restore(model, optim, step=step, hot=False)
        return time.perf_counter() - t0, c.last_restore["source"]


def restores(args: argparse.Namespace, work: str, key: str, peer_url: str, step: int, bucket: str) -> dict[str, Any]:
    """The step restored by fresh daemons: from the peer, from the bucket (``bucket``: the config file naming it),
    and from its local copy."""
    out: dict[str, list[float]] = {"from the peer's replica": [], "from the bucket (moto S3)": [], "from local disk": []}
    sources: dict[str, str] = {}
    for _ in range(args.rounds):
        for label, extra in (("from the peer's replica", ["--peer", peer_url, "--peer-key", key]),
                             ("from the bucket (moto S3)", ["--config", bucket])):  # fmt: skip
            base = tempfile.mkdtemp(prefix="ckrs", dir=work)
            d = DaemonProcess(os.path.join(base, "root"), f"ipc://{base}/d.sock", os.path.join(base, "d.log"), extra)
            try:
                d.wait_ready()
                dt, sources[label] = timed_restore(d.endpoint, args, step)
                out[label].append(dt)
                dt, sources["from local disk"] = timed_restore(d.endpoint, args, step)  # now in this root
                out["from local disk"].append(dt)
            finally:
                d.stop()
                shutil.rmtree(base, ignore_errors=True)
    return {"seconds": out, "median_s": {k: statistics.median(v) for k, v in out.items()}, "sources": sources}


def s3_bucket(moto: MotoServer, work: str) -> str:
    """Start moto's S3 server, make a bucket on it, and return a daemon config file naming it. The dummy credentials go
    into this process's environment, which the daemons inherit."""
    for name in S3_UNSET_ENV:
        os.environ.pop(name, None)
    os.environ.update(s3_test_env(os.environ))
    moto.start()
    moto.client().create_bucket(Bucket="ckptd-bench")
    path = os.path.join(work, "bucket.toml")
    with open(path, "w") as f:
        f.write(f'[remote]\nbucket = "ckptd-bench"\nprefix = "bench"\nendpoint_url = "{moto.endpoint_url}"\nregion = "us-east-1"\n')
    return path


def main(argv: list[str] | None = None) -> int:
    p = tl.loop_parser(__doc__, "bench-out/replication.json")
    p.add_argument("--mib", type=int, default=1024, help="bytes replicated in the throughput part (MiB, default 1024)")
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(params=5.5e6, steps=48, every=4)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ckrep")
    daemons: list[DaemonProcess] = []
    moto = MotoServer(pathlib.Path(work) / "moto.log")
    try:
        key = os.path.join(work, "cluster.key")
        keygen(key)
        tp = throughput(args, work, key)
        peer_url = f"tcp://127.0.0.1:{free_port()}"
        bucket = s3_bucket(moto, work)

        def daemon(name: str, *extra: str) -> DaemonProcess:
            d = DaemonProcess(os.path.join(work, name), f"ipc://{work}/{name}.sock", os.path.join(work, f"{name}.log"), list(extra))
            daemons.append(d)
            d.wait_ready()
            return d

        daemon("peer", "--peer-listen", peer_url, "--peer-key", key)
        plain = daemon("plain")
        replicating = daemon("node", "--peer", peer_url, "--peer-key", key, "--replicas", "1", "--config", bucket)
        loop, model, optim = loop_overhead(args, plain, replicating)
        step = wait_replicated(replicating)
        with Channel(replicating.endpoint, 600) as rpc:  # the step persisted, into the bucket too: the third source
            got = rpc.call("wait", job=JOB, step=step, timeout=600, persist=True)
            if got.get("state") != "durable":
                raise RuntimeError(f"step {step} did not become durable: {got}")
        rs = restores(args, work, key, peer_url, step, bucket)
    finally:
        for d in daemons:
            d.stop()
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, tp, loop, rs, step)
    return 0


def report(args: argparse.Namespace, tp: dict[str, Any], loop: dict[str, Any], rs: dict[str, Any], step: int) -> None:
    print(f"## Replication to a peer daemon (loopback), torch threads {machine_info().get('torch_threads')}\n")
    print(f"Throughput, {tp['bytes'] / 2**20:.0f} MiB, median of {args.rounds}:\n\n| path | GB/s |\n|---|---:|")
    for k, v in tp["gb_per_s"].items():
        print(f"| {k} | {v:.2f} |")
    print(f"\nreplication / floor (time): {tp['ratio_to_floor']:.2f}x; / the encrypted floor: {tp['ratio_to_encrypted_floor']:.2f}x\n")
    print(f"Training loop ({args.params / 1e6:.1f} M params + AdamW, a snapshot every {args.every} of {args.steps} steps,"
          f" {args.rounds} rounds; quiet step {loop['quiet_step_s'] * 1e3:.1f} ms):\n")  # fmt: skip
    print("| mode | overhead per checkpoint (ms): median (rounds) |\n|---|---:|")
    for mode, r in loop.items():
        if mode != "quiet_step_s":
            print(f"| {mode} | {r['overhead_per_ckpt_s'] * 1e3:.1f} ({' '.join(f'{o * 1e3:.1f}' for o in r['overheads_s'])}) |")
    print(f"\nRestore of step {step} by a replacement daemon (empty root), median of {args.rounds}:\n")
    print("| source | seconds | Restored.source |\n|---|---:|---|")
    for k, v in rs["median_s"].items():
        print(f"| {k} | {v:.3f} | {rs['sources'].get(k)} |")
    write_json(args.json, {"args": vars(args), "machine": machine_info(), "throughput": tp, "loop": loop, "restore": rs, "step": step})


if __name__ == "__main__":
    sys.exit(main())
