"""`deepspeed.moe.utils`: telling expert (MoE) parameters apart, for scripts that build param groups.

DeepSpeed marks an expert parameter by setting `param.allreduce = False` (its MoE layer does) and
puts expert parameters in param groups of their own. zeroshard has no expert parallelism, so a model
without expert parameters gets its groups back unchanged, and one with them is refused with the
parameter named, rather than trained with the wrong reduction.
"""

from __future__ import annotations

import torch

__all__ = [
    "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed's MoE layer marked as an expert's (`allreduce = False`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    shared: list = []
    expert: list = []
    for param in params:
        (expert if is_moe_param(param) else shared).append(param)
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size: int = 178956971) -> list[dict]:
    """DeepSpeed's helper: the param groups (a dict, or a list/tuple of dicts), with expert parameters
    moved into groups of their own. Without expert parameters: the same groups, as a list."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)) and all(isinstance(g, dict) for g in param_groups):
        groups = list(param_groups)
    else:
        raise ValueError(
            "split_params_into_different_moe_groups_for_optimizer takes a param-group dict or a "
            f"list/tuple of them, got {type(param_groups).__name__}"
        )
    for index, group in enumerate(groups):
        experts = [p for p in group["params"] if is_moe_param(p)]
        if experts:
            raise ValueError(
                f"param group {index} holds {len(experts)} MoE expert parameter(s) (allreduce=False, "
                f"shape {tuple(experts[0].shape)}, ...): zeroshard has no expert parallelism; "
                "train the model without DeepSpeed's MoE layers"
            )
    return groups
