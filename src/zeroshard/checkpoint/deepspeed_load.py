"""A DeepSpeed checkpoint loaded straight into an engine of any world size and ZeRO stage.

DeepSpeed itself resumes a ZeRO checkpoint only at the world size that wrote it (changing it needs
its offline `ds_to_universal` conversion). Here every rank reads, from whichever DeepSpeed rank
files hold them, the elements of each parameter that fall into its own master shard
(`group.master_pieces()`, [Note: DeepSpeed's checkpoint layout] in deepspeed.py), group by group:
masters, Adam moments and step, then the hyper-parameters, step counters, scheduler and fp16 loss
scaler. Phases end with every rank agreeing it succeeded, as in load.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from zeroshard.checkpoint.apply import Loaded, apply_loaded
from zeroshard.checkpoint.common import agree, attempt
from zeroshard.checkpoint.contract import Counters
from zeroshard.checkpoint.deepspeed import FP32, DeepSpeedCheckpoint
from zeroshard.checkpoint.files import CheckpointError

log = logging.getLogger(__name__)

# torch param-group keys that choose a kernel, not the math: the engine keeps its own (DeepSpeed's
# torch AdamW saves fused=None; restoring that would switch zeroshard's fused kernel off).
_IMPLEMENTATION = {"params", "foreach", "fused", "capturable", "differentiable"}


def load_deepspeed_checkpoint(
    engine,
    path: Path,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    load_module_strict: bool = True,
):
    """Restore `engine` from the DeepSpeed checkpoint directory `path` (one tag). Collective.
    Returns `(path, client_state)` like `load_checkpoint`."""
    comm = engine.comm
    what = f"loading DeepSpeed checkpoint {path}"
    checkpoint, error = attempt(DeepSpeedCheckpoint, path)
    agree(comm, error, what)
    restore_optimizer = load_optimizer_states and not load_module_only
    loaded, error = attempt(_read, engine, checkpoint, restore_optimizer, load_module_strict)
    agree(comm, error, what)
    # [Note: a failed load changes nothing] (apply.py): applied only once every rank has read all
    _, error = attempt(apply_loaded, engine, loaded)
    agree(comm, error, f"{what}: applying what was read")
    engine.refresh_parameters()
    if restore_optimizer:
        for group, values in zip(engine.optimizer.param_groups, checkpoint.hyper_parameters()):
            group.update({k: v for k, v in values.items() if k in group and k not in _IMPLEMENTATION})
    if not load_module_only:
        counters = checkpoint.counters()
        gas = engine.counters().gradient_accumulation_steps
        engine.restore_counters(
            Counters(counters["global_steps"], counters["global_steps"] * gas, gas, counters["skipped_steps"])
        )
        scheduler = checkpoint.model_states.get("lr_scheduler")
        if load_lr_scheduler_states and engine.lr_scheduler is not None and scheduler:
            engine.lr_scheduler.load_state_dict(scheduler)
        scaler = checkpoint.loss_scaler_state()
        if engine.loss_scaler is not None and scaler is not None:
            engine.loss_scaler.load_state_dict(scaler)
    log.info(
        "zeroshard: loaded DeepSpeed checkpoint %s (saved at %d ranks, stage %d; now %d ranks, stage %d)",
        path,
        checkpoint.world_size,
        checkpoint.stage,
        comm.world_size,
        engine.policy.stage,
    )
    return str(path), checkpoint.client_state()


def check_model(checkpoint: DeepSpeedCheckpoint, params: dict[str, list[int]], strict: bool) -> None:
    """The DeepSpeed checkpoint's parameters (names, shapes) against the model's."""
    saved = {p.name: list(p.shape) for p in checkpoint.places}
    saved.update({n: list(s) for n, s in checkpoint.frozen().items()})
    missing = [n for n in params if n not in saved]
    unexpected = [n for n in saved if n not in params]
    reshaped = [n for n in params if n in saved and saved[n] != list(params[n])]
    problems = []
    if reshaped:
        n = reshaped[0]
        problems.append(
            f"{len(reshaped)} parameter(s) with another shape (e.g. '{n}': {saved[n]} in the "
            f"checkpoint, {list(params[n])} in the model)"
        )
    if strict and missing:
        problems.append(
            f"{len(missing)} parameter(s) of the model missing from it (e.g. {missing[:3]}): "
            f"{checkpoint.model_file.name} has neither their optimizer partitions ('param_shapes') "
            f"nor their frozen values (read from {checkpoint.frozen_source()}); to keep the model's own "
            "values for them, pass load_module_strict=False"
        )
    if strict and unexpected:
        problems.append(f"{len(unexpected)} parameter(s) the model does not have (e.g. {unexpected[:3]})")
    if problems:
        raise CheckpointError(
            f"{checkpoint.path}: the DeepSpeed checkpoint is from an incompatible model: " + "; ".join(problems)
        )


def _check_optimizer(checkpoint: DeepSpeedCheckpoint, optimizer) -> None:
    saved = checkpoint.hyper_parameters()
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{checkpoint.optim_files[0]}: optimizer states of {len(saved)} param group(s) "
            f"cannot be loaded into {optimizer.name} with {len(optimizer.param_groups)}; pass "
            "load_optimizer_states=False to load the weights only"
        )
    for index, (values, group) in enumerate(zip(saved, optimizer.param_groups)):
        foreign = sorted(k for k in ("betas", "momentum", "eps") if (k in values) != (k in group))
        if foreign:
            raise CheckpointError(
                f"{checkpoint.optim_files[0]}: param group {index} was saved by another kind of "
                f"optimizer than {optimizer.name} (hyper-parameter(s) {foreign} differ); pass "
                "load_optimizer_states=False to load the weights only"
            )


@torch.no_grad()
def _read(engine, checkpoint: DeepSpeedCheckpoint, restore_optimizer: bool, strict: bool) -> Loaded:
    """Everything this rank loads, read into new tensors (nothing of the engine changes yet)."""
    params = {s.name: list(s.shape) for g in engine.groups for s in g.layout.slots}
    check_model(checkpoint, params, strict)
    if restore_optimizer:
        _check_optimizer(checkpoint, engine.optimizer)
    frozen = checkpoint.frozen()
    kinds = checkpoint.optimizer_state_kinds()
    loaded = Loaded()
    for group in engine.groups:
        master = group.master.detach().to("cpu", copy=True)  # what the checkpoint lacks stays as it is
        for slot, lo, hi, dest in group.master_pieces(master):
            if slot.name in checkpoint.index:
                checkpoint.read(slot.name, FP32, lo, hi, dest)
            elif slot.name in frozen:
                dest.copy_(checkpoint.frozen_param(slot.name).reshape(-1)[lo:hi])
        start, end = group.opt_range
        for lo, hi in group.layout.gaps(start, end):  # padding stays zero
            master[lo - start : hi - start].zero_()
        loaded.copies.append((group.master, master))
        if restore_optimizer and group.trainable:
            state = _optimizer_state(checkpoint, group, kinds)
            if state is not None:
                loaded.states.append((group, state))
    buffers = dict(engine.module.named_buffers())
    for name, value in checkpoint.buffers().items():
        if name in buffers:
            loaded.copies.append((buffers[name], value.clone()))
        elif strict:
            raise CheckpointError(f"{checkpoint.path}: buffer '{name}' is not one of the model's")
    return loaded


def _optimizer_state(checkpoint: DeepSpeedCheckpoint, group, kinds: dict) -> dict | None:
    """One flat group's optimizer state (ZeroOptimizer.load_group_state's form), or None."""
    names = [s.name for s in group.layout.slots if s.name in checkpoint.index]
    if not names or not kinds:
        return None
    state = dict(checkpoint.optimizer_scalars(checkpoint.index[names[0]].group))
    for key, kind in kinds.items():
        if kind != "elementwise":
            continue
        state[key] = torch.zeros_like(group.master)  # 1-D, numel = the shard, padding zero
        for slot, lo, hi, dest in group.master_pieces(state[key]):
            if slot.name in checkpoint.index:
                checkpoint.read(slot.name, key, lo, hi, dest)
    return {k: v.to(group.master.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
