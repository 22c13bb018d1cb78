"""Writes the DeepSpeed checkpoints under tests/data/deepspeed/ with the real DeepSpeed 0.19.8.

DeepSpeed is not a dependency of zeroshard: this script runs in a separate virtual environment,
on CPU with gloo, two ranks:

    python3.11 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8
    cd tests/data/deepspeed
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/torchrun --nproc_per_node 2 make_checkpoints.py

For each case of tiny_model.CASES (ZeRO stages 1, 2, 3 x fp32, bf16, fp16, plus two optimizer param
groups with a frozen parameter at stages 2 and 3, and bf16 with fp32 gradient accumulation, which
DeepSpeed runs with its BF16_Optimizer) it trains tiny_model.TinyNet for
STEPS_BEFORE_SAVE steps with AdamW and WarmupLR, saves a checkpoint to `stage<s>_<precision>/`,
trains STEPS_AFTER_SAVE more steps and records every step's loss (the mean over the global batch)
in expected.json, which the tests compare zeroshard's resumed training with. Rank 0 also writes
`stage<s>_<precision>/zero_to_fp32.pt`: what DeepSpeed's own zero_to_fp32 makes of the checkpoint,
the reference for `zeroshard consolidate`, and `masters.pt`: the fp32 masters the running engine
held at the save (safe_get_full_fp32_param), also for the BF16_Optimizer case that zero_to_fp32
does not read.
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

import tiny_model as tm

HERE = os.path.dirname(os.path.abspath(__file__))


def global_loss(loss: torch.Tensor, world_size: int) -> float:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total / world_size)


def run_case(name: str, rank: int, world_size: int) -> dict:
    stage, precision, variant = tm.CASES[name]
    dtype = tm.DTYPES[precision]
    model = tm.build_model(variant)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=tm.model_parameters(model, variant),
        config=tm.config(stage, precision, world_size, variant),
    )
    losses = []
    for step in range(tm.STEPS_BEFORE_SAVE + tm.STEPS_AFTER_SAVE):
        if step == tm.STEPS_BEFORE_SAVE:
            engine.save_checkpoint(os.path.join(HERE, name))
            masters = live_masters(engine)
        x, y = tm.batch(step, rank, world_size, dtype)
        loss = tm.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(global_loss(loss, world_size))
    record = {
        "losses": losses,
        "loss_scale": float(engine.optimizer.loss_scale) if precision == "fp16" else None,
        "lr": engine.get_lr(),
        "skipped_steps": engine.skipped_steps,
    }
    engine.destroy()
    return record, masters


def live_masters(engine) -> dict:
    """The full fp32 master of every parameter as the running engine holds it (DeepSpeed's
    safe_get_full_fp32_param; frozen parameters as they are), and the buffers in fp32."""
    out = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is None:  # frozen: no master; at stage 3 gather it
            with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                full = param.detach().float()
        out[name] = full.detach().cpu().clone()
    for name, buffer in engine.module.named_buffers():
        out[name] = buffer.detach().float().cpu().clone()
    return out


def allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator declares fp16 supported only where oneDNN has fp16 kernels (this
    machine's CPU has none); torch's own CPU kernels train in fp16 fine, which is all these tiny
    checkpoints need. Only this data-generating script changes that declaration."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    type(accelerator).is_fp16_supported = lambda self: True


def main() -> None:
    allow_fp16_on_cpu()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "world_size": world_size,
        "steps_before_save": tm.STEPS_BEFORE_SAVE,
        "cases": {},
    }
    for name in tm.CASES:
        expected["cases"][name], masters = run_case(name, rank, world_size)
        dist.barrier()
        if rank == 0:
            directory = os.path.join(HERE, name)
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies of its own scripts
                os.remove(os.path.join(directory, script))
            torch.save(masters, os.path.join(directory, "masters.pt"))
            if tm.CASES[name][2] != "fp32grads":  # zero_to_fp32 refuses BF16_Optimizer checkpoints
                full = get_fp32_state_dict_from_zero_checkpoint(directory, tag=f"global_step{tm.STEPS_BEFORE_SAVE}")
                torch.save(
                    {k: v.contiguous().clone() for k, v in full.items()}, os.path.join(directory, "zero_to_fp32.pt")
                )
        dist.barrier()
    if rank == 0:
        with open(os.path.join(HERE, "expected.json"), "w") as file:
            json.dump(expected, file, indent=1)
            file.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
