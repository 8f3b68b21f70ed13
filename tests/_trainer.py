"""A one-process trainer for crash tests: snapshot, record the expected state, SIGKILL itself."""

from __future__ import annotations

import os
import signal
import sys

import torch
from _models import full_state, make, train_step
from safetensors.torch import save_file

import ckptd
from ckptd.client.rpc import Channel
from ckptd.config import default_endpoint

if __name__ == "__main__":
    expected, steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model, optim = make()
    for i in range(steps):
        train_step(model, optim, i)
    save_file(full_state(model, optim), expected)
    ckptd.snapshot(model, optim, step=steps, extra={"step": steps, "rng": torch.get_rng_state()}, blocking=True)
    with Channel(default_endpoint(), 30.0) as rpc:
        state = rpc.call("wait", job=os.environ["CKPTD_JOB"], step=steps, timeout=0.0)["state"]
    open(expected + ".state", "w").write(state)
    os.kill(os.getpid(), signal.SIGKILL)
