"""A fused torch AdamW step takes no copy and is still all or nothing ([Note: an update that cannot
fail half-way] in core/atomic.py).

Two ranks, a tiny GPT, two param groups (decay / no decay), torch's fused AdamW. Against the same
run with `transactional_step: "copy"` (the copy every step) and `false` (none): the same losses and
final state bit for bit, and only the 0-dim `step` counters copied. Failures injected by wrapping
torch's fused kernel (in this test process only): one raised before the first group's kernel
leaves everything as it was; one raised after a group's kernel says that the step cannot be undone;
Ctrl-C during the update is delivered when the step has completed. A bad `lr` that only the last
param group's kernel would reject is found on a twin first, so that step copies and is undone.
"""
from __future__ import annotations

import os
import signal

import pytest
import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss
from tests.test_failures import Injected, _assert_same, _state
from tests.zs_common import gpt_model_fn, make_config
from zeroshard.core.atomic import StepNotUndone, held_interrupts, why_not_atomic
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 3
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)


def _fused_adamw(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2, fused=True)


def _engine(stage: int, transactional=None):
    model = gpt_model_fn()()
    config = make_config(stage)
    config["zeroshard"]["comm_timeout_s"] = 20
    if transactional is not None:
        config["zeroshard"]["transactional_step"] = transactional
    engine, *_ = zeroshard.initialize(model=model, optimizer=_fused_adamw(model), config=config)
    return engine


def _micro(engine, step: int) -> float:
    loss = gpt_loss(engine, *BATCHES(step, 0, engine.global_rank))
    engine.backward(loss)
    engine.step()
    return loss.item()


class _Kernel:
    """torch._fused_adamw_ wrapped: `action(call)` runs before the real kernel's `call`-th call on
    one of `engine`'s masters (not on the twins the check steps)."""

    def __init__(self, engine, action):
        self.masters = {id(g.master) for g in engine.optimizer.groups}
        self.action, self.calls, self.real = action, 0, torch._fused_adamw_

    def __enter__(self):
        torch._fused_adamw_ = self
        return self

    def __exit__(self, *exc):
        torch._fused_adamw_ = self.real

    def __call__(self, *args, **kwargs):
        if any(id(p) in self.masters for p in args[0]):
            self.calls += 1
            self.action(self.calls)
        return self.real(*args, **kwargs)


def _alike_case(stage: int) -> None:
    """Default, "copy" and false train alike; the default copies only the step counters."""
    runs = {}
    for transactional in (None, "copy", False):
        engine = _engine(stage, transactional)
        losses = [_micro(engine, 0)]
        kept_after_first = engine.optimizer.snapshot_bytes()  # the first step creates the state: it copies
        losses += [_micro(engine, step) for step in range(1, STEPS)]
        runs[transactional] = (losses, _state(engine), engine.optimizer.snapshot_peak_bytes,
                               max(kept_after_first, engine.optimizer.snapshot_bytes()))
        engine.destroy()
    masters = sum(g.master.numel() * 4 for g in engine.optimizer.groups)
    for other in ("copy", False):
        assert runs[other][0] == runs[None][0], (other, runs[other][0], runs[None][0])
        _assert_same(runs[other][1], runs[None][1], f"stage {stage}: transactional_step {other!r} against the default")
    n_groups = len(engine.optimizer.groups)
    assert runs[None][2] <= 8 * n_groups, f"the default copied {runs[None][2]} bytes (step counters only)"
    assert runs["copy"][2] >= 3 * masters, f"'copy' copied {runs['copy'][2]} bytes, masters are {masters}"
    assert runs[None][3] == 0, "no copy is kept between steps, from the first on"
    assert (runs["copy"][3] > 0) == (stage == 0), "stage 0 keeps its copy when it copies"


def _failing_case(stage: int, when: str) -> None:
    """The kernel's first call raises (nothing was updated), or its second (a group was)."""
    engine = _engine(stage)
    _micro(engine, 0)
    _micro(engine, 1)
    before = _state(engine)
    failing_call = 1 if when == "before any group" else 2

    def fail(call):
        if call == failing_call:
            raise Injected("fused kernel failed")

    expected = Injected if when == "before any group" else StepNotUndone
    with _Kernel(engine, fail):
        with pytest.raises(expected) as caught:
            _micro(engine, 2)
    if expected is StepNotUndone:
        assert "1 of" in str(caught.value) and "Reload the last checkpoint" in str(caught.value), caught.value
        assert isinstance(caught.value.__cause__, Injected)
    else:
        _assert_same(_state(engine), before, f"stage {stage}: a kernel that raised before updating")
        engine.zero_grad()
        _micro(engine, 2)  # the same step again, after zero_grad
    engine.destroy()


