"""The capture cache: reused only while it provably describes the live state."""

from __future__ import annotations

import pytest
import torch
from _models import assert_same, full_state, make, train_step

from ckptd.client.capture import StateCapture


def _values(chunks) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {c.key: c.tensor.detach().clone() for c in chunks}


def test_reused_views_show_current_values() -> None:
    model, optim = make()
    train_step(model, optim, 0)
    cap = StateCapture()
    _, first, reused = cap.capture(model, optim)
    assert not reused
    train_step(model, optim, 1)
    tree, again, reused = cap.capture(model, optim)
    assert reused and again is first
    fresh_tree, fresh, _ = StateCapture().capture(model, optim)
    assert_same(_values(again), _values(fresh))
    assert tree == fresh_tree


def test_changes_that_invalidate() -> None:
    model, optim = make()
    train_step(model, optim, 0)
    cap = StateCapture()
    cap.capture(model, optim)

    def fresh_equal() -> bool:
        tree, chunks, reused = cap.capture(model, optim)
        ftree, fchunks, _ = StateCapture().capture(model, optim)
        assert tree == ftree and _values(chunks).keys() == _values(fchunks).keys()
        assert all(torch.equal(a, b) for a, b in zip(_values(chunks).values(), _values(fchunks).values()))
        return reused

    with torch.no_grad():
        model.inp.weight.data = torch.randn_like(model.inp.weight)  # a parameter rebound
    assert not fresh_equal()
    assert fresh_equal()  # and cached again
    model.counter = model.counter + 1  # a buffer rebound (not in place)
    assert not fresh_equal()
    import copy

    optim.load_state_dict(copy.deepcopy(optim.state_dict()))  # optimizer state replaced by new tensors
    assert not fresh_equal()
    optim.param_groups[0]["lr"] = 0.5  # hyperparameters are read fresh, the cache stays
    tree, _, reused = cap.capture(model, optim)
    assert reused and tree["optim"]["param_groups"][0]["lr"] == 0.5
    model.extra = torch.nn.Linear(2, 2)  # a new parameter, not in the optimizer
    assert not fresh_equal()
    optim.add_param_group({"params": model.extra.parameters()})
    assert not fresh_equal()
    # the same storage and size under a new shape or strides (found by a review: saved the old view's bytes)
    model.extra.weight.data = model.extra.weight.data.t()  # square: only the strides tell
    assert not fresh_equal()
    model.extra.weight.data = model.extra.weight.data.reshape(4)
    assert not fresh_equal()


def test_a_parameter_rebound_to_a_transposed_view_of_itself_is_saved_as_it_is(daemon) -> None:  # noqa: ANN001
    """``p.data = p.data.t()`` keeps the storage and the size: the capture cache took the snapshot for unchanged
    and saved the old view, so a square weight came back untransposed, silently. Strides are in the fingerprint."""
    m = torch.nn.Linear(4, 4, bias=False)
    with daemon.client("t") as c:
        c.snapshot(m, step=1, blocking=True).wait(30)
        m.weight.data = m.weight.data.t()
        c.snapshot(m, step=2, blocking=True).wait(30)
        m2 = torch.nn.Linear(4, 4, bias=False)
        c.restore(m2, step=2)
    assert torch.equal(m2.weight, m.weight)


