"""Activation checkpointing: DeepSpeed's `deepspeed.checkpointing` API on torch's non-reentrant
checkpoint, and a way to checkpoint every unit without editing the model.

A checkpointed region keeps only its inputs during forward and runs its forward again in backward
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"), trading about one extra forward
for activation memory that grows with the number of regions instead of the number of layers.

[Note: recomputation under stage 3]
A unit checkpointed by `apply_to_units` is recomputed by calling the unit module again, so its
forward hooks run again (torch's composable `checkpoint` only disables its own hooks). The lifecycle
(lifecycle.py) treats a forward during the BACKWARD phase as a recomputation: the pre-forward hook
gathers the unit if it is not gathered yet (it usually is: the hook on the unit's outputs gathered it
when their gradient arrived) and the post-forward hook does not free it, because the unit's backward
comes next and frees it once its gradients are reduced. A region checkpointed with `checkpoint(fn)`
that spans several units works the same way: each unit inside is gathered by its own pre-forward hook.

[Note: process-wide checkpointing policy]
`deepspeed.checkpointing.configure(...)` and `checkpoint(fn, *args)` are two calls with no handle
between them, so the configured policy is process-wide in DeepSpeed's API. It is kept in `_PROCESS`,
one frozen value and nothing else (no process group, stream or store), the exception to "no module
globals" that this API forces. Units checkpointed by the engine read the engine's config instead.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint

from zeroshard.config import ConfigKeyNotActedOnWarning, load_config
from zeroshard.core.wrap import ROOT, is_inside, unit_modules

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointingPolicy",
    "apply_activation_checkpointing",
    "apply_to_units",
    "checkpoint",
    "configure",
    "configure_engine",
    "is_configured",
    "non_reentrant_checkpoint",
    "reset",
    "route_transformers_checkpoints",
]

# Why each option changes nothing here (DeepSpeed's activation_checkpointing keys).
_NO_OP_REASONS = {
    "partition_activations": "DeepSpeed splits checkpointed activations across model-parallel ranks; zeroshard "
    "has no model parallelism",
    "contiguous_memory_optimization": "activations are kept by torch's checkpoint, not copied into one buffer",
    "number_checkpoints": "it only sizes DeepSpeed's contiguous activation buffer",
    "synchronize_checkpoint_boundary": "a device synchronisation that only serves DeepSpeed's profiling",
    "profile": "zeroshard does not time checkpointed regions",
    "cpu_checkpointing": "no GPU in this run: activations already live in CPU memory",
}


@dataclass(frozen=True)
class CheckpointingPolicy:
    """What changes how activations are kept. Everything else in the section is reported as a no-op."""

    cpu_checkpointing: bool = False  # park the inputs a checkpoint keeps in CPU memory (GPU runs only)


class _ProcessPolicy:
    """See [Note: process-wide checkpointing policy]."""

    policy: CheckpointingPolicy | None = None


_PROCESS = _ProcessPolicy()


def configure(
    mpu_=None,
    deepspeed_config=None,
    partition_activations=None,
    contiguous_checkpointing=None,
    num_checkpoints=None,
    checkpoint_in_cpu=None,
    synchronize=None,
    profile=None,
) -> CheckpointingPolicy:
    """DeepSpeed's `checkpointing.configure`: options from `deepspeed_config`'s `activation_checkpointing`
    section (a dict, a JSON path or a parsed config), overridden by the keyword arguments given."""
    if mpu_ is not None:
        raise ValueError("checkpointing.configure(mpu_=...): model parallelism is not supported by zeroshard")
    values = dict(_section_values(deepspeed_config))
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    cpu = bool(values.get("cpu_checkpointing")) and torch.cuda.is_available()
    for key, value in values.items():
        if value and (key != "cpu_checkpointing" or not cpu):
            _report_no_op(key)
    _PROCESS.policy = CheckpointingPolicy(cpu_checkpointing=cpu)
    return _PROCESS.policy


def _section_values(deepspeed_config) -> dict:
    if deepspeed_config is None:
        return {}
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    section = load_config(deepspeed_config, world).activation_checkpointing
    return {key: getattr(section, key) for key in section.model_fields_set}


def _report_no_op(key: str) -> None:
    # One warning per key and process: the default filter shows a given message from this line once.
    warnings.warn(
        f"zeroshard accepts but does not act on config key 'activation_checkpointing.{key}': {_NO_OP_REASONS[key]}",
        ConfigKeyNotActedOnWarning,
        stacklevel=2,
    )


def is_configured() -> bool:
    return _PROCESS.policy is not None


def reset() -> None:
    """Forget the configured policy (DeepSpeed's `checkpointing.reset`)."""
    _PROCESS.policy = None


def checkpoint(function, *args, **kwargs):
    """`deepspeed.checkpointing.checkpoint(function, *args)`: run `function(*args, **kwargs)` keeping
    only its inputs, and run it again in backward. Non-reentrant torch checkpoint, so non-tensor
    arguments, keyword arguments and `torch.autograd.grad` all work, and the RNG state (dropout) is
    replayed, so results equal those without checkpointing bit for bit."""
    policy = _PROCESS.policy or CheckpointingPolicy()
    if policy.cpu_checkpointing and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return _checkpoint_inputs_on_cpu(function, args, kwargs)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


non_reentrant_checkpoint = checkpoint  # DeepSpeed's name for the same call


def _checkpoint_inputs_on_cpu(function, args, kwargs):
    """The inputs are what a checkpoint keeps; hold them in CPU memory and move them back to compute."""
    devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
    parked = [a.to("cpu") if isinstance(a, torch.Tensor) and a.is_cuda else a for a in args]

    def run(*inputs):
        restored = [x.to(d) if d is not None and x.device != d else x for x, d in zip(inputs, devices)]
        return function(*restored, **kwargs)

    return torch.utils.checkpoint.checkpoint(run, *parked, use_reentrant=False)


def configure_engine(engine) -> None:
    """The engine's part: its config's `activation_checkpointing` section configures the checkpointing
    policy (reporting the options that are no-ops here), `cpu_checkpointing` routes a transformers
    model's own checkpointed layers through `checkpoint`, and `zeroshard.activation_checkpointing_units`
    checkpoints every unit."""
    if engine.config.activation_checkpointing.model_fields_set:
        configure(deepspeed_config=engine.config)
    if engine.config.activation_checkpointing.cpu_checkpointing:
        route_transformers_checkpoints(engine.module)
    if engine.config.zeroshard.activation_checkpointing_units:
        apply_to_units(engine)


def route_transformers_checkpoints(model: nn.Module) -> list[str]:
    """[Note: transformers' checkpointed layers in host memory]
    A transformers model checkpoints its layers itself (`activation_checkpointing_enable()`): each
    layer calls the function kept in its `_gradient_checkpointing_func` with the layer's hidden states
    as input, the one activation per layer a long sequence keeps. With `cpu_checkpointing` (DeepSpeed's
    key), every such layer calls `checkpoint` instead, which keeps those inputs in host memory when
    they are on a GPU (what DeepSpeed ALST does to checkpointed hidden states) and is torch's
    non-reentrant checkpoint otherwise, so results do not change. transformers' own
    `activation_checkpointing_enable(offload=True)` parks every tensor the checkpoint saves, by torch's
    `save_on_cpu`: either works. The attribute is the hook transformers sets itself; torch and the
    model's code are untouched, and layers whose checkpointing is enabled after the engine is built
    keep transformers' function. Returns the modules routed."""
    routed = []
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint
            routed.append(name)
    return routed


# -- applying it to units --------------------------------------------------------------------------------
def apply_to_units(engine) -> list[str]:
    """Checkpoint every unit of `engine` but the root (which is the whole model) and leaf units (a head
    unit: nothing to recompute that it does not save anyway). Module and parameter names do not change. Returns the qualified names of the checkpointed modules."""
    chosen = [(u.name, u.module) for u in engine.units if u.module is not None and u.name != ROOT]
    if engine.config.activation_checkpointing.cpu_checkpointing and torch.cuda.is_available():
        warnings.warn(
            "activation_checkpointing.cpu_checkpointing applies to checkpoint() calls; units "
            "checkpointed by zeroshard keep their inputs on the device",
            ConfigKeyNotActedOnWarning,
            stacklevel=2,
        )
    return _checkpoint_modules(chosen)


def apply_activation_checkpointing(model: nn.Module, wrap_modules: list[str] | None = None) -> list[str]:
    """The same without an engine: checkpoint the modules that would be units of `model` (see wrap.py)."""
    return _checkpoint_modules([(n, m) for n, m in unit_modules(model, wrap_modules) if n != ROOT])


def _checkpoint_modules(named: list[tuple[str, nn.Module]]) -> list[str]:
    done: list[str] = []
    for name, module in sorted(named, key=lambda item: item[0].count(".")):
        if next(module.children(), None) is None:
            continue  # a leaf (the head unit, wrap.py) saves its input with or without checkpointing
        if any(is_inside(name, outer) for outer in done):
            continue  # inside a region already recomputed as a whole: checkpointing again saves nothing
        if not _is_checkpointed(module):
            # Forward hooks only: the module, its class and its parameter names stay as they are, and a
            # recomputation calls the module again, so zeroshard's own hooks run too.
            composable_checkpoint(module)
        done.append(name)
    log.info("activation checkpointing applied to %d modules: %s", len(done), ", ".join(done))
    return done


def _is_checkpointed(module: nn.Module) -> bool:
    return composable_checkpoint.state(module) is not None  # None: never applied to this module
