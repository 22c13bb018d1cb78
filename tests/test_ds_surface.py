"""DeepSpeed's surface around the engine: module paths, the accelerator, `zeroshard.comm`,
engine accessors, the optimizer as a torch Optimizer, torch-style `loss.backward()`, two engines in
one script (a GAN), the safe_get/set accessors and the config semantics of DeepSpeed 0.19.8.

Each behaviour is checked against what plain torch computes on the same model and data, at 2 gloo
ranks and stages 0-3, bit for bit in fp32 where the arithmetic is the same."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard as deepspeed
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import adamw, gpt_model_fn, make_config
from zeroshard.config import ConfigKeyNotActedOnWarning, load_config
from zeroshard.tools.models.gpt import tiny_gpt_config

BATCHES = gpt_batches(tiny_gpt_config())


def _engine(stage: int, **config):
    model = gpt_model_fn()()
    cfg = dict(make_config(stage), **config)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=cfg)
    return engine, optimizer, scheduler


def _train(engine, steps: int, torch_style: bool = False) -> list[float]:
    losses = []
    for step in range(steps):
        inputs, targets = BATCHES(step, 0, engine.global_rank)
        loss = gpt_loss(engine, inputs, targets)
        loss.backward() if torch_style else engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine) -> dict[str, torch.Tensor]:
    from zeroshard.checkpoint import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(engine).items()}


# -- import paths ---------------------------------------------------------------------------------------
def _paths_case(stage: int) -> None:
    """Every DeepSpeed module path of compat/paths.py imports and does its job."""
    import zeroshard.comm as ds_comm
    from zeroshard.accelerator import get_accelerator
    from zeroshard.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    from zeroshard.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zeroshard.runtime.engine import DeepSpeedEngine
    from zeroshard.runtime.lr_schedules import WarmupLR
    from zeroshard.runtime.zero.partition_parameters import ZeroParamStatus
    from zeroshard.utils import logger, safe_get_full_fp32_param
    from zeroshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401

    assert ds_comm.get_rank() == dist.get_rank() and ds_comm.get_world_size() == 2 and ds_comm.is_initialized()
    flag = torch.tensor([float(ds_comm.get_rank() + 1)])
    ds_comm.all_reduce(flag, op=ds_comm.ReduceOp.SUM)
    ds_comm.barrier()
    assert flag.item() == 3.0
    assert get_accelerator().device_name() in ("cpu", "cuda") and ZeroParamStatus.AVAILABLE.value == 1
    model = gpt_model_fn()()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "weight_decay": 0.1}
    )
    assert len(groups) == 1 and not any(is_moe_param(p) for p in groups[0]["params"])
    for cls in (FusedAdam, DeepSpeedCPUAdam):
        optimizer = cls(groups, lr=1e-2)
        assert isinstance(optimizer, torch.optim.Optimizer)
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=make_config(stage))
        scheduler = WarmupLR(ds_optimizer, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=4)
        engine.lr_scheduler = scheduler
        _train(engine, 2)
        assert isinstance(engine, DeepSpeedEngine) and scheduler.last_batch_iteration == 1
        assert safe_get_full_fp32_param(next(engine.module.parameters())).shape == next(model.parameters()).shape
        logger.debug("trained %s at stage %d", cls.__name__, stage)
        engine.destroy()
        model = gpt_model_fn()()
        groups = [{"params": list(model.parameters())}]


# -- the optimizer is a torch Optimizer; torch schedulers drive it ---------------------------------------
def _optimizer_case(stage: int) -> None:
    engine, optimizer, _ = _engine(stage)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups is engine.optimizer.optimizer.param_groups
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    engine.lr_scheduler = scheduler
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if it thinks the scheduler stepped before the optimizer
        _train(engine, 3)
    assert engine.get_lr() == [pytest.approx(1e-2 / 4)]
    saved = optimizer.state_dict()
    optimizer.load_state_dict(saved)
    engine.destroy()


# -- engine accessors -------------------------------------------------------------------------------------
def _accessors_case(stage: int, tmp: str) -> None:
    engine, _, _ = _engine(stage)
    assert not engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.device == torch.device("cpu") and engine.zero_optimization() == (stage > 0)
    assert engine.zero_optimization_partition_gradients() == (stage >= 2)
    # Attributes the engine lacks come from the wrapped model (DeepSpeedEngine.__getattr__); its own win.
    assert engine.blocks is engine.module.blocks and engine.lm_head is engine.module.lm_head
    assert engine.config is not engine.module.config
    with pytest.raises(AttributeError):
        engine.no_such_attribute  # noqa: B018 - the lookup is what must raise
    _train(engine, 2)
    assert engine.was_step_applied() and engine.global_samples == 2 * engine.train_batch_size()
    assert engine.tput_timer.global_step_count == 2
    engine.empty_partition_cache()
    path = engine.save_checkpoint(tmp)
    import os

    assert os.path.exists(engine._get_ckpt_name(tmp, "global_step2")), path
    assert os.path.exists(engine._get_zero_ckpt_name(tmp, "global_step2"))
    engine.destroy()


def _no_sync_case(stage: int) -> None:
    """no_sync + set_gradient_accumulation_boundary: two micro batches, one step, like gas=2."""
    engine, _, _ = _engine(stage)
    if stage >= 2:
        with pytest.raises(RuntimeError, match="incompatible with the gradient partitioning"):
            with engine.no_sync():
                pass
        engine.destroy()
        return
    for step in range(2):
        for micro in range(2):
            inputs, targets = BATCHES(step, micro, engine.global_rank)
            if micro == 0:
                with engine.no_sync():
                    engine.backward(gpt_loss(engine, inputs, targets) / 2)
            else:
                engine.backward(gpt_loss(engine, inputs, targets) / 2)
        engine.step()
    manual = _params(engine)
    engine.destroy()
    engine, _, _ = _engine(stage)
    for step in range(2):
        for micro in range(2):
            engine.set_gradient_accumulation_boundary(micro == 1)
            inputs, targets = BATCHES(step, micro, engine.global_rank)
            engine.backward(gpt_loss(engine, inputs, targets) / 2)
        engine.step()
    boundary = _params(engine)
    engine.destroy()
    engine, _, _ = _engine(stage, gradient_accumulation_steps=2)
    for step in range(2):
        for micro in range(2):
            inputs, targets = BATCHES(step, micro, engine.global_rank)
            engine.backward(gpt_loss(engine, inputs, targets))
            engine.step()
    reference = _params(engine)
    engine.destroy()
    for name, value in reference.items():
        torch.testing.assert_close(manual[name], value, rtol=0, atol=0)
        torch.testing.assert_close(boundary[name], value, rtol=0, atol=0)


def _torch_backward_case(stage: int) -> None:
    """loss.backward() on the engine's output trains exactly like engine.backward(loss) (gas 2)."""
    results = []
    for torch_style in (False, True):
        engine, _, _ = _engine(stage, gradient_accumulation_steps=2)
        losses = _train(engine, 4, torch_style=torch_style)
        results.append((losses, _params(engine)))
        engine.destroy()
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], value, rtol=0, atol=0)


