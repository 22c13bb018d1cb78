"""Bodies written the way DeepSpeed's own unit tests are written (tests/unit/: `SimpleModel`,
`random_dataloader(model=..., device=model.device)`, `deepspeed.comm`, the safe_get/set tensor-fragment
API, checkpoint round trips, client optimizers and schedulers, an engine without an optimizer), run
with `import zeroshard as deepspeed` at 2 gloo ranks and ZeRO stages 0-3. The helpers are our own
small versions of theirs. What `initialize` returns and refuses is what DeepSpeed 0.19.8 returns and
refuses, run side by side on CPU; where zeroshard differs on purpose the assertion says so
(docs/deepspeed_surface.md)."""

from __future__ import annotations

import pytest
import torch

import zeroshard as deepspeed
import zeroshard.comm as dist
from tests.harness import run_distributed, subtests
from zeroshard.accelerator import get_accelerator
from zeroshard.runtime.lr_schedules import CYCLE_MAX_LR, CYCLE_MIN_LR, ONE_CYCLE, OneCycle, WarmupLR
from zeroshard.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
)

HIDDEN = 8


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim, nlayers=1):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return self.cross_entropy_loss(x, y)


class FrozenModel(torch.nn.Module):
    def __init__(self, hidden_dim):
        super().__init__()
        self.linears = torch.nn.ModuleList(
            [torch.nn.Linear(hidden_dim, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, hidden_dim)]
        )
        self.linears[0].weight.requires_grad = False
        self.linears[0].bias.requires_grad = False
        self.cel = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.linears:
            x = torch.relu(layer(x))
        return self.cel(x, y)


def random_dataloader(model, total_samples, hidden_dim, device, dtype=torch.float32):
    generator = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randn(total_samples, hidden_dim, generator=generator).to(device, dtype)
    labels = torch.randint(0, hidden_dim, (total_samples,), generator=generator).to(device)
    dataset = torch.utils.data.TensorDataset(data, labels)
    return torch.utils.data.DataLoader(dataset, batch_size=model.train_micro_batch_size_per_gpu())


def config_dict(stage, **extra):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def validate_tensor(model, api_type: str, opt_states: bool) -> None:
    for _, lp in model.named_parameters():
        if opt_states:
            values = [
                safe_get_full_optimizer_state(lp, "exp_avg")
                if api_type == "full"
                else safe_get_local_optimizer_state(lp, "exp_avg"),
                safe_get_full_optimizer_state(lp, "exp_avg_sq")
                if api_type == "full"
                else safe_get_local_optimizer_state(lp, "exp_avg_sq"),
            ]
        else:
            values = [
                safe_get_full_fp32_param(lp) if api_type == "full" else safe_get_local_fp32_param(lp),
                safe_get_full_grad(lp) if api_type == "full" else safe_get_local_grad(lp),
            ]
        if lp.requires_grad:
            assert all(v is not None for v in values)
        else:
            assert all(v is None for v in values)


def _zero_fragments(stage: int, api_type: str) -> None:
    """DeepSpeed's TestTensorFragmentGet body: after backward the masters and grads exist, after the
    step the optimizer states; frozen parameters have none."""
    model = FrozenModel(HIDDEN)
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config_dict(stage))
    data_loader = random_dataloader(model=model, total_samples=10, hidden_dim=HIDDEN, device=model.device)
    dist.barrier()
    for batch in data_loader:
        loss = model(batch[0], batch[1])
        model.backward(loss)
        validate_tensor(model, api_type, opt_states=False)
        model.step()
        validate_tensor(model, api_type, opt_states=True)
    model.destroy()


def _set_fragments(stage: int) -> None:
    """DeepSpeed's TestTensorFragmentUpdate body: set full values, read them back."""
    model = SimpleModel(HIDDEN, nlayers=2)
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config_dict(stage))
    data_loader = random_dataloader(model=model, total_samples=4, hidden_dim=HIDDEN, device=model.device)
    for n, batch in enumerate(data_loader):
        loss = model(batch[0], batch[1])
        model.backward(loss)
        for _, lp in model.named_parameters():
            grad = torch.full_like(safe_get_full_fp32_param(lp), float(n + 1))  # stage 3: lp itself is empty
            safe_set_full_grad(lp, grad)
            torch.testing.assert_close(safe_get_full_grad(lp), grad)
        model.step()
        for _, lp in model.named_parameters():
            value = torch.full_like(safe_get_full_fp32_param(lp), 0.5 * (n + 1))
            safe_set_full_fp32_param(lp, value)
            torch.testing.assert_close(safe_get_full_fp32_param(lp), value)
            safe_set_full_optimizer_state(lp, value, "exp_avg")
            torch.testing.assert_close(safe_get_full_optimizer_state(lp, "exp_avg"), value)
    model.destroy()