def test_snapshots_through_the_cache_restore_exactly(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("j") as c:
        for step in range(1, 5):
            train_step(model, optim, step)
            optim.param_groups[0]["lr"] *= 0.5  # a scheduler
            want = full_state(model, optim)
            c.snapshot(model, optim, step=step, extra={"s": step, "t": torch.full((2,), step)}).wait(30)
            m2, o2 = make(seed=9)
            extra = c.restore(m2, o2)
            assert_same(full_state(m2, o2), want)
            assert extra["s"] == step and torch.equal(extra["t"], torch.full((2,), step))
        assert c._stager.capture.hits >= 3


def test_early_copy_is_used_while_the_capture_holds_and_discarded_when_it_does_not(daemon, monkeypatch) -> None:  # noqa: ANN001
    """Blocking snapshots of states with many tensors start copying the cached sources before the capture
    check ends; a check that fails (a rebound parameter, a new layout) must throw that copy away."""
    import ckptd.client.copy

    monkeypatch.setattr(ckptd.client.copy, "EARLY_COPY_MIN_TENSORS", 1)  # the test model is small
    model, optim = make()
    with daemon.client("j") as c:

        def check(step: int, early: int, **kw: object) -> None:
            want = full_state(model, optim)
            c.snapshot(model, optim, step=step, blocking=True, **kw).wait(30)
            assert c.early_copies == early
            m2, o2 = make(seed=9)
            extra = c.restore(m2, o2)
            assert_same(full_state(m2, o2), want)
            sent = kw.get("extra", {})
            assert extra.keys() == sent.keys()
            assert all(torch.equal(extra[k], v) if torch.is_tensor(v) else extra[k] == v for k, v in sent.items())

        train_step(model, optim, 1)
        check(1, 0)  # nothing cached yet
        train_step(model, optim, 2)
        check(2, 1)  # values changed, the capture held: the early copy is the copy
        check(3, 1, extra={"t": torch.arange(3), "n": 3})  # extras add chunks: a new stage, the early copy is discarded
        check(4, 2, extra={"t": torch.arange(3) + 1, "n": 4})  # same extra shapes: early copy, fresh extras
        with torch.no_grad():
            model.hidden.weight.data = model.hidden.weight.data + 1  # rebound: same shape, new storage
        check(5, 2, extra={"t": torch.arange(3), "n": 5})  # the early copy read the old storage: discarded
        check(6, 3, extra={"t": torch.arange(3), "n": 6})


def test_early_copy_slot_is_given_back_when_the_snapshot_fails(daemon, monkeypatch) -> None:  # noqa: ANN001
    import ckptd.client.copy

    monkeypatch.setattr(ckptd.client.copy, "EARLY_COPY_MIN_TENSORS", 1)
    model, optim = make()
    train_step(model, optim, 1)
    with daemon.client("j") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
        with pytest.raises(TypeError, match="extra must be a dict"):
            c.snapshot(model, optim, step=2, blocking=True, extra=["not", "a", "dict"])  # type: ignore[arg-type]
        assert c.status()["slots"].get("leased", 0) == 0  # the early lease was released
        c.snapshot(model, optim, step=3, blocking=True).wait(30)
        assert c.early_copies == 1


def test_an_early_copy_whose_slot_is_refused_falls_back_to_the_copy_after_the_collective(daemon, monkeypatch) -> None:  # noqa: ANN001
    """The early copy leases its slot before the plan's collective, so it never waits for one: refused (the
    budget is full), the snapshot goes on and leases after the collective, where every rank would see it."""
    import ckptd.client.copy
    from ckptd.errors import CheckpointError

    monkeypatch.setattr(ckptd.client.copy, "EARLY_COPY_MIN_TENSORS", 1)
    model, optim = make()
    train_step(model, optim, 1)
    with daemon.client("j") as c:
        c.snapshot(model, optim, step=1).wait(30)  # CPU state: copied before returning; the stage is cached now
        real, waits = c._alloc, []

        def alloc(*args: object, wait: bool = True) -> str:
            waits.append(wait)
            if not wait:
                raise CheckpointError("shared-memory budget full (refused at once)")
            return real(*args, wait=wait)  # type: ignore[arg-type]

        monkeypatch.setattr(c, "_alloc", alloc)
        train_step(model, optim, 2)
        want = full_state(model, optim)
        c.snapshot(model, optim, step=2).wait(30)
        assert waits == [False, True] and c.early_copies == 0
        m2, o2 = make(seed=9)
        c.restore(m2, o2)
        assert_same(full_state(m2, o2), want)


def test_a_buffer_rebound_to_another_dtype_or_empty_shape_is_captured_afresh(daemon) -> None:  # noqa: ANN001
    """The fingerprint had data pointer, size and strides but no dtype, and every empty tensor has data pointer 0:
    a buffer rebound to a same-size view of another dtype, or an empty (2, 0) float buffer replaced by an empty
    (5, 0) int64 one, kept the old capture, and the step could not be restored into the model as it now is."""

    class M(torch.nn.Module):
        def __init__(self, n: int = 2, qdt: torch.dtype = torch.float32, bdt: torch.dtype = torch.float32) -> None:
            super().__init__()
            self.register_buffer("queue", torch.empty(n, 0, dtype=qdt))
            self.register_buffer("bits", torch.zeros(4, dtype=bdt))

    m = M()
    with daemon.client("dt") as c:
        c.snapshot(m, step=1, blocking=True).wait(30)
        m.queue = torch.empty(5, 0, dtype=torch.int64)
        m.bits.data = m.bits.data.view(torch.int32)
        m.bits.fill_(7)
        c.snapshot(m, step=2, blocking=True).wait(30)
        m2 = M(5, torch.int64, torch.int32)
        c.restore(m2, step=2)
    assert m2.queue.shape == (5, 0) and m2.queue.dtype == torch.int64
    assert m2.bits.dtype == torch.int32 and m2.bits.tolist() == [7, 7, 7, 7]


def test_param_groups_reordered_or_with_a_tensor_lr_are_captured_afresh(daemon) -> None:  # noqa: ANN001
    """On a cache hit, the current hyperparameters were zipped with the first capture's parameter lists: groups
    reordered (same sizes) saved each group's lr against the other's parameters, and an lr that became a tensor
    left the step pointing at a tensor never written (unrestorable)."""
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    a, b = list(m[0].parameters()), list(m[1].parameters())
    opt = torch.optim.SGD([{"params": a, "lr": 0.1}, {"params": b, "lr": 0.2}])
    with daemon.client("pg") as c:
        c.snapshot(m, opt, step=1, blocking=True).wait(30)
        opt.param_groups.reverse()  # same sizes, other order
        c.snapshot(m, opt, step=2, blocking=True).wait(30)
        o2 = torch.optim.SGD([{"params": list(m[1].parameters()), "lr": 9.0}, {"params": list(m[0].parameters()), "lr": 9.0}])
        c.restore(m, o2, step=2)
        assert [g["lr"] for g in o2.param_groups] == [0.2, 0.1]  # m[1]'s group keeps its own lr
        for g in opt.param_groups:
            g["lr"] = torch.tensor(g["lr"])  # a capturable lr
        c.snapshot(m, opt, step=3, blocking=True).wait(30)
        c.restore(m, o2, step=3)
        assert [float(g["lr"]) for g in o2.param_groups] == pytest.approx([0.2, 0.1])


def test_a_re_created_optimizers_old_state_is_freed_before_the_next_snapshot(daemon) -> None:  # noqa: ANN001
    """The capture and stage caches held views of the old optimizer's state (and the optimizer itself) until
    the next snapshot: on a GPU a second copy of the Adam state, allocated while the new optimizer makes its own."""
    import gc
    import weakref

    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("reopt") as c:
        c.snapshot(model, optim, step=1).wait(30)
        old_state = [weakref.ref(v) for st in optim.state.values() for v in st.values()]
        old = weakref.ref(optim)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)  # a new phase
        gc.collect()
        assert old() is None and all(r() is None for r in old_state)
        train_step(model, optim, 1)
        want = full_state(model, optim)
        c.snapshot(model, optim, step=2).wait(30)
        m2, o2 = make(seed=3)
        c.restore(m2, o2)
        assert_same(full_state(m2, o2), want)
