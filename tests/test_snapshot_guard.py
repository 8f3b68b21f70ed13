"""The trainer's side of a snapshot when something goes wrong around the background copy: a failure on one
rank, an optimizer inside a framework's wrapper, state ckptd cannot store, a tree JSON refuses. Each test is
written as the user's situation; each failed on the code before (found by a review of the snapshot path)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _models import assert_same, full_state

from ckptd.errors import CheckpointError, UnsupportedState


def _trained_with_copy_failing(rank: int, step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stepped Linear + AdamW; on rank 0 the background copy of ``step`` fails (its daemon restarted mid-commit,
    a CUDA error at the event)."""
    import ckptd.client.copy as cc

    if rank == 0:
        real = cc.copy_tensors

        def flaky(*a: Any) -> Any:
            if threading.current_thread().name == f"ckptd-copy-{step}":
                raise RuntimeError("injected failure of rank 0's background copy")
            return real(*a)

        cc.copy_tensors = flaky
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 64)).sum().backward()
    o.step()
    return m, o


def _refused(call: Any) -> tuple[str | None, float]:
    """``call()``'s CheckpointError text (``None`` if it went through), and how long it took."""
    t0 = time.monotonic()
    try:
        call()
        return None, time.monotonic() - t0
    except CheckpointError as e:
        return str(e), time.monotonic() - t0


def _copy_fails_once_on_rank_0(rank: int, world: int, endpoint: str) -> dict[str, Any]:
    """Rank 0's background copy of step 1 fails (its daemon restarted mid-commit, a CUDA error at the event);
    what does every rank's snapshot of step 2 do?"""
    import ckptd.client.client as cc

    m, o = _trained_with_copy_failing(rank, 1)
    with cc.Client(endpoint=endpoint, job="asym", overlap="always") as c:
        c.snapshot(m, o, step=1)
        o.step()
        error, waited = _refused(lambda: c.snapshot(m, o, step=2))
        m(torch.randn(2, 64)).sum().backward()
        o.step()
        c.snapshot(m, o, step=3, blocking=True).wait(60)  # the run goes on, every rank together
        return {"error": error, "waited": waited, "latest": c.latest()}


