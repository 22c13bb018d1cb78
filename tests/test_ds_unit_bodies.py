"""Bodies written the way DeepSpeed's own unit tests are written (tests/unit/: `SimpleModel`,
`random_dataloader(model=..., device=model.device)`, `deepspeed.comm`, the safe_get/set tensor-fragment
API, checkpoint round trips, client optimizers and schedulers), run with `import zeroshard as
deepspeed` at 2 gloo ranks and ZeRO stages 0-3. The helpers are our own small versions of theirs."""

from __future__ import annotations

import pytest
import torch

import zeroshard as deepspeed
import zeroshard.comm as dist
from tests.harness import run_distributed, subtests
from zeroshard.accelerator import get_accelerator
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


def _client_optimizer(stage: int) -> None:
    """TestClientOptimizer / TestConfigOptimizer: a client optimizer, a callable, or the config's."""
    for kind in ("instance", "callable", "config"):
        model = SimpleModel(HIDDEN)
        config = {"train_batch_size": 2 * dist.get_world_size(), "zero_optimization": {"stage": stage}}
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
        if kind == "instance":
            assert ds_optimizer.optimizer is client and ds_optimizer.param_groups is client.param_groups
        elif kind == "callable":
            assert isinstance(ds_optimizer.optimizer, torch.optim.AdamW)
        state = ds_optimizer.state_dict()
        assert set(state) == {"state", "param_groups"}
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
    subtests([dict(stage=s) for s in (0, 2, 3)], _client_optimizer)
    subtests([dict(stage=s) for s in (0, 3)], _lr_schedule_and_accelerator)


def test_deepspeed_unit_test_bodies(tmp_path):
    run_distributed(_worker, 2, timeout=600, tmp=str(tmp_path))
