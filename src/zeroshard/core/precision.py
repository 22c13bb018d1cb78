"""Mixed precision: which dtypes compute and communicate, and fp16's dynamic loss scaling.

Master weights and optimizer states are fp32 shards by default (ZeRO §3.1: "mixed-precision Adam
keeps fp32 copies of parameters, momentum and variance"). Parameters used in compute are
`param_dtype`. Gradients are accumulated and reduced in `reduce_dtype` (a config's communication
data type), by default the compute dtype as in DeepSpeed, so that the bytes held and moved are the
paper's 2Ψ / 2Ψ/N — and converted to the master's dtype only for the optimizer step.

[Note: bf16 master weights]
`PrecisionPolicy(master_dtype=torch.bfloat16)` (DeepSpeed's `bf16.bf16_master_weights_and_grads`)
drops the fp32 copy: the bf16 parameters are their own masters, as fp32 parameters are in fp32
training (a view of the full buffer at stages 0-2, the shard the all-gather reads at stage 3), the
optimizer gets its gradients in bf16, and torch's optimizers, which make their states like the
tensor they step, keep Adam's moments in bf16 (DeepSpeed's `bf16_optimizer_states`). Model states
then cost 2 + 2 + 4 = 8 bytes per parameter with AdamW instead of 16, and 2 + 2 + 2.03 with
torchao's AdamW8bit. The price is rounding: each update is rounded to bf16's 8 significant bits, so an
update smaller than half a bf16 step of its weight (about 2^-9 of it) is lost, every step. torchao's
optimizers offer the compensation, stochastic rounding: with `bf16_stochastic_round=True` they
compute the update in fp32 and round the bf16 weight up or down with the probabilities that make it
exact on average. Random bits make such a run differ from one with another data-parallel layout; the
round-to-nearest update of torch's optimizers is the same at every stage and world size.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class DynamicLossScaler:
    """fp16 loss scaling, DeepSpeed's state machine (its `fp16` config section's keys in brackets).

    An overflow (inf/nan in any rank's gradients; all ranks agree through one all-reduce) skips the
    step. After `hysteresis` consecutive overflows the scale is halved (never below `min_scale`,
    [min_loss_scale]); at the step after each `window` [loss_scale_window] clean steps since the last
    overflow it doubles. `dynamic=False` [loss_scale > 0] keeps `initial_scale` for good: overflowing
    steps are still skipped, the scale never moves.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        dynamic: bool = True,
    ):
        self.dynamic = dynamic
        self.scale = float(initial_scale)
        self.window = window
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            self.iteration += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2, self.min_scale)
                log.info("fp16 overflow: loss scale lowered to %g", self.scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            # DeepSpeed 0.19.8's rule (fp16/loss_scaler.py): the steps since the last overflow,
            # not counting this one, form a whole window. tests/data/deepspeed/ holds its record.
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2
        self.iteration += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "hysteresis_left", "iteration", "last_overflow")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def check_supported(dtype: torch.dtype, device: torch.device) -> None:
    """Fail at initialize, with a clear message, where this torch build cannot compute in `dtype`
    (older CPU builds lack fp16 kernels for matmul or layer norm); otherwise the first forward would
    fail deep inside the model."""
    if dtype == torch.float32:
        return
    try:
        x = torch.ones(2, 4, dtype=dtype, device=device, requires_grad=True)
        w = torch.ones(4, 4, dtype=dtype, device=device, requires_grad=True)
        torch.nn.functional.layer_norm(x @ w, (4,)).sum().backward()
    except (RuntimeError, NotImplementedError) as error:
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
        raise RuntimeError(
            f"this torch ({torch.__version__}) cannot train in {name} on {device.type}: {error}; use another precision"
        ) from error


def cast_floating(tree, dtype: torch.dtype):
    """Floating tensors of a (nested) argument structure cast to `dtype`."""
    from torch.utils._pytree import tree_map

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tree_map(cast, tree)
