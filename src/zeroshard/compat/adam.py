"""`deepspeed.ops.adam`: `FusedAdam` and `DeepSpeedCPUAdam` with DeepSpeed's constructor arguments.

Both compute what torch's Adam computes (DeepSpeed's kernels implement the same update), so each is
torch's Adam with DeepSpeed's defaults: `adamw_mode` / `adam_w_mode` true = decoupled weight decay
(AdamW), false = L2 added to the gradient; `weight_decay` 0. They ask for torch's fused kernel, as
`build_optimizer` does for the config's Adam (compat/optimizers.py says why). Being `torch.optim.Adam`
subclasses, zeroshard shards them like any elementwise torch optimizer.
"""

from __future__ import annotations

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _check_bias_correction(cls: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise ValueError(
            f"{cls}(bias_correction=False): torch's Adam, which zeroshard runs, always corrects "
            "the moment estimates' bias; remove the argument or pass True"
        )


def _fused_where_possible(params) -> tuple[list, bool]:
    """torch's fused Adam takes floating tensors on CPU or CUDA; fall back to its default otherwise."""
    groups = list(params)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    fused = bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)
    return groups, fused


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's `FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay,
    amsgrad, set_grad_none)`."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        _check_bias_correction(type(self).__name__, bias_correction)
        if amsgrad:
            raise ValueError(
                "FusedAdam does not support the AMSGrad variant (as in DeepSpeed): use torch.optim.Adam(amsgrad=True)"
            )
        groups, fused = _fused_where_possible(params)
        super().__init__(
            groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adam_w_mode,
            fused=fused or None,
        )
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's `DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay,
    amsgrad, adamw_mode, fp32_optimizer_states)`. Optimizer states are fp32 whatever
    `fp32_optimizer_states` says; where they live is the config's `offload_optimizer` choice."""

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        _check_bias_correction(type(self).__name__, bias_correction)
        groups, fused = _fused_where_possible(model_params)
        super().__init__(
            groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=adamw_mode,
            fused=fused or None,
        )
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
