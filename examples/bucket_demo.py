"""The object-storage tier end to end on one machine: an S3 server on loopback (moto, from the test
extra), a daemon configured with a ``[remote]`` table, three snapshots, ``ckptd status`` while the
uploads run, then the node "lost" (its root deleted) and a restore from the bucket.

    .venv/bin/python examples/bucket_demo.py      # after `make install` (moto comes with .[test])

The ``ckptd.toml`` it writes is what a node would use with MinIO (``endpoint_url``) or AWS (without it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the moto launcher the tests use
sys.path.insert(0, str(HERE.parent / "benchmarks"))  # the benchmarks' transformer-like model

import torch  # noqa: E402
from _harness import build_state  # noqa: E402
from s3server import MotoServer, s3_test_env  # noqa: E402

import ckptd  # noqa: E402


def main() -> int:
    os.environ.update(s3_test_env(os.environ))  # dummy credentials for the loopback server
    work = Path(tempfile.mkdtemp(prefix="ckbucket"))
    server = MotoServer(work / "moto.log").start()
    daemon = None
    try:
        server.client().create_bucket(Bucket="ckpt-demo")
        endpoint = f"ipc://{work}/d.sock"
        (work / "ckptd.toml").write_text(
            f'root = "{work}/root"\nendpoint = "{endpoint}"\n\n'
            f'[remote]\nbucket = "ckpt-demo"\nprefix = "cluster-a"\nendpoint_url = "{server.endpoint_url}"\n'
            'max_bandwidth = "100M"\nkeep = 3\nkeep_every = 1000\n'
        )
        print((work / "ckptd.toml").read_text())
        log = open(work / "daemon.log", "w")
        daemon = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--config", str(work / "ckptd.toml")], stderr=log)
        model, optim = build_state(44e6)  # 0.5 GB of model + AdamW state
        with ckptd.Client(endpoint=endpoint, job="llama-7b", timeout=60) as c:
            for step in (1000, 1100, 1200):
                c.snapshot(model, optim, step=step, blocking=True).wait()
            time.sleep(3.0)  # uploads are on their way (100 MB/s cap)
            status = subprocess.run([sys.executable, "-m", "ckptd", "status", "--endpoint", endpoint], capture_output=True, text=True)
            print("$ ckptd status\n" + status.stdout)
            while c.status()["jobs"]["llama-7b"].get("uploaded") != 1200:
                time.sleep(0.5)
        # the node is lost: a fresh root, same bucket
        daemon.terminate()
        daemon.wait(300)
        shutil.rmtree(work / "root")
        daemon = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--config", str(work / "ckptd.toml")], stderr=log)
        fresh, fresh_opt = build_state(44e6, seed=1)
        with ckptd.Client(endpoint=endpoint, job="llama-7b", timeout=60) as c:
            t0 = time.perf_counter()
            c.restore(fresh, fresh_opt)
            print(f"restored step {c.last_restore['step']} from the {c.last_restore['source']} in {time.perf_counter() - t0:.1f} s")
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
        print("bucket demo OK" if same else "bucket demo FAILED: the restored model differs")
        return 0 if same else 1
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(300)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