def _safe_accessors_case(stage: int) -> dict:
    from zeroshard.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    engine, _, _ = _engine(stage)
    _train(engine, 2)
    inputs, targets = BATCHES(5, 0, engine.global_rank)
    engine.backward(gpt_loss(engine, inputs, targets))
    names = [n for n, _ in engine.module.named_parameters()]
    params = dict(engine.module.named_parameters())
    out = {
        "master": {n: safe_get_full_fp32_param(params[n]) for n in names},
        "grad": {n: safe_get_full_grad(params[n]) for n in names},
        "exp_avg": {n: safe_get_full_optimizer_state(params[n], "exp_avg") for n in names},
    }
    engine.step()
    first = names[0]
    new = torch.full_like(out["master"][first], 0.25)
    safe_set_full_fp32_param(params[first], new)
    torch.testing.assert_close(safe_get_full_fp32_param(params[first]), new, rtol=0, atol=0)
    if stage < 3:
        torch.testing.assert_close(params[first].detach(), new, rtol=0, atol=0)
    safe_set_full_optimizer_state(params[first], new, "exp_avg")
    torch.testing.assert_close(safe_get_full_optimizer_state(params[first], "exp_avg"), new, rtol=0, atol=0)
    engine.destroy()
    return out


def _safe_worker(rank: int, world: int) -> list:
    return subtests([dict(stage=s) for s in (0, 1, 2, 3)], _safe_accessors_case)


