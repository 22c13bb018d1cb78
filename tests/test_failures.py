"""A forward, backward or step that raises changes nothing but the gradients, or refuses to go on.

All ranks raise (a forward hook, a gradient hook in the middle of backward while later units'
reductions are in flight -- in engine.backward(loss) and in loss.backward() --, the optimizer after
it updated). A failed forward or backward, and with `transactional_step: "copy"` a failed step too,
leaves parameters, masters, optimizer state, loss scaler and step counters what they were before
the failing call, bit for bit; backward() and step() refuse until zero_grad(); after zero_grad()
the run goes on exactly like a run that never had the failed micro steps. With the default
("fail_stop") a step that fails during its update refuses every later call, naming what changed,
until a checkpoint is loaded; from there the run goes on exactly like one that never failed
([Note: failed optimizer steps] in core/optim/rollback.py). Every stage, with and without offload and
accumulation, in the default config: at stages 1 and 2 step() leaves the all-gathers of the updated
parameters in flight, to the next forward ([Note: deferred parameter gather] in core/param_gather.py).

One rank raises: it gets its own error, every other rank a CollectiveError within a bounded time
(comm_timeout_s), and later calls raise at once instead of waiting again. Where the failing call is
a step, the healthy rank learns it in its own step if that waits for the all-gathers, and by default
at its next forward, which does.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import zeroshard
from tests.failure_helpers import Injected, assert_same_state, training_state
from tests.harness import outcome, run_at_once, run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import gpt_model_fn, make_config
from zeroshard.core.optim.rollback import UpdateFailed
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 3
FAILING_STEP = 1
COMM_TIMEOUT_S = 5
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)


class FlakyAdamW(torch.optim.AdamW):
    """AdamW that, when armed, raises after it has updated (the worst moment)."""

    armed = False

    def step(self, closure=None):
        result = super().step(closure)
        if FlakyAdamW.armed:
            raise Injected("optimizer failed after updating")
        return result


def _engine(
    stage,
    offload,
    gas,
    nvme,
    precision=None,
    step_waits_for_gathers=False,
    on_failed_update="copy",
    check_collectives=False,
):
    model = gpt_model_fn()()
    zero = {"offload_optimizer": {"device": offload, "nvme_path": nvme}, "sub_group_size": 1000} if offload else {}
    config = make_config(stage, gas, **zero)
    config["zeroshard"]["comm_timeout_s"] = COMM_TIMEOUT_S
    if step_waits_for_gathers:  # the default overlaps them with the next forward (tests/test_param_gather.py)
        config["zeroshard"]["overlap_param_gather"] = False
    config["zeroshard"]["transactional_step"] = on_failed_update
    config["zeroshard"]["check_collectives"] = check_collectives
    if precision:
        config[precision] = {"enabled": True, "loss_scale_window": 2, "initial_scale_power": 8}  # no overflow
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=FlakyAdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config=config
    )
    return engine


def _arm(engine, kind: str, armed: list) -> None:
    """Hooks that raise while `armed[0]`: in forward, or in backward once later units reduced."""

    def forward_hook(module, args, output):
        if armed[0] and kind == "forward hook":
            raise Injected("forward hook failed")
        if armed[0] and kind in ("backward", "loss.backward()"):

            def raise_in_backward(grad):
                raise Injected("backward failed")

            output.register_hook(raise_in_backward)
        return output

    engine.module.blocks[0].register_forward_hook(forward_hook)


def _expect(kind: type, text: str, fn, *args) -> None:
    """fn(*args) raises `kind` with `text` in its message (an Exception, so that subtests reports it)."""
    try:
        fn(*args)
    except kind as error:
        assert text in str(error), str(error)
        return
    raise AssertionError(f"{fn.__name__}{args[1:]} did not raise {kind.__name__}")


def _micro(engine, step, micro, torch_backward=False):
    loss = gpt_loss(engine, *BATCHES(step, micro, engine.global_rank))
    if torch_backward:  # DeepSpeed >= 0.17 lets scripts call loss.backward() on the engine's outputs
        loss.backward()
    else:
        engine.backward(loss)
    engine.step()
    return loss.item()


def _run(stage, offload, gas, nvme, kind, precision):
    """STEPS steps; with `kind`, the last micro step of FAILING_STEP fails once, then the step is redone.
    A failed forward or backward changes nothing by default; a failed update needs "copy"."""
    engine = _engine(
        stage, offload, gas, nvme, precision, on_failed_update="copy" if kind == "optimizer" else "fail_stop"
    )
    armed = [False]
    _arm(engine, kind or "", armed)
    losses = []
    for step in range(STEPS):
        failing = kind is not None and step == FAILING_STEP
        done = [_micro(engine, step, micro) for micro in range(gas - 1 if failing else gas)]
        if not failing:
            losses += done
            continue
        before = training_state(engine)
        armed[0], FlakyAdamW.armed = True, kind == "optimizer"
        _expect(Injected, "", _micro, engine, step, gas - 1, kind == "loss.backward()")
        armed[0], FlakyAdamW.armed = False, False
        assert_same_state(training_state(engine), before, f"after a failed {kind}")
        if kind != "forward hook":
            _expect(RuntimeError, "call zero_grad() first", _micro, engine, step, gas - 1)
        engine.zero_grad()  # drops the window: the whole step again
        losses += [_micro(engine, step, micro) for micro in range(gas)]
    final = training_state(engine)
    engine.destroy()
    return losses, final


def _all_ranks_case(stage, offload, gas, nvme, kind, precision=None) -> None:
    clean_losses, clean = _run(stage, offload, gas, nvme, None, precision)
    losses, final = _run(stage, offload, gas, nvme, kind, precision)
    assert losses == clean_losses, (losses, clean_losses)
    assert_same_state(final, clean, f"{kind} then zero_grad()")


SETTINGS = [
    dict(stage=0, offload=None),
    dict(stage=1, offload=None),
    dict(stage=2, offload=None),
    dict(stage=3, offload=None),
    dict(stage=2, offload="cpu"),
    dict(stage=3, offload="nvme"),
]
KINDS = ["forward hook", "backward", "optimizer"]


def _all_ranks_worker(rank: int, world: int, *, tmp: str) -> None:
    nvme = os.path.join(tmp, f"nvme{rank}")
    cases = [dict(s, gas=g, kind=k) for s in SETTINGS for g in (1, 2) for k in KINDS]
    cases += [dict(stage=s, offload=None, gas=1, kind=k, precision="fp16") for s in (1, 3) for k in KINDS]
    cases += [dict(stage=s, offload=None, gas=g, kind="loss.backward()") for s in (0, 1, 3) for g in (1, 2)]
    subtests([dict(c, nvme=nvme) for c in cases], _all_ranks_case)
    fail_stop = [dict(s, gas=1) for s in SETTINGS] + [dict(stage=3, offload=None, gas=2)]
    subtests([dict(c, nvme=nvme, checkpoint=os.path.join(tmp, "checkpoint")) for c in fail_stop], _fail_stop_case)


def _fail_stop_case(stage, offload, gas, nvme, checkpoint) -> None:
    """By default a step whose update fails refuses forward, backward and step, zero_grad() or not,
    until the checkpoint saved before it is loaded; the run then equals one that never failed."""
    clean_losses, clean = _run(stage, offload, gas, nvme, None, None)
    engine = _engine(stage, offload, gas, nvme, on_failed_update="fail_stop")
    losses = []
    for step in range(STEPS):
        if step == FAILING_STEP:
            engine.save_checkpoint(checkpoint, tag="before")
            for micro in range(gas - 1):
                _micro(engine, step, micro)
            FlakyAdamW.armed = True
            try:
                _expect(UpdateFailed, "raised Injected", _micro, engine, step, gas - 1)
            finally:
                FlakyAdamW.armed = False
            engine.zero_grad()
            _expect(UpdateFailed, "forward() refused", _micro, engine, step, 0)
            _expect(UpdateFailed, "step() refused", engine.optimizer.step)
            engine.load_checkpoint(checkpoint, tag="before")
        losses += [_micro(engine, step, micro) for micro in range(gas)]
    final = training_state(engine)
    engine.destroy()
    assert losses == clean_losses, (losses, clean_losses)
    assert_same_state(final, clean, "a failed update, then the checkpoint loaded")


@pytest.mark.slow
def test_failed_calls_change_nothing_but_gradients(tmp_path):
    run_distributed(_all_ranks_worker, 2, timeout=900, tmp=str(tmp_path))


# ---------------------------------------------------------------- one rank raises


def _one_rank_worker(rank: int, world: int, *, kind: str, stage: int) -> dict:
    # A step that fails on one rank: the healthy rank learns it in its own step when that waits for
    # the all-gathers; by default it learns it at its next forward (_step_fails_on_one_rank_worker).
    # The failing rank goes on training: only the collective check (the debug mode) stops it from
    # pairing its next collective with another one of the healthy rank's, which gloo answers by
    # aborting the process.
    engine = _engine(stage, None, 1, "", None, step_waits_for_gathers=kind == "optimizer", check_collectives=True)
    armed = [False]
    _arm(engine, kind, armed)
    _micro(engine, 0, 0)
    armed[0] = rank == 1
    FlakyAdamW.armed = rank == 1 and kind == "optimizer"
    started = time.monotonic()
    try:
        _micro(engine, 1, 0)
        first = ("no error", "")
    except Exception as error:  # noqa: BLE001 - what each rank got is the result
        first = (type(error).__name__, str(error))
    elapsed = time.monotonic() - started
    armed[0] = FlakyAdamW.armed = False
    started = time.monotonic()
    try:  # a rank that timed out must not wait again
        _micro(engine, 2, 0)
        second = ("no error", "")
    except Exception as error:  # noqa: BLE001
        second = (type(error).__name__, str(error))
    return {"first": first, "elapsed": elapsed, "second": second, "second_elapsed": time.monotonic() - started}


ONE_RANK_CASES = [("backward", 3), ("optimizer", 2), ("forward hook", 3), ("backward", 1)]


@pytest.fixture(scope="module")
def one_rank_outcomes():
    """What both ranks returned in each one-rank-fails case (and in the one without the check, key
    None, and the failed step with the gathers in flight, key "step"), the cases run side by side on
    ranks of their own: most of each is the healthy rank waiting for comm_timeout_s."""
    timeout = 10 * COMM_TIMEOUT_S
    calls = {
        (kind, stage): (
            lambda k=kind, s=stage: run_distributed(_one_rank_worker, 2, timeout=timeout, fresh=True, kind=k, stage=s)
        )
        for kind, stage in ONE_RANK_CASES
    }
    calls[None] = lambda: run_distributed(_one_rank_stops_worker, 2, timeout=timeout, fresh=True)
    calls["step"] = lambda: run_distributed(_step_fails_on_one_rank_worker, 2, timeout=timeout, fresh=True)
    return run_at_once(calls)


@pytest.mark.parametrize("kind,stage", ONE_RANK_CASES)
@pytest.mark.slow
def test_one_rank_failing_names_an_error_on_every_rank(kind, stage, one_rank_outcomes):
    healthy, failing = outcome(one_rank_outcomes, (kind, stage))
    print(
        f"{kind} at stage {stage}: rank 1 {failing['first'][0]}; rank 0 {healthy['first'][0]} after "
        f"{healthy['elapsed']:.1f}s, then {healthy['second'][0]} after {healthy['second_elapsed']:.3f}s"
    )
    assert failing["first"][0] == "Injected", failing
    assert healthy["first"][0] == "CollectiveError" and "rank 0" in healthy["first"][1], healthy
    assert healthy["elapsed"] < 3 * COMM_TIMEOUT_S, healthy
    assert healthy["second"][0] == "CollectiveError" and "refused" in healthy["second"][1], healthy
    assert healthy["second_elapsed"] < COMM_TIMEOUT_S / 2, healthy  # refused at once, not a timeout


def _one_rank_stops_worker(rank: int, world: int) -> dict:
    """The default (no collective check): rank 1 raises in backward and stops there, as a script that
    does not catch the error does; rank 0 gets a CollectiveError within a bounded time."""
    engine = _engine(3, None, 1, "", None)
    armed = [False]
    _arm(engine, "backward", armed)
    _micro(engine, 0, 0)
    armed[0] = rank == 1
    started = time.monotonic()
    try:
        _micro(engine, 1, 0)
        return {"first": ("no error", ""), "elapsed": time.monotonic() - started}
    except Exception as error:  # noqa: BLE001 - what each rank got is the result
        return {"first": (type(error).__name__, str(error)), "elapsed": time.monotonic() - started}


@pytest.mark.slow
def test_one_rank_failing_without_the_check_names_an_error_on_every_rank(one_rank_outcomes):
    healthy, failing = outcome(one_rank_outcomes, None)
    assert failing["first"][0] == "Injected", failing
    assert healthy["first"][0] == "CollectiveError" and "rank 0" in healthy["first"][1], healthy
    assert healthy["elapsed"] < 3 * COMM_TIMEOUT_S, healthy


def _step_fails_on_one_rank_worker(rank: int, world: int) -> dict:
    """Rank 1's step raises: it issues no gathers. Rank 0's step returns with its gathers in flight;
    its next forward waits for the first one and gets the CollectiveError, within comm_timeout_s."""
    engine = _engine(2, None, 1, "", None, check_collectives=True)  # rank 1 goes on: the debug mode
    _micro(engine, 0, 0)
    FlakyAdamW.armed = rank == 1
    results, started = [], time.monotonic()
    for step in (1, 2, 3):
        try:
            _micro(engine, step, 0)
            results.append(("no error", "", time.monotonic() - started))
        except Exception as error:  # noqa: BLE001 - what each rank got is the result
            results.append((type(error).__name__, str(error), time.monotonic() - started))
        FlakyAdamW.armed = False
        started = time.monotonic()
    return {"results": results}


@pytest.mark.slow
def test_one_rank_failing_in_step_names_an_error_at_the_next_forward(one_rank_outcomes):
    healthy, failing = outcome(one_rank_outcomes, "step")
    assert failing["results"][0][0] == "Injected", failing
    (first, _, _), (second, text, elapsed), (third, refused, third_elapsed) = healthy["results"]
    assert first == "no error", healthy  # step() only issued the gathers
    assert second == "CollectiveError" and "rank 0" in text and "updated parameters" in text, healthy
    assert elapsed < 3 * COMM_TIMEOUT_S, healthy
    assert third == "CollectiveError" and "refused" in refused and third_elapsed < COMM_TIMEOUT_S / 2, healthy
