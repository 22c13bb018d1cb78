"""Build the torch optimizer named by the config's ``optimizer`` section, and check that an optimizer can
run on a flat shard.

DeepSpeed semantics (``DeepSpeedEngine._configure_basic_optimizer``):

- type "Adam" is AdamW math (decoupled weight decay) unless ``adam_w_mode: false``, then Adam with L2
  added to the gradient; type "AdamW" is AdamW whatever ``adam_w_mode`` says.
- DeepSpeed runs these as FusedAdam (weight_decay default 0.0), or as torch.optim.Adam/AdamW when
  ``torch_adam: true`` (then an absent weight_decay takes torch's default: 0.01 for AdamW). FusedAdam and
  torch's Adam/AdamW compute the same update, so zeroshard always builds the torch class and only
  reproduces the defaults. Like FusedAdam it asks for torch's fused kernel (``fused=True``) unless
  ``torch_adam: true``: on CPU it is several times faster than the for-loop and foreach paths (measured with
  benchmarks/cpu_adam.py: docs/bench/cpu_adam.txt), which matters most for the offloaded optimizer step.
- type "SGD" is torch.optim.SGD with the given params.
- type "Muon" is DeepSpeed's Muon with auxiliary Adam: the hidden matrices (2-D, name without "embed"
  or "lm_head") take Muon with ``lr``/``muon_lr``, ``momentum`` and ``weight_decay``; the other
  parameters take AdamW with ``lr``/``adam_lr``, ``betas``, ``eps`` and ``weight_decay``; trainable
  parameters only. zeroshard builds torch's classes (``MuonWithAdamW``), so the Newton-Schulz
  iteration is torch's quintic one (DeepSpeed's ``ns_method`` is reported as not acted on).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.config.schema import AdamParams, MuonParams, OptimizerConfig, SGDParams
from zeroshard.core.optim.declared import declared_classes, whole_groups_rule
from zeroshard.core.optim.muon import MuonWithAdamW

__all__ = ["ELEMENTWISE_OPTIMIZERS", "OptimizerNotShardableError", "build_optimizer", "check_shardable"]

# Optimizers whose update of a scalar reads only that scalar's parameter, gradient and state (plus
# per-tensor step counters), so running them on an arbitrary contiguous slice of a flat buffer gives
# the same numbers as running them on the full tensors (ZeRO paper §5.1: each rank updates its
# partition of the optimizer state). Optimizers that look across elements (LBFGS: dot products over
# all parameters; Adafactor: row/column factored moments; SparseAdam: sparse gradients) are not.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Rprop,
    torch.optim.ASGD,
)

ParamsArg = Iterable[torch.Tensor] | Iterable[dict[str, Any]]  # tensors or param-group dicts, as torch.optim.Optimizer


class OptimizerNotShardableError(ValueError):
    """The optimizer cannot run on a flat shard (not elementwise), or already holds state."""


def build_optimizer(
    section: OptimizerConfig, params: ParamsArg, names: dict[int, str] | None = None
) -> torch.optim.Optimizer:
    """The torch optimizer described by the ``optimizer`` config section, over ``params`` (tensors or
    param-group dicts, as torch optimizers take them). ``names``: id(parameter) -> its name in the
    model, which type Muon splits by."""
    hp = section.params
    if section.type == "Muon":
        assert isinstance(hp, MuonParams)
        return _muon(hp, params, names or {})
    if section.type == "SGD":
        assert isinstance(hp, SGDParams)
        return torch.optim.SGD(
            params,
            lr=hp.lr,
            momentum=hp.momentum,
            dampening=hp.dampening,
            weight_decay=hp.weight_decay,
            nesterov=hp.nesterov,
        )
    assert isinstance(hp, AdamParams)
    decoupled = section.type == "AdamW" or hp.adam_w_mode
    kwargs: dict[str, Any] = dict(lr=hp.lr, betas=hp.betas, eps=hp.eps, amsgrad=hp.amsgrad)
    if not hp.torch_adam or "weight_decay" in hp.model_fields_set:
        kwargs["weight_decay"] = hp.weight_decay
    if not hp.torch_adam:
        kwargs["fused"] = True
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **kwargs)


# DeepSpeed 0.19.8 (DeepSpeedEngine._muon_param_groups): the keys each half of a Muon param group takes
_MUON_KEYS = ("lr", "momentum", "weight_decay")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def _muon(hp: MuonParams, params: ParamsArg, names: dict[int, str]) -> MuonWithAdamW:
    """Each incoming param group (loose tensors form one) split into its Muon half and its AdamW half;
    a half's settings are the section's, then ``muon_lr`` / ``adam_lr``, then the group's own."""
    groups: list[dict[str, Any]] = []
    loose: list[torch.Tensor] = []
    for item in params:
        (groups if isinstance(item, dict) else loose).append(item)  # type: ignore[arg-type]
    if loose or not groups:
        groups.append({"params": loose})
    shared = {k: v for k, v in hp.model_dump().items() if v is not None}
    out: list[dict[str, Any]] = []
    for group in groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        overrides = {k: v for k, v in group.items() if k != "params"}
        for use_muon, keys, lr_key in ((True, _MUON_KEYS, "muon_lr"), (False, _ADAM_KEYS, "adam_lr")):
            half = [p for p in trainable if _is_muon(p, names.get(id(p), "")) is use_muon]
            if not half:
                continue
            settings = {k: shared[k] for k in keys if k in shared}
            if lr_key in shared:
                settings["lr"] = shared[lr_key]
            settings.update({k: v for k, v in overrides.items() if k in keys})
            out.append({"params": half, "use_muon": use_muon, **settings})
    if not out:
        raise ValueError("optimizer type Muon: the model has no trainable parameters")
    return MuonWithAdamW(out)