def test_safe_accessors_agree_at_every_stage():
    """Stage 0 holds everything on each rank (nothing gathered): the gathered values of stages 1-3 must
    equal it bit for bit, and equal on both ranks."""
    per_rank = run_distributed(_safe_worker, 2, timeout=300)
    reference = per_rank[0][0]
    for rank_results in per_rank:
        for stage_out in rank_results:
            for kind, values in reference.items():
                for name, value in values.items():
                    torch.testing.assert_close(stage_out[kind][name], value, rtol=0, atol=0, msg=f"{kind} {name}")


# -- two engines in one script: a GAN ---------------------------------------------------------------------
class _G(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))

    def forward(self, z):
        return torch.tanh(self.net(z))


class _D(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x):
        return torch.sigmoid(self.net(x)).view(-1)


def _gan_step(netD, netG, backD, backG, stepD, stepG, real, noise):
    """One DCGAN-example iteration; returns (errD, errG)."""
    criterion = nn.BCELoss()
    netD.zero_grad()
    ones, zeros = torch.ones(real.shape[0]), torch.zeros(real.shape[0])
    errD_real = criterion(netD(real), ones)
    backD(errD_real)
    fake = netG(noise)
    errD_fake = criterion(netD(fake.detach()), zeros)
    backD(errD_fake)
    stepD()
    netG.zero_grad()
    errG = criterion(netD(fake), ones)  # G's backward flows through D's parameters
    backG(errG)
    stepG()
    return (errD_real + errD_fake).item(), errG.item()


def _gan_data(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g) * 0.5 + 1.0, torch.randn(8, 4, generator=g)


def _gan_case(stage: int) -> None:
    torch.manual_seed(0)
    netG, netD = _G(), _D()
    refG, refD = copy.deepcopy(netG), copy.deepcopy(netD)
    config = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "betas": [0.5, 0.999]}},
    }
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    with pytest.warns(ConfigKeyNotActedOnWarning, match="the one passed is used"):
        engD, _, _, _ = deepspeed.initialize(model=netD, optimizer=optD, config=config)
    engG, _, _, _ = deepspeed.initialize(model=netG, optimizer=optG, config=config)
    if stage == 3:
        real, noise = _gan_data(0, engD.global_rank)
        with pytest.raises(RuntimeError, match="another engine's backward flows through this model"):
            _gan_step(netD, netG, engD.backward, engG.backward, engD.step, engG.step, real, noise)
        engD.destroy(), engG.destroy()
        return
    # The oracle: plain torch, gradients averaged over ranks as DDP does (pre-divided, then summed),
    # clipped at DeepSpeed's default gradient_clipping of 1.0.
    ref_optD = torch.optim.Adam(refD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    ref_optG = torch.optim.Adam(refG.parameters(), lr=2e-3, betas=(0.5, 0.999))

    def averaged_backward(model):
        def backward(loss):
            before = {p: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for p in model.parameters()}
            for p in model.parameters():
                p.grad = None
            loss.backward()
            for p in model.parameters():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                grad = grad / 2
                dist.all_reduce(grad)
                p.grad = before[p] + grad

        return backward

    def clipped_step(model, optimizer):
        def step():
            grads = [p.grad for p in model.parameters()]
            norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads)).item()
            if 1.0 / (norm + 1e-6) < 1.0:
                for g in grads:
                    g.mul_(1.0 / (norm + 1e-6))
            optimizer.step()

        return step

    for step in range(4):
        real, noise = _gan_data(step, engD.global_rank)
        ours = _gan_step(netD, netG, engD.backward, engG.backward, engD.step, engG.step, real, noise)
        theirs = _gan_step(
            refD,
            refG,
            averaged_backward(refD),
            averaged_backward(refG),
            clipped_step(refD, ref_optD),
            clipped_step(refG, ref_optG),
            real,
            noise,
        )
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (step, ours, theirs)
    for ours, theirs in ((netD, refD), (netG, refG)):
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    engD.destroy(), engG.destroy()