def _checkpoint_correctness(stage: int, tmp: str) -> None:
    """checkpoint_correctness_verification: save, load into a fresh engine, compare every fp32 master
    and optimizer state, then both train on alike."""

    def build():
        torch.manual_seed(0)
        model = SimpleModel(HIDDEN, nlayers=2)
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=config_dict(stage, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}}),
        )
        return engine

    trained = build()
    data_loader = random_dataloader(model=trained, total_samples=8, hidden_dim=HIDDEN, device=trained.device)
    for batch in data_loader:
        trained.backward(trained(batch[0], batch[1]))
        trained.step()
    trained.save_checkpoint(tmp, client_state={"seen": 4})
    loaded = build()
    _, client_state = loaded.load_checkpoint(tmp)
    assert client_state["seen"] == 4 and loaded.global_steps == trained.global_steps
    assert loaded.get_lr() == trained.get_lr()
    for (_, p0), (_, p1) in zip(trained.named_parameters(), loaded.named_parameters()):
        torch.testing.assert_close(safe_get_full_fp32_param(p0), safe_get_full_fp32_param(p1), rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                safe_get_full_optimizer_state(p0, key), safe_get_full_optimizer_state(p1, key), rtol=0, atol=0
            )
    for batch in data_loader:
        losses = []
        for engine in (trained, loaded):
            loss = engine(batch[0], batch[1])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    trained.destroy(), loaded.destroy()


def _client_optimizer(stage: int, precision: str) -> None:
    """TestClientOptimizer / TestConfigOptimizer, at each stage and precision: what initialize returns
    is what DeepSpeed 0.19.8 returns (checked side by side, CPU): at stage 0 in fp32 the basic
    optimizer itself (the client's own object, the AdamW a callable built, the one built from the
    config); otherwise a wrapper whose `.optimizer` is it, sharing its param_groups. A torch
    Optimizer either way."""
    for kind in ("instance", "callable", "config"):
        model = SimpleModel(HIDDEN)
        config = {"train_batch_size": 2 * dist.get_world_size(), "zero_optimization": {"stage": stage}}
        if precision != "fp32":
            config[precision] = {"enabled": True}
        if kind == "instance":
            client = torch.optim.Adam(model.parameters())
        elif kind == "callable":
            client = lambda params: torch.optim.AdamW(params=params)  # noqa: E731
        else:
            client, config["optimizer"] = None, {"type": "Adam"}
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            config=config, model=model, model_parameters=list(model.parameters()), optimizer=client
        )
        assert isinstance(ds_optimizer, torch.optim.Optimizer)
        basic = engine.basic_optimizer
        assert basic is client if kind == "instance" else isinstance(basic, torch.optim.AdamW)
        if stage == 0 and precision == "fp32":  # DeepSpeed's own assertions
            assert ds_optimizer is basic
            if kind == "instance":
                assert ds_optimizer == client
        else:
            assert ds_optimizer is engine.optimizer and ds_optimizer.optimizer is basic
            assert ds_optimizer.param_groups is basic.param_groups
        assert set(ds_optimizer.state_dict()) == {"state", "param_groups"}
        engine.destroy()
    model = SimpleModel(HIDDEN)  # TestConfigOptimizer(client_parameters=False): the module's parameters
    config = {"train_batch_size": 2 * dist.get_world_size(), "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}
    engine, ds_optimizer, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=None)
    # DeepSpeed builds FusedAdam here; zeroshard torch's AdamW, the same update (docs/deepspeed_surface.md)
    assert isinstance(ds_optimizer, torch.optim.AdamW) and engine.get_lr() == [0.001]
    engine.destroy()


def _train_with(engine, optimizer, batches, drop: int | None = None, direct_step: bool = False) -> list[float]:
    """Steps over `batches`; at step `drop` a micro-batch's backward is discarded by
    `optimizer.zero_grad()` first; `direct_step`: `optimizer.step()` instead of `engine.step()`."""
    losses = []
    for n, (x, y) in enumerate(batches):
        if n == drop:
            engine.backward(engine(x * 3.0, y))
            optimizer.zero_grad()
        loss = engine(x, y)
        engine.backward(loss)
        optimizer.step() if direct_step else engine.step()
        losses.append(loss.item())
    return losses


