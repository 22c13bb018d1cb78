"""DeepSpeed-aware code on a stage-3 engine: it finds partitioned parameters by `ds_id` / `ds_status`
/ `ds_numel` / `ds_shape`, gathers them with `zero.GatheredParameters`, and saves full weights; a
partitioned parameter pickled outside a gather is an error; `state_dict()` returns it empty, as
DeepSpeed does, with a warning.

`save_zero_three_model` below is written the way DeepSpeed-Chat's utils.py writes it (iterate
named_parameters; gather those with `ds_id` whose status is NOT_AVAILABLE; copy `.data` to the CPU;
rank 0 torch.saves the dict), importing through the DeepSpeed paths. On CPU `.data.cpu()` is not a
copy: the saved tensors are views of the gathered buffer, which must keep their values after the
gather ends. The oracle: the same model trained at stage 0 (DDP's math; bit for bit at 2 ranks).
"""

from __future__ import annotations

import io
import os
import tempfile

import pytest
import torch

import zeroshard as deepspeed
from tests.checkpoint_helpers import tiny_batches
from tests.harness import run_distributed, subtests
from tests.reference import gpt_loss
from tests.zs_common import gpt_model_fn, make_config


def _z3_params_to_fetch(param_list):
    from zeroshard.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = zero_stage == 3
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
        return output_model_file
    output_state_dict = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage_3):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0 and "lora" not in k:
            output_state_dict[k] = v_p
    if global_rank == 0:
        torch.save(output_state_dict, output_model_file)
    del output_state_dict
    return output_model_file


def _engine(stage: int):
    model = gpt_model_fn(0)()
    config = make_config(stage)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config
    )
    batches = tiny_batches()
    for step in range(2):
        loss = gpt_loss(engine, *batches(step, 0, engine.global_rank))
        engine.backward(loss)
        engine.step()
    return engine


def _saves_full_weights(save_dir: str) -> None:
    reference = _engine(0)
    expected = {n: p.detach().clone() for n, p in reference.module.named_parameters()}
    reference.destroy()
    engine = _engine(3)
    path = save_zero_three_model(engine, engine.global_rank, os.path.join(save_dir, "z3"), zero_stage=3)
    torch.distributed.barrier()
    saved = torch.load(path, weights_only=True)
    assert saved.keys() == expected.keys()
    assert sum(v.numel() for v in saved.values()) == sum(v.numel() for v in expected.values())
    for name, value in expected.items():
        assert torch.equal(saved[name], value), f"'{name}' differs from the stage-0 run"
    engine.destroy()


def _metadata() -> None:
    from zeroshard.runtime.zero.partition_parameters import ZeroParamStatus

    engine = _engine(3)
    params = dict(engine.module.named_parameters())
    ids = [p.ds_id for p in params.values()]
    assert sorted(ids) == list(range(len(params)))
    for name, p in params.items():
        assert isinstance(p, torch.nn.Parameter)
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0, name
        assert p.ds_numel == p.ds_shape.numel() > 0 and "ds_id" not in vars(p), name
    weight = params["lm_head.weight"] if "lm_head.weight" in params else next(iter(params.values()))
    with deepspeed.zero.GatheredParameters([weight]):
        assert weight.ds_status is ZeroParamStatus.AVAILABLE and tuple(weight.shape) == tuple(weight.ds_shape)
        buffer = io.BytesIO()
        torch.save(weight, buffer)  # gathered: saves, and as a plain nn.Parameter
        buffer.seek(0)
        assert type(torch.load(buffer, weights_only=True)) is torch.nn.Parameter
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    total = sum(p.ds_tensor.numel() for p in params.values())
    every = engine.comm.all_gather_objects(total, "test: ds_tensor sizes")
    assert sum(every) == sum(p.ds_numel for p in params.values())
    engine.destroy()
    assert not hasattr(weight, "ds_id")


def _pickling_outside_a_gather_fails_and_state_dict_is_empty() -> None:
    from zeroshard.compat.ds_params import NotGatheredError, PartitionedStateDictWarning

    engine = _engine(3)
    name, param = next(iter(engine.module.named_parameters()))
    with pytest.raises(NotGatheredError, match=name):
        torch.save(param, io.BytesIO())
    with pytest.warns(PartitionedStateDictWarning, match="empty tensors"):
        empty = engine.module.state_dict()
    assert empty[name].numel() == 0
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        state = engine.module.state_dict()
    assert all(v.numel() > 0 for v in state.values())
    engine.destroy()


def _below_stage_3_nothing_is_exposed() -> None:
    engine = _engine(2)
    assert not any(hasattr(p, "ds_id") for p in engine.module.parameters())
    assert all(type(p) is torch.nn.Parameter for p in engine.module.parameters())
    engine.module.state_dict()
    engine.destroy()


def _worker(rank: int, world_size: int, save_dir: str):
    return subtests(
        [{"case": c} for c in ("save", "metadata", "refuse", "below")],
        lambda case: {
            "save": lambda: _saves_full_weights(save_dir),
            "metadata": _metadata,
            "refuse": _pickling_outside_a_gather_fails_and_state_dict_is_empty,
            "below": _below_stage_3_nothing_is_exposed,
        }[case](),
    )


def test_deepspeed_aware_code_at_stage_3():
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_worker, 2, timeout=240, save_dir=tmp)