# -- config semantics ----------------------------------------------------------------------------------------
def _config_case(stage: int, tmp: str) -> None:
    assert load_config({}, 2).gradient_clipping == 1.0  # DeepSpeed 0.19.8's GRADIENT_CLIPPING_DEFAULT
    with pytest.warns(ConfigKeyNotActedOnWarning, match="offload_param"):
        load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, 2)
    with pytest.warns(ConfigKeyNotActedOnWarning, match="bf16_optimizer_states"):  # states follow the master
        load_config(
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": False}}, 2
        )
    engine, _, _ = _engine(stage, torch_autocast={"enabled": True, "dtype": "bfloat16"})
    logits, _ = engine(*BATCHES(0, 0, engine.global_rank))
    assert logits.dtype == torch.bfloat16 and engine.torch_autocast_enabled()
    engine.destroy()
    # A directory named from each rank's own clock: the error says the ranks passed different paths.
    engine, _, _ = _engine(stage)
    _train(engine, 1)
    from zeroshard.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="ranks passed different checkpoint directories"):
        engine.save_checkpoint(f"{tmp}/run-{dist.get_rank()}")
    engine.destroy()


def _arguments_case(tmp: str) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--deepspeed_config", type=str, default="mine.json")
    args = deepspeed.add_config_arguments(parser).parse_args([])
    assert args.local_rank == -1 and args.deepspeed_config == "mine.json" and args.deepspeed is False
    # DeepSpeed's refusals (AssertionErrors there; ConfigErrors that are AssertionErrors here), each naming the values
    path = f"{tmp}/ds_config{dist.get_rank()}.json"
    with open(path, "w") as file:
        json.dump(make_config(1), file)
    local = int(os.environ["LOCAL_RANK"])

    def refused(match: str, **kwargs) -> None:
        model = nn.Linear(2, 2)
        with pytest.raises(AssertionError, match=match) as raised:
            deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        assert isinstance(raised.value, deepspeed.ConfigError)

    for name in ("config", "config_params"):
        twice = rf"args.deepspeed_config='{re.escape(path)}' .* and initialize\({name}=\{{'train_micro"
        refused(twice, args=argparse.Namespace(deepspeed_config=path), **{name: make_config(1)})
    refused(
        "deepspeed_config='a.json' and args.deepscale_config='b.json'",
        args=argparse.Namespace(deepspeed_config="a.json", deepscale_config="b.json"),
    )
    refused("got no config", args=argparse.Namespace(deepspeed_config=None, deepspeed=True, local_rank=local))
    refused("got no config")
    refused(
        f"args.local_rank={local + 1} but the LOCAL_RANK environment variable is {local}",
        args=argparse.Namespace(local_rank=local + 1),
        config=make_config(1),
    )
    refused("args.local_rank='0' is a str", args=argparse.Namespace(local_rank="0"), config=make_config(1))
    for accepted in (local, -1, None):  # agreeing, or not given (DeepSpeed's -1 default)
        model = nn.Linear(2, 2)
        args = argparse.Namespace(deepspeed_config=path, local_rank=accepted)
        engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert engine.zero_optimization_stage() == 1
        engine.destroy()


def _accelerator_case() -> None:
    from zeroshard.accelerator import get_accelerator

    acc = get_accelerator()
    acc.set_device(0)
    acc.manual_seed_all(0)
    acc.manual_seed(0)
    acc.synchronize()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    assert acc.communication_backend_name() == dist.get_backend()
    assert acc.is_bf16_supported() and acc.is_available() and acc.device_count() >= 1
    assert acc.max_memory_allocated() >= 0 and acc.memory_allocated() >= 0
    assert acc.on_accelerator(torch.zeros(1)) == (acc.device_name() == "cpu")
    assert acc.pin_memory(torch.zeros(2)).shape == (2,)
    assert torch.device(acc.device_name(), 0).type == acc.device_name()
    assert acc.current_device_name().startswith(acc.device_name())
    with acc.stream(acc.Stream()):
        pass


