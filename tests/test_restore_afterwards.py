"""What ``restore()`` does after reading a step, a step read another way does too (``ckptd.dcp.Reader``, the
Lightning and Hugging Face pointer path): the saves after it are a new attempt (a fresh launch id) of a new line,
and a number saved since that read is not saved again (that would replace this run's own)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _models import make, train_step
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptd
from ckptd.client import Client
from ckptd.dcp.shared import client_for
from ckptd.errors import CheckpointError
from ckptd.integrations.pointer import read_state


def _by_dcp(c: Client, daemon: object, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    msd, osd = get_state_dict(model, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (no process group: DCP says it loads in one process)
        dcp.load({"model": msd, "optim": osd}, storage_reader=ckptd.dcp.Reader(job=c.job, endpoint=c.endpoint, step=1))


def _by_pointer(c: Client, daemon: object, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    assert read_state(c, 1)["model"]  # what Lightning's and the HF callback's load does


def _by_restore(c: Client, daemon: object, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    c.restore(model, optim, step=1)


@pytest.mark.parametrize("read", [_by_restore, _by_dcp, _by_pointer], ids=["restore", "dcp", "pointer"])
def test_a_step_read_any_way_starts_a_new_attempt_and_guards_the_numbers_saved_since(
    daemon,  # noqa: ANN001
    read: Callable[..., None],
) -> None:
    c = client_for("again", daemon.endpoint)  # the client DCP's Reader and Writer share in this process
    model, optim = make()
    for step in (1, 2, 3):
        train_step(model, optim, step)
        c.snapshot(model, optim, step=step, blocking=True).wait()
    launch = c._stager.run_id
    read(c, daemon, model, optim)
    assert c._stager.run_id != launch and c._stager.after == 1  # a new attempt, continuing from step 1
    train_step(model, optim, 99)
    c.snapshot(model, optim, step=2, blocking=True).wait()  # the rolled-back line saves 2 again
    assert c.latest() == 2
    with pytest.raises(CheckpointError, match="already saved by this client since it restored step 1"):
        c.snapshot(model, optim, step=2, blocking=True)


def test_a_dcp_writers_memory_tier_is_the_jobs_through_the_clients_own_call(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    for step in (1, 2, 3):
        train_step(model, optim, step)
        msd, osd = get_state_dict(model, optim)
        writer = ckptd.dcp.Writer("tiered", endpoint=daemon.endpoint, persist_every=1000)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer, checkpoint_id=str(step))
    c = client_for("tiered", daemon.endpoint)
    deadline = time.monotonic() + 60
    while c.latest() is None:  # the first step of a job is persisted; the next two stay in memory (one in 1000)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert c.latest() == 1 and c.status()["memory_steps"] == 2  # steps 2 and 3 went to memory only
    m2, o2 = make(seed=5)
    assert c.restore(m2, o2).source == "memory" and c.last_restore["step"] == 3
    with pytest.raises(ValueError, match="persist_every must be an int"):
        ckptd.dcp.Writer("tiered", endpoint=daemon.endpoint, persist_every=0)
