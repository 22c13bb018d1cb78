"""Optimizer factory (DeepSpeed's Adam/AdamW/SGD semantics) and the check that an optimizer can be sharded."""

import pytest
import torch

from zeroshard.compat.optimizers import (
    ELEMENTWISE_OPTIMIZERS,
    OptimizerNotShardableError,
    build_optimizer,
    check_shardable,
)
from zeroshard.config import load_config


def _params(n=2):
    return [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(n)]


def _build(optimizer_section, params=None):
    cfg = load_config({"optimizer": optimizer_section}, 1)
    return build_optimizer(cfg.optimizer, params if params is not None else _params())


def _hyper(opt):
    group = opt.param_groups[0]
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad") if k in group}


# --- build_optimizer ------------------------------------------------------------------------------


def test_deepspeed_adam_is_adamw_with_fusedadam_defaults():
    opt = _build({"type": "Adam"})
    assert type(opt) is torch.optim.AdamW
    assert _hyper(opt) == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}


def test_adam_w_mode_false_is_adam_with_l2():
    opt = _build({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1, "lr": 0.01}})
    assert type(opt) is torch.optim.Adam and _hyper(opt)["weight_decay"] == 0.1


def test_adamw_type_ignores_adam_w_mode():
    assert type(_build({"type": "AdamW", "params": {"adam_w_mode": False}})) is torch.optim.AdamW


def test_torch_adam_keeps_torch_default_weight_decay():
    # DeepSpeed passes only the given params to torch.optim.AdamW/Adam when torch_adam is true.
    assert _hyper(_build({"type": "AdamW", "params": {"torch_adam": True}}))["weight_decay"] == 0.01
    assert _hyper(_build({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}))["weight_decay"] == 0
    assert _hyper(_build({"type": "AdamW", "params": {"torch_adam": True, "weight_decay": 0.0}}))["weight_decay"] == 0


def test_adam_params_pass_through():
    opt = _build(
        {
            "type": "adamw",
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True},
        }
    )
    assert _hyper(opt) == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True}


def test_sgd():
    opt = _build({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}})
    group = opt.param_groups[0]
    assert type(opt) is torch.optim.SGD
    assert (group["lr"], group["momentum"], group["dampening"], group["weight_decay"], group["nesterov"]) == (
        0.1,
        0.9,
        0.0,
        1e-4,
        True,
    )


def test_param_group_dicts():
    a, b = _params()
    opt = _build(
        {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        [{"params": [a]}, {"params": [b], "weight_decay": 0.0, "lr": 0.5}],
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.5]


def test_built_adam_matches_hand_written_adamw_update():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    p0 = p.detach().clone()
    p.grad = torch.randn(4)
    opt = _build({"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.5}}, [p])
    opt.step()
    # First Adam step: m_hat = g, v_hat = g^2, update = g / (|g| + eps); decoupled decay p *= 1 - lr*wd.
    g = p.grad
    expected = p0 * (1 - 0.1 * 0.5) - 0.1 * g / (g.abs() + 1e-8)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


# --- check_shardable ------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS)
def test_elementwise_optimizers_are_shardable(cls):
    check_shardable(cls(_params(), lr=0.01))


def test_subclass_of_an_elementwise_optimizer_is_shardable():
    class MyAdamW(torch.optim.AdamW):
        pass

    check_shardable(MyAdamW(_params()))


def _not_elementwise():
    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    sparse = torch.optim.SparseAdam([torch.nn.Parameter(torch.randn(3))])
    return [torch.optim.LBFGS(_params()), sparse, torch.optim.Adafactor(_params()), Custom(_params())]


@pytest.mark.parametrize("optimizer", _not_elementwise(), ids=lambda o: type(o).__name__)
def test_other_optimizers_are_rejected_by_name(optimizer):
    with pytest.raises(OptimizerNotShardableError) as info:
        check_shardable(optimizer)
    message = str(info.value)
    assert message.startswith(f"{type(optimizer).__name__} cannot be sharded")
    assert "Supported: SGD, Adam, AdamW, Adamax, Adagrad, Adadelta, RMSprop, NAdam, RAdam, Rprop, ASGD" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "cls, kwargs", [(torch.optim.AdamW, {}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adagrad, {})]
)
def test_optimizer_with_state_is_rejected(cls, kwargs):
    params = _params()
    opt = cls(params, **kwargs)
    check_shardable(opt)  # Adagrad creates (unstepped) state in __init__: still fine
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(OptimizerNotShardableError, match="build the engine before the first optimizer step"):
        check_shardable(opt)