@pytest.mark.multiproc
def test_a_background_copy_failure_on_one_rank_fails_the_next_snapshot_on_every_rank_together(
    daemon,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """The failing rank raised its old error before the plan's collective, while the others waited in it for
    CKPTD_COLLECTIVE_TIMEOUT (30 minutes by default) and then blamed the user ("only 1 of 2 ranks called it").
    Now the error goes into the collective: every rank fails step 2 at once, naming rank 0, and step 3 works."""
    monkeypatch.setenv("CKPTD_COLLECTIVE_TIMEOUT", "60")
    r0, r1 = run_ranks(2, _copy_fails_once_on_rank_0, daemon.endpoint, timeout=240)
    assert r0["error"].startswith("background copy of step 1 failed: injected failure"), r0
    assert "rank(s) [0] could not stage their state" in r1["error"], r1
    assert "only 1 of 2 ranks" not in r1["error"]
    assert r0["latest"] == r1["latest"] == 3


def _copy_fails_then_every_rank_restores(rank: int, world: int, endpoint: str) -> dict[str, Any]:
    """Step 1 is saved; rank 0's background copy of step 2 fails; then the job restores (a rollback after a
    loss spike), on every rank, twice."""
    import ckptd.client.client as cc

    m, o = _trained_with_copy_failing(rank, 2)
    with cc.Client(endpoint=endpoint, job="rest", overlap="always") as c:
        c.snapshot(m, o, step=1, blocking=True).wait(60)
        saved = full_state(m, o)
        o.step()
        c.snapshot(m, o, step=2)
        m(torch.randn(2, 64)).sum().backward()
        o.step()
        error, waited = _refused(lambda: c.restore(m, o, step=1))
        again = c.restore(m, o, step=1).step  # the ranks' next restore pairs with each other, not with a stale attempt
        assert_same(full_state(m, o), saved)
        return {"error": error, "waited": waited, "again": again}


@pytest.mark.multiproc
def test_a_background_copy_failure_on_one_rank_fails_a_restore_on_every_rank_together(daemon, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """restore() raised rank 0's pending copy failure before the restore's check-in, while rank 1 waited there
    for CKPTD_COLLECTIVE_TIMEOUT (30 minutes by default) and then blamed the user ("only 1 of 2 ranks called
    it"). Now every rank fails that restore at once, naming rank 0, and the next restore works on both."""
    monkeypatch.setenv("CKPTD_COLLECTIVE_TIMEOUT", "60")
    r0, r1 = run_ranks(2, _copy_fails_then_every_rank_restores, daemon.endpoint, timeout=240)
    assert r0["error"].startswith("background copy of step 2 failed: injected failure"), r0
    assert "restore failed on rank(s) [0]" in r1["error"] and "only 1 of 2 ranks" not in r1["error"], r1
    assert r0["again"] == r1["again"] == 1


def test_an_optimizer_from_accelerate_prepare_is_snapshotted_behind_the_next_step(daemon, cpu_accelerator) -> None:  # noqa: ANN001
    """``accelerator.prepare`` returns an ``AcceleratedOptimizer`` (no step pre-hooks of its own): every overlapped
    snapshot failed with an AttributeError after its slot was filled, and the slot was never given back. The
    torch optimizer inside is hooked; its step, called by the wrapper, waits for the copy."""
    torch.manual_seed(0)
    net = torch.nn.Linear(256, 256)
    accelerator = cpu_accelerator
    model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    assert not hasattr(opt, "_optimizer_step_pre_hooks")  # the wrapper, as the Trainer gets it

    def train() -> None:
        model(torch.randn(8, 256)).sum().backward()
        opt.step()
        opt.zero_grad()

    train()
    with daemon.client("acc", overlap="always") as c:
        for step in (1, 2, 3):
            want = full_state(model, opt.optimizer)
            h = c.snapshot(model, opt, step=step)
            train()  # the wrapper's step runs the inner optimizer's, which waits for the copy
            h.wait(60)
            assert c._leases == {}
        m2 = torch.nn.Linear(256, 256)
        o2 = accelerator.prepare(torch.optim.AdamW(m2.parameters(), lr=0.1))
        c.restore(m2, o2)
        assert_same(full_state(m2, o2.optimizer), want)


@pytest.mark.parametrize(
    ("where", "layout"),
    [("buffer", "sparse_coo"), ("extra", "sparse_coo"), ("extra", "sparse_csr")],
    ids=["buffer", "extra-coo", "extra-csr"],
)
def test_a_sparse_tensor_is_refused_naming_it(daemon, where: str, layout: str) -> None:  # noqa: ANN001
    """A GNN's adjacency matrix as a sparse buffer, or in ``extra``: a bare RuntimeError from deep inside
    ("Cannot access data pointer of Tensor that doesn't have storage", "copy_() between dense and sparse
    Tensors is not implemented"). Now UnsupportedState names the tensor and says what to do; nothing leaks."""
    m = torch.nn.Linear(3, 3)
    adj = torch.eye(3).to_sparse() if layout == "sparse_coo" else torch.eye(3).to_sparse_csr()
    extra = None
    if where == "buffer":
        m.register_buffer("adj", adj)
    else:
        extra = {"adj": adj}
    key = "model/adj" if where == "buffer" else "extra/0/adj"
    with daemon.client("sparse") as c:
        with pytest.raises(UnsupportedState, match=rf"tensor '{key}' is {layout}: ckptd stores dense tensors .*to_dense"):
            c.snapshot(m, step=1, blocking=True, extra=extra)
        assert c._leases == {}
        c.snapshot(torch.nn.Linear(3, 3), step=2, blocking=True).wait(60)  # the client is fine afterwards


@pytest.mark.parametrize("overlap", ["auto", "always"])
def test_a_tree_json_cannot_encode_fails_the_snapshot_and_never_hangs_a_wait(daemon, overlap: str) -> None:  # noqa: ANN001
    """An optimizer param-group value JSON refuses (an int of 5,000 digits): the background thread died without
    marking the copy done, so wait() without a timeout never returned and the slot stayed leased; the blocking
    path raised a plain ValueError. Both are the snapshot's CheckpointError now, and the slot goes back."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.param_groups[0]["seed"] = 10**5000
    with daemon.client("enc", overlap=overlap) as c:
        with pytest.raises(CheckpointError, match="snapshot of step 1 failed: .*4300 digits"):
            c.snapshot(model, opt, step=1).wait(60)
        assert c._leases == {}
        del opt.param_groups[0]["seed"]
        assert c.snapshot(model, opt, step=2).wait(60).endswith("step-2")


def test_the_background_copy_leaves_the_thread_count_of_threads_made_later_alone(daemon) -> None:  # noqa: ANN001
    """The background copy runs on one intra-op thread; setting that changed the default of every thread the
    process made afterwards (a data-loading or evaluation thread ran on one core from then on)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        with daemon.client("thr", overlap="always") as c:
            c.snapshot(model, opt, step=1).wait(60)
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _slow_background_copy(monkeypatch: pytest.MonkeyPatch, delays: dict[str, float]) -> None:
    """The background copy of the named threads starts that many seconds late (a large state on a busy host)."""
    import ckptd.client.copy as cc

    real = cc.copy_tensors

    def slow(*a: Any) -> Any:
        time.sleep(delays.get(threading.current_thread().name, 0.0))
        return real(*a)

    monkeypatch.setattr(cc, "copy_tensors", slow)


def _stepped(lr: float = 1.0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 32, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return model, opt


def _restored(c: Any, step: int) -> dict[str, torch.Tensor]:
    m2, _ = _stepped()
    c.restore(m2, step=step, strict=False)
    return {k: v.clone() for k, v in m2.state_dict().items()}


def test_an_optimizer_re_created_after_a_snapshot_waits_for_its_copy(daemon, monkeypatch) -> None:  # noqa: ANN001
    """A new training phase re-creates the optimizer right after a snapshot and steps it: only the optimizer
    passed to snapshot() carried the pre-hook, so the new one changed the weights mid-copy (a torn checkpoint)."""
    _slow_background_copy(monkeypatch, {"ckptd-copy-1": 0.5})
    model, opt = _stepped()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with daemon.client("reopt", overlap="always") as c:
        h = c.snapshot(model, opt, step=1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # no snapshot() has seen it
        opt.step()
        assert h.copied(), "the new optimizer stepped before the copy ended"
        h.wait(60)
        assert_same(_restored(c, 1), want)


def test_snapshots_from_two_threads_take_turns_and_neither_is_torn(daemon, monkeypatch) -> None:  # noqa: ANN001
    """Two threads snapshot one client at once: the second background copy replaced the first in the copy guard,
    so optimizer.step() waited for one copy only and the other checkpoint held the weights after the step."""
    from ckptd.client.stage import Stager

    _slow_background_copy(monkeypatch, {"ckptd-copy-2": 1.0})  # the copy a guard following one copy misses is the slow one
    stage = Stager.run

    def slow_stage(self: Stager, *a: Any) -> Any:  # step 1 stages slowly: step 2's call passes its start meanwhile
        if a[4] == 1:
            time.sleep(0.3)
        return stage(self, *a)

    monkeypatch.setattr(Stager, "run", slow_stage)
    model, opt = _stepped()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with daemon.client("two", overlap="always") as c:
        barrier, handles = threading.Barrier(2), {}

        def snap(step: int) -> None:
            barrier.wait()
            handles[step] = c.snapshot(model, opt, step=step)

        threads = [threading.Thread(target=snap, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        opt.step()
        assert all(h.copied() for h in handles.values())
        for step in (1, 2):
            handles[step].wait(60)
            assert_same(_restored(c, step), want)


def test_a_tree_that_cannot_be_encoded_on_the_early_copy_path_gives_its_slot_back(daemon, monkeypatch) -> None:  # noqa: ANN001
    """A CPU state with many tensors is copied while the capture is checked (the early copy); a param-group value
    JSON refuses then raised a bare ValueError and left the early copy's slot leased for the process's life."""
    import ckptd.client.copy

    monkeypatch.setattr(ckptd.client.copy, "EARLY_COPY_MIN_TENSORS", 1)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with daemon.client("enc-early") as c:
        c.snapshot(model, opt, step=1).wait(60)  # the stage is cached: the next snapshot copies early
        opt.param_groups[0]["seed"] = 10**5000
        with pytest.raises(CheckpointError, match="snapshot of step 2 failed: .*4300 digits"):
            c.snapshot(model, opt, step=2)
        assert c._leases == {} and c.status()["slots"].get("leased", 0) == 0
        del opt.param_groups[0]["seed"]
        assert c.snapshot(model, opt, step=3).wait(60).endswith("step-3")
        assert c.early_copies >= 1


def test_a_list_of_optimizers_is_refused_saying_what_to_do(daemon) -> None:  # noqa: ANN001
    """torch's get_state_dict takes a list of optimizers (a GAN's two); snapshot() failed inside the capture
    cache's fingerprint with "'list' object has no attribute 'param_groups'"."""
    g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opts = [torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters())]
    with daemon.client("gan") as c:
        with pytest.raises(UnsupportedState, match="one optimizer per model, got a list of 2"):
            c.snapshot(torch.nn.ModuleList([g, d]), opts, step=1)  # type: ignore[arg-type]
        assert c._leases == {}
        c.snapshot(g, opts[0], step=1, extra={"d": d.state_dict(), "opt_d": opts[1].state_dict()}).wait(30)


def test_a_big_endian_numpy_array_in_extra_comes_back_with_its_values(daemon) -> None:  # noqa: ANN001
    """numpy arrays read from a file written elsewhere can be big-endian: torch.from_numpy refused them with a raw
    ValueError that named no key."""
    import numpy as np

    a = np.arange(6, dtype=">f4").reshape(2, 3)
    with daemon.client("endian") as c:
        c.snapshot(torch.nn.Linear(2, 2), step=1, extra={"table": a}).wait(30)
        got = c.restore(torch.nn.Linear(2, 2))["table"]
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and np.array_equal(got, a)


def test_extra_with_keys_1_and_the_string_1_holding_tensors_round_trips(daemon) -> None:  # noqa: ANN001
    """A dict with non-string keys is stored as pairs, its values under str(key): 1 and "1" both holding tensors
    were refused with a bare ValueError ("two tensors map to the state key")."""
    extra = {"k": {1: torch.ones(2), "1": torch.zeros(2), (2, 3): torch.full((1,), 5.0)}}
    with daemon.client("keys") as c:
        c.snapshot(torch.nn.Linear(2, 2), step=1, extra=extra).wait(30)
        got = c.restore(torch.nn.Linear(2, 2))["k"]
    assert set(got) == {1, "1", (2, 3)}
    assert torch.equal(got[1], torch.ones(2)) and torch.equal(got["1"], torch.zeros(2)) and torch.equal(got[(2, 3)], torch.full((1,), 5.0))


def test_a_background_copy_failure_is_not_lost_when_the_next_snapshot_is_refused_for_its_step(daemon, monkeypatch) -> None:  # noqa: ANN001
    """After a rollback restore, saving a step number again is refused; that refusal came after the previous
    background copy's failure was taken from the guard, and the failure was never raised anywhere."""
    import ckptd.client.copy as cc

    real = cc.copy_tensors

    def flaky(*a: Any) -> Any:
        if threading.current_thread().name == "ckptd-copy-6":
            raise RuntimeError("injected failure of step 6's background copy")
        return real(*a)

    monkeypatch.setattr(cc, "copy_tensors", flaky)
    model, opt = _stepped()
    with daemon.client("lost", overlap="always") as c:
        c.snapshot(model, opt, step=1, blocking=True).wait(30)
        c.restore(model, opt, step=1)
        c.snapshot(model, opt, step=5, blocking=True).wait(30)
        c.snapshot(model, opt, step=6)
        with pytest.raises(CheckpointError, match=r"step 5 .* already saved .*; and before it: background copy of step 6 failed"):
            c.snapshot(model, opt, step=5)


def test_a_write_outside_optimizer_step_during_the_background_copy_fails_the_snapshot(daemon, monkeypatch) -> None:  # noqa: ANN001
    """Only optimizer.step() waits for the background copy. A clamp after the step (or EMA weights swapped in for an
    evaluation, a load_state_dict) wrote the parameters while the copy ran, and the step was committed with bytes
    of before and after: a torn checkpoint, silently. That step now fails (its wait() names the tensors) and the
    client copies before snapshot() returns from then on, so training goes on with whole checkpoints."""
    _slow_background_copy(monkeypatch, {"ckptd-copy-1": 0.5, "ckptd-copy-2": 0.2})
    model, opt = _stepped()
    with daemon.client("torn", overlap="always") as c:
        h = c.snapshot(model, opt, step=1)
        with torch.no_grad():
            model[0].weight.clamp_(-0.01, 0.01)  # outside the step: nothing waits for the copy
        torn = r"1 tensor\(s\) of step 1 were written in place while its background copy ran \(model/0.weight\).*blocking=True"
        with pytest.raises(CheckpointError, match=torn):
            h.wait(60)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        h = c.snapshot(model, opt, step=2)  # training goes on: copied before it returns from now on, never torn
        assert h.copied()
        with torch.no_grad():
            model[0].weight.clamp_(-0.001, 0.001)  # the loop's habit again: this snapshot holds the state of its call
        opt.step()
        c.wait(60)  # the torn step is not raised again
        assert_same(_restored(c, 2), want)
        assert c.latest() == 2


def test_an_embedding_with_max_norm_is_copied_before_snapshot_returns(daemon, monkeypatch) -> None:  # noqa: ANN001
    """nn.Embedding(max_norm=...) renormalizes the rows it looks up in place, in forward: its weight went to the
    background copy like any parameter and the next forward tore it. It is copied before snapshot() returns."""
    _slow_background_copy(monkeypatch, {"ckptd-copy-1": 0.5})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8, max_norm=0.5), torch.nn.Linear(8, 8))
    with torch.no_grad():
        model[0].weight.mul_(10)  # rows over the norm: the next lookup renormalizes them
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with daemon.client("renorm", overlap="always") as c:
        h = c.snapshot(model, opt, step=1)
        model(torch.arange(16)).sum().backward()  # the next forward, while the rest is copied
        assert not torch.equal(model[0].weight, want["0.weight"])
        h.wait(60)
        m2 = torch.nn.Sequential(torch.nn.Embedding(16, 8, max_norm=0.5), torch.nn.Linear(8, 8))
        c.restore(m2, step=1)
        assert_same({k: v.clone() for k, v in m2.state_dict().items()}, want)


def test_a_restore_from_a_path_waits_for_another_clients_background_copy(daemon, monkeypatch) -> None:  # noqa: ANN001
    """A second job's Client snapshots the model; the module-level ckptd.restore(path=...) (no default client)
    then wrote into the parameters while that client's copy still read them: the step held restored bytes."""
    import ckptd

    _slow_background_copy(monkeypatch, {"ckptd-copy-2": 0.5})
    model, opt = _stepped()
    with daemon.client("other", overlap="always") as c:
        c.snapshot(model, opt, step=1, blocking=True).wait(60)
        opt.step()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        h = c.snapshot(model, opt, step=2)
        ckptd.restore(model, opt, path=os.path.join(daemon.root, "other", "step-1"))
        h.wait(60)
        assert_same(_restored(c, 2), want)


def test_a_global_step_pre_hook_registered_first_runs_after_the_copy(daemon, monkeypatch) -> None:  # noqa: ANN001
    """A user's global optimizer step pre-hook that writes the parameters (a projection before the update), registered
    before ckptd's: torch runs global hooks in registration order, so it wrote them while the copy read them."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _slow_background_copy(monkeypatch, {"ckptd-copy-1": 0.5})
    model, opt = _stepped()

    def project(o: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.01, 0.01)

    handle = register_optimizer_step_pre_hook(project)
    try:
        want = {k: v.clone() for k, v in model.state_dict().items()}
        with daemon.client("order", overlap="always") as c:
            h = c.snapshot(model, opt, step=1)
            opt.step()
            h.wait(60)
            assert_same(_restored(c, 1), want)
    finally:
        handle.remove()