def _interrupted_case(stage: int) -> None:
    """SIGINT during the first group's kernel: the step completes, then KeyboardInterrupt; the run
    goes on (after zero_grad) exactly as one never interrupted."""
    clean = _engine(stage)
    clean_losses = [_micro(clean, step) for step in range(STEPS)]
    clean_state = _state(clean)
    clean.destroy()
    engine = _engine(stage)
    losses = [_micro(engine, 0)]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        def interrupt(call):
            if call == 1:
                os.kill(os.getpid(), signal.SIGINT)
        loss = gpt_loss(engine, *BATCHES(1, 0, engine.global_rank))
        engine.backward(loss)
        with _Kernel(engine, interrupt) as kernel:
            try:
                engine.step()
                raise AssertionError("no KeyboardInterrupt")
            except KeyboardInterrupt:
                pass
        assert kernel.calls == len(engine.optimizer.groups), "every group's update ran before the interrupt"
        losses.append(loss.item())
    finally:
        signal.signal(signal.SIGINT, previous)
    engine.zero_grad()
    losses.append(_micro(engine, 2))
    assert losses == clean_losses, (losses, clean_losses)
    _assert_same(_state(engine), clean_state, f"stage {stage}: interrupted during the update")
    engine.destroy()


def _bad_lr_case(stage: int) -> None:
    """An lr the last group's kernel rejects, after the first group's update: a twin finds it, the
    step copies, and the failed step is undone bit for bit."""
    engine = _engine(stage)
    _micro(engine, 0)
    _micro(engine, 1)
    before = _state(engine)
    engine.optimizer.param_groups[-1]["lr"] = torch.tensor([1e-2, 1e-2])  # torch's __init__ refuses it
    with pytest.raises(RuntimeError):
        _micro(engine, 2)
    _assert_same(_state(engine), before, f"stage {stage}: a step the last param group's lr failed")
    assert engine.optimizer.snapshot_peak_bytes > 0
    engine.destroy()


def _worker(rank: int, world: int) -> None:
    subtests([dict(stage=s) for s in (0, 1, 2, 3)], _alike_case)
    subtests([dict(stage=s, when=w) for s in (0, 3) for w in ("before any group", "after a group")], _failing_case)
    subtests([dict(stage=s) for s in (0, 1, 3)], _interrupted_case)
    subtests([dict(stage=s) for s in (0, 3)], _bad_lr_case)


def test_fused_step_is_atomic_without_a_copy():
    run_distributed(_worker, 2, timeout=600)


# ---------------------------------------------------------------- one process: what the check refuses

def _stepped(optimizer):
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return params


@pytest.mark.parametrize("build,reason", [
    (lambda ps: torch.optim.AdamW(ps, fused=True), None),
    (lambda ps: torch.optim.Adam(ps, fused=True, amsgrad=True), None),
    (lambda ps: torch.optim.AdamW(ps), "not fused"),
    (lambda ps: type("MyAdamW", (torch.optim.AdamW,), {})(ps, fused=True), "not torch's Adam or AdamW"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "not torch's Adam or AdamW"),
])
def test_what_is_atomic(build, reason):
    optimizer = build([torch.zeros(6, requires_grad=True)])
    masters = [optimizer.param_groups[0]["params"][0]]
    assert why_not_atomic(optimizer, masters) is not None, "the first step creates the state: it copies"
    _stepped(optimizer)
    got = why_not_atomic(optimizer, masters, [torch.ones(6)])
    assert (got is None) if reason is None else (reason in got), got


def test_hooks_gradients_and_state_that_are_not_torchs_make_it_copy():
    optimizer = torch.optim.AdamW([torch.zeros(6, requires_grad=True)], fused=True)
    masters = _stepped(optimizer)
    assert why_not_atomic(optimizer, masters, [torch.ones(6)]) is None
    assert "contiguous" in why_not_atomic(optimizer, masters, [torch.ones(12)[::2]])
    handle = optimizer.register_step_post_hook(lambda *args: None)
    assert "hooks" in why_not_atomic(optimizer, masters)
    handle.remove()
    optimizer.state[masters[0]]["exp_avg"] = torch.zeros(3)
    assert "exp_avg" in why_not_atomic(optimizer, masters)
    del optimizer.state[masters[0]]["exp_avg"]
    assert "other entries" in why_not_atomic(optimizer, masters)


def test_held_interrupts_delivers_after_the_block():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with held_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("after the signal")
        assert done == ["after the signal"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