def _is_muon(param: torch.Tensor, name: str) -> bool:
    """DeepSpeed's rule: a matrix whose name has neither "embed" nor "lm_head". torch's Muon is for
    2-D parameters only, so tensors of more dimensions (DeepSpeed reshapes them) take AdamW here."""
    return param.ndim == 2 and not _embedding_or_head(name)


def _embedding_or_head(name: str) -> bool:
    return any(word in name.lower() for word in ("embed", "lm_head"))


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``OptimizerNotShardableError`` unless ``optimizer`` can be run on flat shards.

    Accepted: instances of ``ELEMENTWISE_OPTIMIZERS`` (subclasses included: they keep the parent's
    update unless they override it, which we cannot see), and whole-parameter optimizers
    (``torch.optim.Muon``, ``MuonWithAdamW``, classes declared with
    ``register_whole_parameter_optimizer``), whose matrices are each updated whole by one rank; all
    without any state yet.
    """
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) and whole_groups_rule(optimizer) is None:
        supported = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS + declared_classes())
        raise OptimizerNotShardableError(
            f"{type(optimizer).__name__} cannot be sharded by zeroshard: its update is not elementwise, "
            f"or it is not a torch optimizer zeroshard knows. Supported: {supported} (or subclasses); an "
            "optimizer that updates each parameter from that whole parameter alone can be declared with "
            "zeroshard.register_whole_parameter_optimizer"
        )
    if any(_has_stepped(state) for state in optimizer.state.values()):
        raise OptimizerNotShardableError(
            f"{type(optimizer).__name__} already has optimizer state: build the engine before the "
            "first optimizer step (state is created on the flat shards)"
        )


def _has_stepped(state: dict[str, Any]) -> bool:
    # Adagrad fills its state (step = 0, sum = initial_accumulator_value) in __init__; that is not a
    # step taken. Optimizers without a step counter (SGD's momentum buffer) count any state.
    if "step" in state:
        return float(state["step"]) > 0
    return bool(state)
