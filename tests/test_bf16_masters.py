"""bf16 master weights and optimizer states ([Note: bf16 master weights] in core/precision.py).

The oracle is the recipe written out in one process for 2 emulated ranks: a bf16 model computes each
rank's gradients, which are averaged the way DDP does (each times 1/N, summed in rank order) in
bf16, and torch's AdamW steps the bf16 parameters themselves (its moments bf16 like them). At 2
ranks every stage equals it bit for bit, with the optimizer's states in host memory or NVMe files too
(and at stage 3 the parameters). Checkpoints resume at another stage and world size, and
consolidation, the Hugging Face export and DCP carry the bf16 masters exactly.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import zeroshard
from tests.checkpoint_helpers import check_same_states, checkpoint_states, full_params, state_difference
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, sum_in_order
from tests.zs_common import gather_masters, gpt_model_fn, make_config, torch_compile
from zeroshard.config import ConfigKeyNotActedOnWarning
from zeroshard.tools.estimator import model_state_bytes, recipe
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 6
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)
BF16_MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(steps: int, world: int) -> dict:
    model = gpt_model_fn()().to(torch.bfloat16)
    optimizer = _adamw(model.parameters())
    losses = []
    for step in range(steps):
        per_rank = []
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            loss = gpt_loss(model, *BATCHES(step, 0, rank))
            loss.float().backward()
            per_rank.append([p.grad * (1.0 / world) for p in model.parameters()])
            losses.append(loss.item()) if rank == 0 else None
        for param, grads in zip(model.parameters(), zip(*per_rank)):
            param.grad = sum_in_order(list(grads))
        optimizer.step()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _config(stage: int, **zero) -> dict:
    return {**make_config(stage, **zero), "bf16": dict(BF16_MASTERS)}


def _engine(stage: int, optimizer_fn=_adamw, **zero):
    model = gpt_model_fn()()
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=optimizer_fn(model.parameters()), config=_config(stage, **zero)
    )
    return engine


def _train(engine, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        _, loss = engine(*BATCHES(step, 0, engine.global_rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _matches_recipe(stage: int, offload: str | None = None, nvme_path: str = "") -> None:
    zero: dict = {}
    if offload is not None:  # the optimizer's states (and at stage 3 the parameters) to host memory or files
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme_path}
        if stage == 3:
            zero["offload_param"] = {"device": offload, "nvme_path": nvme_path}
    engine = _engine(stage, **zero)
    assert all(g.master.dtype == torch.bfloat16 for g in engine.groups)
    assert all(g.master_is_parameter_storage() for g in engine.groups), "the bf16 parameters are the masters"
    losses = _train(engine, 0, STEPS)
    states = [v for state in engine.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    assert {v.dtype for v in states if v.dim() == 1} == {torch.bfloat16}, "Adam's moments are bf16 like the master"
    masters = gather_masters(engine)
    if offload == "nvme":
        assert engine.memory_report()["offloaded_nvme"] > 0, "the states went to files"
    if offload is None:  # model states against the estimator's bf16-master recipe (2 + 2 + 4 bytes per parameter)
        psi, memory = engine.num_parameters(), engine.memory_report()
        predicted = model_state_bytes(psi, engine.world_size, stage, recipe("bf16", "adamw", master="bf16"))
        step_counters = 4 * len(engine.groups)  # Adam's `step`, one fp32 scalar per flat group
        for measured, formula in (
            (memory["params"] + memory["master"], predicted.params),
            (memory["grads"], predicted.grads),
            (memory["optimizer"] - step_counters, predicted.optimizer),
        ):
            assert abs(measured - formula) <= 0.02 * formula, (stage, memory, predicted)
    engine.destroy()
    ref = _reference(STEPS, torch.distributed.get_world_size())
    if engine.global_rank == 0:
        assert losses == ref["losses"], (stage, losses, ref["losses"])
    for name, value in ref["params"].items():
        assert torch.equal(masters[name].view(value.shape), value), (stage, name)
    assert sum(losses[-2:]) < sum(losses[:2]), f"loss must fall: {losses}"


def _resumes_at_another_stage(directory: str) -> None:
    """Saved at stage 3 after 3 steps, resumed at stage 1: the next 3 steps are the straight run's."""
    straight = _engine(3)
    _train(straight, 0, 3)
    straight.save_checkpoint(directory, tag="three")
    went_on = _train(straight, 3, 3)
    params = full_params(straight)
    straight.destroy()
    resumed = _engine(1)
    resumed.load_checkpoint(directory, tag="three")
    assert _train(resumed, 3, 3) == went_on
    ours = full_params(resumed)
    assert all(torch.equal(ours[name], value) for name, value in params.items())
    resumed.destroy()


