"""Bad input is an error that names the key, the value and what is allowed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from tests.harness import run_distributed, subtests
from tests.zs_common import gpt_model_fn, make_config
from zeroshard.config import ConfigKeyNotActedOnWarning


def _initialize(config=None, model=None, optimizer=None):
    model = model if model is not None else gpt_model_fn()()
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if list(model.parameters()) else None
    return zeroshard.initialize(model=model, optimizer=optimizer, config=config or make_config(3))


def _expect(error, *needles, **kwargs):
    with pytest.raises(error) as info:
        _initialize(**kwargs)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def _bad_config_case(name: str) -> None:
    if name == "typo":
        _expect(
            zeroshard.ConfigError,
            "zero_optimization.stgae",
            "stage",
            config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stgae": 3}},
        )
    elif name == "stage 4":
        _expect(zeroshard.ConfigError, "zero_optimization.stage", "4", "0, 1, 2", config=make_config(4))
    elif name == "negative size":
        _expect(zeroshard.ConfigError, "reduce_bucket_size", "-5", config=make_config(2, reduce_bucket_size=-5))
    elif name == "batch sizes":
        config = dict(make_config(1, micro=4, gas=2), train_batch_size=32)
        _expect(zeroshard.ConfigError, "train_batch_size=32", "=4", "=2", "world_size=2", config=config)
    elif name == "no parameters":
        _expect(
            ValueError,
            "no parameters",
            model=nn.ReLU(),
            optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
        )
    elif name == "unshardable optimizer":
        model = gpt_model_fn()()
        _expect(ValueError, "LBFGS", model=model, optimizer=torch.optim.LBFGS(model.parameters()))
    elif name == "optimizer twice":  # DeepSpeed uses the client optimizer and ignores the section: a warning
        config = dict(make_config(1), optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
        model = gpt_model_fn()()
        with pytest.warns(ConfigKeyNotActedOnWarning, match="the one passed is used"):
            engine, optimizer, _, _ = _initialize(
                config=config, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
            )
        assert isinstance(optimizer.optimizer, torch.optim.SGD)
        engine.destroy()


def _misuse_case(name: str, stage: int) -> None:
    engine, *_ = _initialize(config=make_config(stage))
    tokens = torch.randint(0, 64, (2, 9))
    if name == "step before backward":
        with pytest.raises(RuntimeError, match=r"step\(\) called before engine.backward\(\)"):
            engine.step()
    elif name == "loss.backward()":  # on a loss the model computed outside engine(...)
        _, loss = engine.module(tokens[:, :-1], tokens[:, 1:])
        if stage == 3:  # the units' parameters are gathered only inside the engine's forward and backward
            with pytest.raises(RuntimeError, match=r"not computed through the sharded model"):
                loss.backward()
        else:  # the gradients stay in .grad, as in torch; step() says what happened
            loss.backward()
            with pytest.raises(
                RuntimeError, match=r"computed by calling the model itself stay in the parameters' .grad"
            ):
                engine.step()
    elif name == "non-scalar loss":
        logits, _ = engine(tokens[:, :-1], tokens[:, 1:])
        with pytest.raises(ValueError, match="scalar loss"):
            engine.backward(logits)
    engine.destroy()


def _worker(rank: int, world: int) -> None:
    names = [
        "typo",
        "stage 4",
        "negative size",
        "batch sizes",
        "no parameters",
        "unshardable optimizer",
        "optimizer twice",
    ]
    subtests([dict(name=n) for n in names], _bad_config_case)
    misuse = ["step before backward", "loss.backward()", "non-scalar loss"]
    subtests([dict(name=n, stage=s) for n in misuse for s in (0, 3)], _misuse_case)


def test_bad_input_is_named():
    run_distributed(_worker, 2, timeout=300)