def _returned_optimizer_in_use(stage: int, tmp: str) -> None:
    """What scripts do with the optimizer initialize returned (the client's own object at stage 0,
    zeroshard's wrapper at stage 1) gives what the engine's own calls give: zero_grad() discards a
    micro-batch, step() steps, a learning rate set in param_groups is used, state_dict() loads into a
    fresh engine (with a parameter that is never stepped), and a checkpoint round trip trains on alike."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [
        (torch.randn(2, HIDDEN, generator=generator), torch.randint(0, HIDDEN, (2,), generator=generator))
        for _ in range(8)
    ]

    def build():
        torch.manual_seed(0)
        model = SimpleModel(HIDDEN, nlayers=2)
        # never used, so never stepped: its Adam step count differs from the rest of its flat group
        model.spare = torch.nn.Linear(HIDDEN, 1)
        client = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
        assert (optimizer is client) == (stage == 0)
        return engine, optimizer

    def weights(engine):
        return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]

    straight, opt = build()
    expected = _train_with(straight, opt, batches)
    for kwargs in (dict(drop=1), dict(direct_step=True)):
        engine, optimizer = build()
        assert _train_with(engine, optimizer, batches, **kwargs) == expected, kwargs
        torch.testing.assert_close(weights(engine), weights(straight), rtol=0, atol=0)
        engine.destroy()
    # a fresh engine given the state dict trains on as the straight one does
    resumed, optimizer = build()
    for p, q in zip(resumed.module.parameters(), straight.module.parameters()):
        safe_set_full_fp32_param(p, safe_get_full_fp32_param(q))
    optimizer.load_state_dict(opt.state_dict())
    assert _train_with(resumed, optimizer, batches[:2]) == _train_with(straight, opt, batches[:2])
    # the learning rate a script sets is the one the step uses, and what the engine reports
    for group in optimizer.param_groups + opt.param_groups:
        group["lr"] = 0.0
    before = weights(resumed)
    assert _train_with(resumed, optimizer, batches[:1]) == _train_with(straight, opt, batches[:1])
    torch.testing.assert_close(weights(resumed), before, rtol=0, atol=0)
    assert resumed.get_lr() == [0.0]
    resumed.save_checkpoint(tmp)
    loaded, optimizer = build()
    loaded.load_checkpoint(tmp)
    assert optimizer.param_groups[0]["lr"] == 0.0
    for group in optimizer.param_groups + opt.param_groups:
        group["lr"] = 1e-2
    assert _train_with(loaded, optimizer, batches[2:4]) == _train_with(straight, opt, batches[2:4])
    torch.testing.assert_close(weights(loaded), weights(straight), rtol=0, atol=0)
    for engine in (straight, resumed, loaded):
        engine.destroy()


def _no_optimizer(stage: int) -> None:
    """TestNoOptim: no optimizer and no 'optimizer' section. Stages 0 and 3 give an engine that runs
    forwards (ZeRO-Inference at stage 3) and has DeepSpeed's accessors, `device` among them; stages
    1 and 2 refuse, as DeepSpeed asserts."""
    ds_config = {
        "train_batch_size": dist.get_world_size(),
        "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}},
        "bf16": {"enabled": True},
    }
    with deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=ds_config):
        model = SimpleModel(HIDDEN, nlayers=6)
    if stage in (1, 2):
        with pytest.raises(AssertionError, match=f"without an optimizer at ZeRO stage {stage}"):
            deepspeed.initialize(model=model, config=ds_config)
        return
    model, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config)
    assert optimizer is None and scheduler is None and model.basic_optimizer is None
    data_loader = random_dataloader(model, 6, HIDDEN, device=model.device, dtype=torch.bfloat16)
    for batch in data_loader:
        model(batch[0], batch[1])
    assert model.device == torch.device(get_accelerator().device_name()) and model.dp_world_size == 2
    assert model.zero_optimization_stage() == stage and model.zero_optimization() == (stage > 0)
    assert model.bfloat16_enabled() and not model.fp16_enabled() and model.gradient_accumulation_steps() == 1
    assert model.train_batch_size() == 2 and model.train_micro_batch_size_per_gpu() == 1
    assert model.get_lr() == [] and model.get_global_grad_norm() is None and model.skipped_steps == 0
    assert model.global_steps == model.micro_steps == model.global_samples == 0
    assert model.is_gradient_accumulation_boundary() and not model.was_step_applied()
    assert model.get_loss_scale() == 1.0 and model.communication_data_type() == torch.bfloat16
    model.destroy()


def _client_lr_scheduler(scheduler_type: str, optimizer_type: str) -> None:
    """TestClientLrScheduler: a scheduler from the config, a scheduler object, or a callable, with
    each kind of optimizer; a scheduler object with no optimizer object to drive is refused."""
    model = SimpleModel(HIDDEN)
    config_dict = {"train_batch_size": dist.get_world_size()}
    client_optimizer = None
    if optimizer_type == "none":
        config_dict["optimizer"] = {"type": "Adam"}
    elif optimizer_type == "object":
        client_optimizer = torch.optim.Adam(model.parameters())
    else:
        client_optimizer = lambda params: torch.optim.AdamW(params=params)  # noqa: E731
    client_scheduler = None
    if scheduler_type == "none":
        config_dict["scheduler"] = {"type": "WarmupLR", "params": {}}
    elif scheduler_type == "object":
        over = client_optimizer if isinstance(client_optimizer, torch.optim.Optimizer) else None
        client_scheduler = torch.optim.lr_scheduler.LambdaLR(
            over or torch.optim.Adam(model.parameters()), lambda epoch: epoch // 10
        )
    else:
        client_scheduler = lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: e // 10)  # noqa: E731
    kwargs = dict(model_parameters=list(model.parameters()), optimizer=client_optimizer, lr_scheduler=client_scheduler)
    if scheduler_type == "object" and optimizer_type != "object":
        with pytest.raises(AssertionError, match="not the optimizer the engine steps"):
            deepspeed.initialize(config=config_dict, model=model, **kwargs)
        return
    engine, _, _, ds_lr_scheduler = deepspeed.initialize(config=config_dict, model=model, **kwargs)
    if scheduler_type == "none":
        assert isinstance(ds_lr_scheduler, WarmupLR)
    elif scheduler_type == "object":
        assert ds_lr_scheduler == client_scheduler
    else:
        assert isinstance(ds_lr_scheduler, torch.optim.lr_scheduler.LambdaLR)
        assert ds_lr_scheduler.optimizer is engine.basic_optimizer
    engine.destroy()


def _config_onecycle_or_client_scheduler(scheduler_type: str) -> None:
    """test_diff_lrscheler_and_callable_onecyclelr_steplr: the config's OneCycle, unless a scheduler
    object or callable is passed, which then wins."""
    config_dict = {"train_batch_size": dist.get_world_size()}
    model = SimpleModel(HIDDEN)
    client_optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if scheduler_type == "none":
        config_dict["scheduler"] = {"type": ONE_CYCLE, "params": {CYCLE_MIN_LR: 0, CYCLE_MAX_LR: 0.1}}
        client_scheduler = None
    elif scheduler_type == "object":
        client_scheduler = torch.optim.lr_scheduler.StepLR(client_optimizer, step_size=30)
    else:
        client_scheduler = lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(  # noqa: E731
            optimizer, max_lr=0.01, total_steps=200
        )
    engine, _, _, ds_lr_scheduler = deepspeed.initialize(
        config=config_dict,
        model=model,
        model_parameters=list(model.parameters()),
        optimizer=client_optimizer,
        lr_scheduler=client_scheduler,
    )
    expected = {"none": OneCycle, "object": torch.optim.lr_scheduler.StepLR}
    assert isinstance(ds_lr_scheduler, expected.get(scheduler_type, torch.optim.lr_scheduler.OneCycleLR))
    engine.destroy()


def _lr_schedule_and_accelerator(stage: int) -> None:
    """test_lr_schedulers-style: the config's WarmupLR, read through get_lr(), on get_accelerator()'s device."""
    model = SimpleModel(HIDDEN)
    config = config_dict(
        stage,
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
    )
    model, _, _, lr_scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert model.device.type == get_accelerator().device_name()
    lrs = []
    for batch in random_dataloader(model=model, total_samples=10, hidden_dim=HIDDEN, device=model.device):
        model.backward(model(batch[0], batch[1]))
        model.step()
        lrs.append(model.get_lr()[0])
    assert lrs[-1] == pytest.approx(1e-2) and lrs[0] < lrs[-1] and lrs[-1] == lr_scheduler.get_lr()[0]
    total = torch.tensor([1.0], device=model.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    assert total.item() == dist.get_world_size()
    model.destroy()


def _worker(rank: int, world: int, tmp: str) -> None:
    subtests([dict(stage=s, api_type=a) for s in (1, 2, 3) for a in ("full", "local")], _zero_fragments)
    subtests([dict(stage=s) for s in (0, 1, 2, 3)], _set_fragments)
    subtests([dict(stage=s, tmp=f"{tmp}/ckpt{s}") for s in (0, 1, 2, 3)], _checkpoint_correctness)
    precisions = [(0, "fp32"), (0, "bf16"), (0, "fp16"), (1, "fp32"), (2, "bf16"), (3, "fp32")]
    subtests([dict(stage=s, precision=p) for s, p in precisions], _client_optimizer)
    subtests([dict(stage=s, tmp=f"{tmp}/use{s}") for s in (0, 1)], _returned_optimizer_in_use)
    subtests([dict(stage=s) for s in (0, 1, 2, 3)], _no_optimizer)
    kinds = ("none", "object", "callable")
    subtests([dict(scheduler_type=s, optimizer_type=o) for s in kinds for o in kinds], _client_lr_scheduler)
    subtests([dict(scheduler_type=s) for s in kinds], _config_onecycle_or_client_scheduler)
    subtests([dict(stage=s) for s in (0, 3)], _lr_schedule_and_accelerator)


@pytest.mark.slow
def test_deepspeed_unit_test_bodies(tmp_path):
    run_distributed(_worker, 2, timeout=600, tmp=str(tmp_path))