def _stochastic_rounding_trains() -> None:
    """torchao's AdamW8bit with bf16_stochastic_round on bf16 masters: states of ~2 bytes per
    parameter beside the 2-byte master, and the loss falls."""
    import torchao.optim as torchao_optim  # the `lowbit` extra, which make venv installs

    engine = _engine(3, lambda params: torchao_optim.AdamW8bit(params, lr=1e-2, bf16_stochastic_round=True))
    with torch_compile(False):  # tests/test_lowbit_optimizers.py runs torchao's compiled update
        losses = _train(engine, 0, STEPS)
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    engine.destroy()


def _worker(rank: int, world: int, directory: str) -> None:
    # Stage 0 keeps the full buffer as the master, as stages 1 and 2 do (a view of it).
    offloaded = [dict(stage=2, offload="cpu"), dict(stage=2, offload="nvme"), dict(stage=3, offload="nvme")]
    nvme = f"{directory}-nvme-{rank}"
    subtests([dict(stage=s) for s in (1, 2, 3)] + [{**case, "nvme_path": nvme} for case in offloaded], _matches_recipe)
    subtests([dict(directory=directory)], _resumes_at_another_stage)
    subtests([{}], _stochastic_rounding_trains)


def _reshard_worker(rank: int, world: int, directory: str, again: str) -> None:
    """The 2-rank stage-3 checkpoint at 1 rank, stage 2: the same states; consolidated, exported for
    Hugging Face and written as DCP, the bf16 masters come out exactly (widened to fp32 where asked),
    and a DCP checkpoint loads back into a stage-3 engine with every state as it was."""
    from safetensors.torch import load_file

    from zeroshard.checkpoint import consolidate

    engine = _engine(2)
    engine.load_checkpoint(directory, tag="three")
    engine.save_checkpoint(again, tag="three")
    check_same_states(engine, f"{again}/three", f"{directory}/three", "2 ranks stage 3 -> 1 rank stage 2")
    masters = full_params(engine)
    assert {value.dtype for value in masters.values()} == {torch.bfloat16}
    full = load_file(consolidate(directory, f"{again}/full.safetensors", tag="three", progress=False)["output"])
    hf = load_file(engine.save_16bit_model(f"{again}/hf"))  # the compute dtype, bf16, as DeepSpeed writes it
    for name, value in masters.items():
        assert full[name].dtype == torch.float32 and torch.equal(full[name], value.float()), name
        assert hf[name].dtype == torch.bfloat16 and torch.equal(hf[name], value), name
    engine.save_dcp(f"{again}/dcp")
    engine.destroy()
    from_dcp = _engine(3)
    from_dcp.load_dcp(f"{again}/dcp")
    ours = full_params(from_dcp)
    assert all(torch.equal(ours[name], value) for name, value in masters.items())
    from_dcp.save_checkpoint(f"{again}/after-dcp", tag="three")
    # DCP holds the model and the optimizer, as FSDP2 writes them: not the engine's step counts.
    through, saved = (checkpoint_states(f"{d}/three") for d in (f"{again}/after-dcp", directory))
    assert state_difference(*({k: v for k, v in c.items() if k != "steps"} for c in (through, saved))) is None
    from_dcp.destroy()


@pytest.mark.slow
def test_bf16_masters_match_the_recipe_and_resume_anywhere(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(_worker, 2, timeout=600, directory=directory)
    run_distributed(_reshard_worker, 1, timeout=600, directory=directory, again=str(tmp_path / "again"))


def test_the_config_keys_set_the_master_dtype():
    from zeroshard.compat.policies import precision_policy

    def policy(bf16: dict):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = zeroshard.load_config({"train_micro_batch_size_per_gpu": 1, "bf16": bf16}, world_size=1)
        return precision_policy(cfg), [
            str(w.message) for w in caught if issubclass(w.category, ConfigKeyNotActedOnWarning)
        ]

    masters, warned = policy(BF16_MASTERS)
    assert masters.master_dtype == torch.bfloat16 and masters.params_are_masters and not warned
    plain, warned = policy({"enabled": True})
    assert plain.master_dtype == torch.float32 and not plain.params_are_masters and not warned
    implied, warned = policy({"enabled": True, "bf16_master_weights_and_grads": True})
    assert implied.master_dtype == torch.bfloat16 and not warned  # the states follow the master
    _, warned = policy({"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": False})
    assert any("bf16_optimizer_states" in w for w in warned), warned
    off, warned = policy({"enabled": False, "bf16_master_weights_and_grads": True})
    assert off.master_dtype == torch.float32 and any("bf16_master_weights_and_grads" in w for w in warned)
    with pytest.raises(ValueError, match="param_dtype=torch.bfloat16"):
        zeroshard.PrecisionPolicy(torch.float32, torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="master_dtype"):
        zeroshard.PrecisionPolicy(torch.float16, torch.float16, torch.float16)
