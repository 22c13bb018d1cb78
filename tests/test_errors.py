"""Issue 2, item 7: bad input is an error that names the key, the value and what is allowed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from tests.harness import run_distributed, subtests
from tests.zs_common import gpt_model_fn, make_config


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
        _expect(zeroshard.ConfigError, "zero_optimization.stgae", "stage",
                config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stgae": 3}})
    elif name == "stage 4":
        _expect(zeroshard.ConfigError, "zero_optimization.stage", "4", "0, 1, 2", config=make_config(4))
    elif name == "negative size":
        _expect(zeroshard.ConfigError, "reduce_bucket_size", "-5", config=make_config(2, reduce_bucket_size=-5))
    elif name == "batch sizes":
        config = dict(make_config(1, micro=4, gas=2), train_batch_size=32)
        _expect(zeroshard.ConfigError, "train_batch_size=32", "=4", "=2", "world_size=2", config=config)
    elif name == "no parameters":
        _expect(ValueError, "no parameters", model=nn.ReLU(),
                optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    elif name == "unshardable optimizer":
        model = gpt_model_fn()()
        _expect(ValueError, "LBFGS", model=model, optimizer=torch.optim.LBFGS(model.parameters()))
    elif name == "optimizer twice":
        config = dict(make_config(1), optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
        _expect(zeroshard.ConfigError, "exactly one", config=config)


def _misuse_case(name: str, stage: int) -> None:
    engine, *_ = _initialize(config=make_config(stage))
    tokens = torch.randint(0, 64, (2, 9))
    if name == "step before backward":
        with pytest.raises(RuntimeError, match=r"step\(\) called before engine.backward\(\)"):
            engine.step()
    elif name == "loss.backward()":
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        with pytest.raises(RuntimeError, match=r"call engine.backward\(loss\)"):
            loss.backward()
    elif name == "non-scalar loss":
        logits, _ = engine(tokens[:, :-1], tokens[:, 1:])
        with pytest.raises(ValueError, match="scalar loss"):
            engine.backward(logits)
    engine.destroy()


def _worker(rank: int, world: int) -> None:
    names = ["typo", "stage 4", "negative size", "batch sizes", "no parameters", "unshardable optimizer",
             "optimizer twice"]
    subtests([dict(name=n) for n in names], _bad_config_case)
    misuse = ["step before backward", "loss.backward()", "non-scalar loss"]
    subtests([dict(name=n, stage=s) for n in misuse for s in (0, 3)], _misuse_case)


def test_bad_input_is_named():
    run_distributed(_worker, 2, timeout=300)
