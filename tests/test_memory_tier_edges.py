"""The memory tier at its edges, each found by a review of it and written as the user's situation: a
restore of a memory-only step while a newer step is on its way to disk, a daemon stopped between two
ranks' commits of a memory-only step, and what ``status`` says a crash could lose."""

from __future__ import annotations

import torch
from _models import assert_same, full_state
from _poll import until


def _big(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 25 MB with Adam
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    torch.manual_seed(i)
    model(torch.randn(4, 1024)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def test_a_memory_only_step_restores_from_memory_while_a_newer_step_is_written_to_disk(make_daemon) -> None:  # noqa: ANN001
    """A loss spike: roll back to step 2, which ``status`` lists as memory only, while step 3 is being written to
    a slow disk. hot_open offered only the newest step in memory (3, not yet on disk), and the restore then asked
    the disk for step 2: "step 2 of job 'j' is not a committed checkpoint". Now step 2 comes from memory."""
    d = make_daemon("--write-rate-limit", "4M", "--workers", "1")
    model, optim = _big()
    with d.client("j", persist_every=2) as c:
        for step in (1, 2):  # 1: disk (the first), 2: memory only
            _step(model, optim, step)
            c.snapshot(model, optim, step=step, blocking=True)
        until(lambda: (s := c.status()["jobs"]["j"]).get("latest") == 1 and s.get("memory_only") == [2], what="step 1 durable")
        want = full_state(model, optim)
        _step(model, optim, 3)
        c.snapshot(model, optim, step=3, blocking=True)  # due for disk: 25 MB at 4 MB/s
        assert 3 in c.status()["jobs"]["j"].get("in_flight", []) and c.status()["jobs"]["j"]["memory_only"] == [2]
        m2, o2 = _big(seed=5)
        c.restore(m2, o2, step=2)
        assert c.last_restore["step"] == 2 and c.last_restore["source"] == "memory"
        assert_same(full_state(m2, o2), want)
