"""Stages 2/3 free the reduced gradient shard after each step and make it again at the first
reduction of the next backward ([Note: gradient shard lifetime] in core/group.py), so it never sits
under the next forward's activations; within an accumulation window it is kept and added into.
Counted at every unit's forward pre-hook: the bytes of gradient tensors the engine's flat groups
hold in compute memory (an offload store's shard lives in the store and is not counted). Losses and
parameters stay bit-for-bit DDP's, and with CPU offload of the optimizer too.

The step frees each group's gradient shard once that group's update has read it, stepping the
groups one at a time where that is the same update ([Note: one group at a time] in
core/optim/rollback.py); with `transactional_step: "copy"` a failure in a later group's update still
undoes the earlier groups."""

from __future__ import annotations

import torch

from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, train_ddp
from tests.zs_common import adamw, assert_close, full_params, gpt_model_fn, make_config
from zeroshard import initialize
from zeroshard.core.optim.rollback import steps_apart_alike
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 3


def _held_grad_bytes(groups) -> int:
    total = 0
    for group in groups:
        for tensor in (group.grad_shard, group.full_grad):
            if tensor is None or (group.grad_store is not None and group.grad_store.holds(tensor)):
                continue
            total += tensor.untyped_storage().size()
    return total


def _case(stage: int, gas: int, offload: bool) -> dict:
    batches = gpt_batches(tiny_gpt_config(), batch_size=4)
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    ref = train_ddp(
        gpt_model_fn(),
        batches,
        optimizer_fn=adamw,
        steps=STEPS,
        grad_accum=gas,
        reduce_every_micro_step=True,
        record_params=True,
    )
    model = gpt_model_fn()()
    engine, *_ = initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(stage, gas, **zero))
    groups = [g for g in engine.groups if g.trainable]
    seen: list[int] = []  # bytes held at each pre-forward of the current micro step
    hooks = [m.register_forward_pre_hook(lambda *_: seen.append(_held_grad_bytes(groups))) for m in model.modules()]
    ours = {"losses": [], "params_per_step": []}
    held = []  # per micro step: the most gradient bytes held at a pre-forward
    for step in range(STEPS):
        losses = []
        for micro in range(gas):
            seen.clear()
            inputs, targets = batches(step, micro, engine.global_rank)
            loss = engine(inputs, targets)[1]
            held.append(max(seen))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        ours["losses"].append(losses)
        ours["params_per_step"].append(full_params(engine))
    ours["params"] = full_params(engine)
    for hook in hooks:
        hook.remove()
    assert_close(ours, ref, exact=True, what=f"stage {stage} gas {gas} offload {offload}")
    shard_bytes = sum(g.layout.shard_numel * g.grad_dtype.itemsize for g in groups)
    report = {"held": held, "shard_bytes": shard_bytes, "grads_reported": engine.memory_report()["grads"]}
    engine.destroy()
    return report


def _worker(rank: int, world: int) -> list[dict]:
    cases = [dict(stage=s, gas=g, offload=False) for s in (2, 3) for g in (1, 2)]
    cases += [dict(stage=3, gas=2, offload=True)]
    return subtests(cases, _case)


def test_gradient_shard_is_not_held_through_the_next_forward():
    for reports in run_distributed(_worker, 2, timeout=300):
        *in_memory, offloaded = reports
        for report, gas in zip(in_memory, (1, 2, 1, 2)):
            shard = report["shard_bytes"]
            # The first forward of every window holds no gradient; a later micro step of the window
            # holds exactly the shard it accumulates into (and no full gradient).
            firsts = report["held"][::gas]
            laters = [h for i, h in enumerate(report["held"]) if i % gas]
            assert firsts == [0] * STEPS, report
            assert laters == [shard] * (STEPS * (gas - 1)), report
            assert report["grads_reported"] == shard, report  # a model state, counted at its size
        # The store's shard is never in compute memory (and is the store's tensor for good).
        assert offloaded["held"] == [0] * (2 * STEPS), offloaded


def _reuse_case(stage: int, gas: int) -> dict:
    """[Note: spent full gradients reused]: with 4 blocks, the full gradients of the later blocks of
    a backward are buffers of earlier blocks whose reductions completed; bit for bit DDP, and no
    buffer is kept past the backward."""
    config = tiny_gpt_config(n_layer=4)
    batches = gpt_batches(config, batch_size=4)
    ref = train_ddp(
        gpt_model_fn(n_layer=4),
        batches,
        optimizer_fn=adamw,
        steps=STEPS,
        grad_accum=gas,
        reduce_every_micro_step=True,
        record_params=True,
    )
    model = gpt_model_fn(n_layer=4)()
    engine, *_ = initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(stage, gas))
    spent = engine.lifecycle.spent
    real_take, given = spent.take, set()
    real_give = spent.give
    taken = []  # per full gradient made: was it a buffer a completed reduction gave back?

    def take(numel, dtype, device):
        tensor = real_take(numel, dtype, device)
        taken.append(tensor.data_ptr() in given)
        return tensor

    def give(tensor):
        given.add(tensor.data_ptr())
        real_give(tensor)

    spent.take, spent.give = take, give
    ours = {"losses": [], "params_per_step": []}
    reused, kept_after = [], []
    for step in range(STEPS):
        losses = []
        for micro in range(gas):
            taken.clear()
            given.clear()
            loss = engine(*batches(step, micro, engine.global_rank))[1]
            engine.backward(loss)
            reused.append(sum(taken))
            kept_after.append(sum(len(v) for v in spent._free.values()))
            engine.step()
            losses.append(loss.item())
        ours["losses"].append(losses)
        ours["params_per_step"].append(full_params(engine))
    ours["params"] = full_params(engine)
    engine.destroy()
    assert_close(ours, ref, exact=True, what=f"stage {stage} gas {gas}, 4 blocks")
    assert kept_after == [0] * (STEPS * gas), kept_after
    # Blocks 3 and 2 are made before any reduction completed; 1 and 0 take 3's and 2's buffers.
    assert all(r >= 2 for r in reused), reused
    return {"reused": reused}


