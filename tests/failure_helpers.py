"""Shared by the tests of failed calls (tests/test_failures.py, test_failed_update.py): the error a test
injects, and the training state that a call which raised must leave as it was."""

from __future__ import annotations

import torch


class Injected(RuntimeError):
    """The failure a test injects."""


def training_state(engine) -> dict:
    """Everything a failed call must leave as it was (gradients aside)."""
    with engine.gathered_parameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    optimizer = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in engine.optimizer.group_state(g).items()}
        for g in engine.optimizer.groups
    ]
    return {
        "params": params,
        "masters": [g.master.clone() for g in engine.groups],
        "optimizer": optimizer,
        "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "counters": (engine.global_steps, engine.micro_steps),
    }


def assert_same_state(a: dict, b: dict, what: str) -> None:
    """Two training_state results equal bit for bit."""
    assert a["counters"] == b["counters"], (what, a["counters"], b["counters"])
    assert a["scaler"] == b["scaler"], (what, a["scaler"], b["scaler"])
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{what}: parameter '{name}' changed"
    for x, y in zip(a["masters"], b["masters"]):
        assert torch.equal(x, y), f"{what}: a master shard changed"
    for x, y in zip(a["optimizer"], b["optimizer"]):
        assert x.keys() == y.keys(), (what, x.keys(), y.keys())
        for key in x:
            assert torch.equal(torch.as_tensor(x[key]), torch.as_tensor(y[key])), f"{what}: optimizer '{key}' changed"