def _worker(rank: int, world: int, tmp: str) -> None:
    subtests([dict(stage=s) for s in (0, 2)], _paths_case)
    subtests([dict(stage=s) for s in (0, 1, 2, 3)], _optimizer_case)
    subtests([dict(stage=s, tmp=f"{tmp}/acc{s}") for s in (0, 1, 2, 3)], _accessors_case)
    subtests([dict(stage=s) for s in (0, 1, 2)], _no_sync_case)
    subtests([dict(stage=s) for s in (0, 1, 2, 3)], _torch_backward_case)
    subtests([dict(stage=s) for s in (0, 1, 2, 3)], _gan_case)
    subtests([dict(stage=s, tmp=f"{tmp}/cfg{s}") for s in (1, 3)], _config_case)
    subtests([dict(tmp=tmp)], _arguments_case)
    subtests([{}], _accelerator_case)


def test_deepspeed_surface(tmp_path):
    run_distributed(_worker, 2, timeout=600, tmp=str(tmp_path))


def test_hf_deepspeed_config_is_refused_with_the_way_out():
    """transformers' HfDeepSpeedConfig (ZeRO-3) would have from_pretrained partition the model with the
    deepspeed package; initialize says so, and what to do, before touching the process group."""
    hf = pytest.importorskip(
        "transformers.integrations.deepspeed", reason="the [hf] extra installs it; `make test` does"
    )

    class Zero3Config:  # what HfDeepSpeedConfig answers (it cannot be built without deepspeed installed)
        def is_zero3(self) -> bool:
            return True

    stand_in = Zero3Config()
    hf.set_hf_deepspeed_config(stand_in)
    try:
        with pytest.raises(
            deepspeed.ConfigError,
            match="HfDeepSpeedConfig with ZeRO-3 is active.*zeroshard.integrations.hf import.*zero.Init",
        ):
            deepspeed.initialize(model=nn.Linear(2, 2), config={"zero_optimization": {"stage": 3}})
    finally:
        hf.unset_hf_deepspeed_config()


def test_hf_deepspeed_config_stand_in_answers_like_transformers_and_leaves_it_plain(tmp_path):
    """zeroshard.integrations.hf.HfDeepSpeedConfig, the one-line replacement of transformers' own:
    the same queries on a copy of the config; transformers itself does not see ZeRO-3."""
    hf = pytest.importorskip("zeroshard.integrations.hf", reason="the [hf] extra installs it; `make test` does")
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled as transformers_zero3

    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "bf16": {"enabled": True}}
    dschf = hf.HfDeepSpeedConfig(config)
    config["zero_optimization"]["stage"] = 2  # it keeps its own copy
    assert dschf.is_zero3() and not dschf.is_zero2() and dschf.is_offload()
    assert dschf.get_value("zero_optimization.stage") == 3 and dschf.get_value("zero_optimization.x", 7) == 7
    assert dschf.get_value("fp16.enabled") is None and dschf.find_config_node("a.b.c") == (None, "c")
    assert dschf.is_true("bf16.enabled") and not dschf.is_false("bf16.enabled") and not dschf.is_false("fp16.enabled")
    assert hf.is_deepspeed_zero3_enabled() and not transformers_zero3()
    del dschf
    assert not hf.is_deepspeed_zero3_enabled()  # as transformers': alive only while referenced
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 2}}')
    from_file = hf.HfDeepSpeedConfig(path)
    assert from_file.is_zero2() and not from_file.is_offload() and not hf.is_deepspeed_zero3_enabled()


def test_module_helpers_at_deepspeeds_paths():
    """recursive_getattr / recursive_setattr where DeepSpeed 0.19.8 has them: deepspeed.utils.module_utils
    and deepspeed.compression.helper (DeepSpeed-Chat's LoRA module imports them from there)."""
    from zeroshard.compression.helper import recursive_getattr, recursive_setattr
    from zeroshard.utils import module_utils

    assert module_utils.recursive_getattr is recursive_getattr and module_utils.recursive_setattr is recursive_setattr
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.ReLU())
    assert (
        recursive_getattr(model, "0.0") is model[0][0] and recursive_getattr(model, "0.0.weight") is model[0][0].weight
    )
    replacement = nn.Identity()
    recursive_setattr(model, "0.0", replacement)
    recursive_setattr(model, "1", nn.Tanh())
    assert model[0][0] is replacement and isinstance(model[1], nn.Tanh)
    with pytest.raises(AttributeError):
        recursive_getattr(model, "0.missing")