def _reuse_worker(rank: int, world: int) -> list[dict]:
    return subtests([dict(stage=s, gas=g) for s in (2, 3) for g in (1, 2)], _reuse_case)


def test_spent_full_gradients_are_reused_within_a_backward():
    print(run_distributed(_reuse_worker, 2, timeout=300)[0])


class FailsAtCall(torch.optim.AdamW):
    """AdamW that, when armed, raises from its n-th step() call, after that call updated."""

    fail_at = None
    calls = 0

    def step(self, closure=None):
        result = super().step(closure)
        FailsAtCall.calls += 1
        if FailsAtCall.fail_at is not None and FailsAtCall.calls == FailsAtCall.fail_at:
            raise RuntimeError("injected: the optimizer failed after updating")
        return result


class CountsPerGroup(torch.optim.SGD):
    """SGD whose step size shrinks with a step count kept per param group (as apex's FusedAdam keeps
    group["step"]): one step() per flat group would count too many steps."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            group["lr"] = 0.1 / group["step"]
        return super().step(closure)


def _state(engine) -> dict:
    return {
        "masters": [g.master.clone() for g in engine.groups],
        "optimizer": [
            {k: torch.as_tensor(v).clone() for k, v in engine.optimizer.group_state(g).items()}
            for g in engine.optimizer.groups
        ],
    }


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"])) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a["optimizer"], b["optimizer"])
    )


def _failing_group_case(stage: int) -> dict:
    """With "copy", a step whose third group's update raises is undone for every group, the first
    two included; after zero_grad() the run equals one that never had it."""
    batches = gpt_batches(tiny_gpt_config(), batch_size=4)
    runs = []
    for failing in (False, True):
        model = gpt_model_fn()()
        config = make_config(stage)
        config["zeroshard"]["transactional_step"] = "copy"
        engine, *_ = initialize(
            model=model, optimizer=FailsAtCall(model.parameters(), lr=1e-2, weight_decay=0.1), config=config
        )
        losses, raised = [], None
        for step in range(3):
            loss = engine(*batches(step, 0, engine.global_rank))[1]
            engine.backward(loss)
            if failing and step == 1:
                before, FailsAtCall.calls, FailsAtCall.fail_at = _state(engine), 0, 3
                try:
                    engine.step()
                except RuntimeError as error:
                    raised = str(error)
                FailsAtCall.fail_at = None
                assert raised and _same(_state(engine), before), "a failed step changed model states"
                engine.zero_grad()
                loss = engine(*batches(step, 0, engine.global_rank))[1]
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs.append(
            {
                "losses": losses,
                "state": _state(engine),
                "per_group": engine.optimizer._per_group,
                "groups": len(engine.optimizer.groups),
                "copied": engine.optimizer.snapshot_peak_bytes,
            }
        )
        engine.destroy()
    clean, failed = runs
    assert failed["losses"] == clean["losses"] and _same(failed["state"], clean["state"]), (clean, failed)
    return {"per_group": clean["per_group"], "groups": clean["groups"]}


def _failing_group_worker(rank: int, world: int) -> list[dict]:
    return subtests([dict(stage=s) for s in (1, 3)], _failing_group_case)


def test_a_later_group_failing_undoes_the_groups_stepped_before_it():
    for reports in run_distributed(_failing_group_worker, 2, timeout=300):
        for report in reports:
            # The failure was in the last group's update (the 3rd), after every other group was updated.
            assert report["per_group"] and report["groups"] == 3, report


def test_one_step_per_group_only_where_it_is_the_same_update():
    params = [torch.nn.Parameter(torch.ones(2))]
    for optimizer in (
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
        torch.optim.Adam(params),
        torch.optim.SGD(params, lr=0.1, momentum=0.9),
        torch.optim.Adagrad(params),
        FailsAtCall(params),
    ):
        assert steps_apart_alike(optimizer, torch.device("cpu")), type(optimizer).__name__
    assert not steps_apart_alike(CountsPerGroup(params, lr=0.1), torch.device("cpu"))
