"""The optimizer `initialize` returns: the one DeepSpeed 0.19.8 returns at each stage and precision.

[Note: the optimizer initialize returns]
DeepSpeed returns `engine.optimizer`: at stage 0 with fp32 parameters the *basic* optimizer itself
(the client's own object, what a client callable built, or what it built from the config's
`optimizer` section); with fp16/bf16 at stage 0, or at stages 1-3, a wrapper around the basic one
(FP16_Optimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3) whose `.optimizer` is the
basic one and whose `param_groups` are its (checked side by side with DeepSpeed 0.19.8, CPU).
zeroshard returns the same objects: at stage 0 in fp32 the basic optimizer; elsewhere
`ZeroOptimizer` (core/optim/optimizer.py), whose `.optimizer` is the basic one and whose
`param_groups`, `state` and `defaults` are its, and which, unlike DeepSpeed's wrappers, is a
`torch.optim.Optimizer`. `engine.optimizer` is `ZeroOptimizer` at every stage (checkpoints, counters
and `get_lr` read it); `engine.basic_optimizer` is the basic one, as in DeepSpeed.

The engine steps the basic optimizer on flat master shards, whose `.grad` is set only inside the
engine's update (`ZeroOptimizer._apply_in_memory`), so torch's own `step`, `zero_grad`,
`state_dict` and `load_state_dict` on the returned object would not see the gradients and
per-slot state the engine holds. `ClientOptimizerLink` makes each do what it does on
`ZeroOptimizer` (what DeepSpeed's basic optimizer does with the gradients DeepSpeed keeps in `.grad`):
- `step()`: a step pre-hook (torch's public `register_step_pre_hook`). A call in which no
  parameter holds a `.grad` is the script's: the hook runs the engine's optimizer step (which steps
  this object again, the masters' gradients set); the script's call then finds no gradient and
  changes nothing, as torch's optimizers skip a parameter whose `.grad` is None.
- `state_dict()` / `load_state_dict()`: torch's post-hooks give and load `ZeroOptimizer`'s form.
- `zero_grad()`: torch has no hook for it, so an attribute of the instance, as torch's LR schedulers
  set `optimizer.step` on the instance; `Optimizer.__getstate__` keeps only `defaults`, `state` and
  `param_groups`, so it is never pickled or deep-copied. `engine.destroy()` removes it and the hooks.
"""

from __future__ import annotations

import torch

from zeroshard.core.optim.optimizer import ZeroOptimizer


def returns_basic_optimizer(config) -> bool:
    """Does DeepSpeed return the basic optimizer itself for this config (stage 0, fp32 parameters)?"""
    return config.zero_optimization.stage == 0 and not config.fp16.enabled and not config.bf16.enabled


class ClientOptimizerLink:
    """Ties the basic optimizer `initialize` returns to the engine's `ZeroOptimizer` (see the note above)."""

    def __init__(self, basic: torch.optim.Optimizer, engine_optimizer: ZeroOptimizer) -> None:
        self.basic = basic
        self.engine_optimizer = engine_optimizer
        self._loading: dict | None = None  # the state dict load_state_dict is loading
        self._handles = [
            basic.register_step_pre_hook(self._step_pre_hook),
            basic.register_state_dict_post_hook(self._state_dict_post_hook),
            basic.register_load_state_dict_pre_hook(self._load_state_dict_pre_hook),
            basic.register_load_state_dict_post_hook(self._load_state_dict_post_hook),
        ]
        basic.zero_grad = self._zero_grad  # type: ignore[method-assign]  # no hook in torch: see the note

    def _step_pre_hook(self, optimizer, args, kwargs) -> None:
        """`args`: (optimizer, closure?), as torch's step wrapper passes them."""
        if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            return  # the engine's update, which set the masters' gradients
        if args[1:] or kwargs:
            raise ValueError(
                f"{type(optimizer).__name__}.step(closure): the engine computes the gradients; call "
                "engine.backward(loss) and then engine.step() (or optimizer.step() with no closure)"
            )
        self.engine_optimizer.step()

    def _state_dict_post_hook(self, optimizer, state_dict: dict) -> dict:
        return self.engine_optimizer.state_dict()

    def _load_state_dict_pre_hook(self, optimizer, state_dict: dict) -> None:
        self._loading = state_dict

    def _load_state_dict_post_hook(self, optimizer) -> None:
        state, self._loading = self._loading, None
        if state is not None:
            self.engine_optimizer.load_state_dict(state)

    def _zero_grad(self, set_to_none: bool = True) -> None:
        self.engine_optimizer.zero_grad(set_to_none)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        if vars(self.basic).get("zero_grad") == self._zero_grad:
            del self.basic.zero_grad
