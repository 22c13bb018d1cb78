"""Writes the DeepSpeed checkpoints of a model with frozen parameters under tests/data/deepspeed/
with the real DeepSpeed 0.19.8 (the sibling of make_checkpoints.py; the same virtual environment):

    cd tests/data/deepspeed
    DS_ACCELERATOR=cpu LOCAL_SIZE=2 /tmp/dsvenv/bin/torchrun --nproc_per_node 2 make_frozen_checkpoints.py

The model is tiny_model.AdapterNet, a LoRA-style fine-tune: a frozen embedding, a frozen linear
layer with a trainable low-rank adapter, a frozen norm bias, the rest trainable
(tiny_model.FROZEN_ADAPTER). For each case of tiny_model.FROZEN_CASES (ZeRO stages 1, 2, 3, fp32)
it trains STEPS_BEFORE_SAVE steps with AdamW (only the trainable parameters passed to it, as a LoRA
script does) and WarmupLR, saves a checkpoint to `stage<s>_fp32_frozen/`, trains STEPS_AFTER_SAVE
more steps and records every step's loss (the mean over the global batch) in expected_frozen.json.
DeepSpeed keeps the frozen parameters in a different place at each stage (the module state dict
alone at stage 1, `frozen_param_fragments` too at stages 2 and 3), which is what these fixtures are
for. Rank 0 also writes `stage<s>_fp32_frozen/reference.pt`, what the running engine held:
  * `saved`: every parameter's full fp32 value at the save (safe_get_full_fp32_param for trainable
    ones, the gathered parameter for frozen ones);
  * `exp_avg`, `exp_avg_sq`: Adam's moments of every trainable parameter at the save
    (safe_get_full_optimizer_state);
  * `final`: every parameter's full fp32 value after the STEPS_AFTER_SAVE steps.
The stage-1 run also saves its checkpoint with `exclude_frozen_parameters=True` to
`stage1_fp32_frozen_excluded/` (no reference of its own: the same run), a checkpoint that holds no
frozen parameter at all. DeepSpeed's zero_to_fp32 output is not recorded: at stage 1 it leaves
frozen parameters out.
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from make_checkpoints import global_loss

import tiny_model as tm

HERE = os.path.dirname(os.path.abspath(__file__))


def full_params(engine) -> dict:
    """Every parameter's full fp32 value as the running engine holds it (collective)."""
    out = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            out[name] = safe_get_full_fp32_param(param).detach().cpu().clone()
            continue
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            out[name] = param.detach().float().cpu().clone()
    return out


def moments(engine) -> dict:
    out = {"exp_avg": {}, "exp_avg_sq": {}}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            for key in out:
                out[key][name] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    return out


def run_case(name: str, rank: int, world_size: int) -> tuple[list[float], dict]:
    stage = tm.FROZEN_CASES[name]
    model = tm.build_adapter_model()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=tm.config(stage, "fp32", world_size),
    )
    losses, reference = [], {}
    for step in range(tm.STEPS_BEFORE_SAVE + tm.STEPS_AFTER_SAVE):
        if step == tm.STEPS_BEFORE_SAVE:
            engine.save_checkpoint(os.path.join(HERE, name))
            if stage == 1:
                engine.save_checkpoint(os.path.join(HERE, tm.FROZEN_EXCLUDED), exclude_frozen_parameters=True)
            reference = {"saved": full_params(engine), **moments(engine)}
        tokens, y = tm.token_batch(step, rank, world_size)
        loss = tm.loss_fn(engine(tokens), y)
        engine.backward(loss)
        engine.step()
        losses.append(global_loss(loss, world_size))
    reference["final"] = full_params(engine)
    engine.destroy()
    return losses, reference


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "world_size": world_size,
        "steps_before_save": tm.STEPS_BEFORE_SAVE,
        "losses": {},
    }
    for name in tm.FROZEN_CASES:
        expected["losses"][name], reference = run_case(name, rank, world_size)
        dist.barrier()
        if rank == 0:
            written = [name, tm.FROZEN_EXCLUDED] if tm.FROZEN_CASES[name] == 1 else [name]
            for directory in (os.path.join(HERE, n) for n in written):
                for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies of its own scripts
                    os.remove(os.path.join(directory, script))
            torch.save(reference, os.path.join(HERE, name, "reference.pt"))
        dist.barrier()
    if rank == 0:
        with open(os.path.join(HERE, "expected_frozen.json"), "w") as file:
            json.dump(expected, file, indent=1)
            file.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
