"""The capture cache: reused only while it provably describes the live state."""

from __future__ import annotations

import torch
from _models import assert_same, full_state, make, train_step

from ckptd.capture import StateCapture


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
        assert c._capture.hits >= 3
