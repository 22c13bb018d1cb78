"""When the optimizer's update cannot fail half-way, so that the transactional step needs no copy.

[Note: an update that cannot fail half-way]
The transactional step copies what the update changes so that an update that raises half-way can be
undone ([Note: transactional step] in rollback.py). That copy is only needed where the update can
fail after it has changed something. torch's fused Adam and AdamW on CPU cannot. ZeroOptimizer
calls `optimizer.step()` once per flat group, that group's master the only tensor with a gradient
([Note: one group at a time]); each call runs torch's Python, which checks its arguments and adds 1
to the group's `step` counter, and then one call of the fused kernel over that one tensor (aten's
`_fused_adam(w)_kernel_cpu_`), which checks dtypes before it writes, allocates nothing for a
contiguous gradient and has nothing that can fail once its loop runs. So a group's update either
raised before the kernel, having changed only `step`, or is complete. `why_not_atomic` makes sure
that nothing else runs, for every group, before the first group's update:

* the optimizer is exactly torch.optim.Adam or AdamW, fused in every param group, not
  differentiable, without a GradScaler's `grad_scale` / `found_inf`, with no step hooks of its own
  or torch's global ones: only torch's code runs in its step();
* every master is a contiguous tensor on the CPU, its gradient contiguous with the master's shape
  and dtype; its state already exists (the first step allocates it, between groups: that step
  copies as before) with exactly the keys a twin's has, each elementwise entry contiguous with the
  master's shape and dtype, each scalar a 0-dim tensor;
* each param group's hyper-parameters step a twin (the same class over a 3-element tensor, 70 us),
  so that a scheduler that set a bad `lr` fails there, before anything changed;
* every slot got a gradient and the group has one scalar state ([Note: parameters without a
  gradient] in masked.py: a masked group steps in runs, through Python of ours that allocates;
  it copies as before).

Ctrl-C is held from the first group's update to the end of the step (`held_interrupts`) and
delivered then, so an interrupted step completes and raises KeyboardInterrupt after it. The copy
left is of the 0-dim `step` counters. What no check foresees is a Python MemoryError between two
groups' updates; after a group was updated it cannot be undone, and `StepNotUndone` says so, naming
them. `zeroshard.transactional_step: "copy"` copies always. On CUDA the fused kernel launches
through `multi_tensor_apply`, which this project has not been able to check on a GPU: it copies.
"""
from __future__ import annotations

import contextlib
import signal
import threading

import torch
from torch.optim import optimizer as torch_optimizer

ATOMIC_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


class StepNotUndone(RuntimeError):
    """An update that was taken without a copy failed after some groups were updated."""

    @classmethod
    def after(cls, updated: list, total: int) -> StepNotUndone:
        return cls(f"the optimizer step failed after updating {len(updated)} of {total} flat groups (the first "
                   f"holds '{updated[0].names[0]}'), which cannot be put back: the fused update took no copy "
                   "([Note: an update that cannot fail half-way] in core/atomic.py). Reload the last checkpoint; "
                   'zeroshard.transactional_step: "copy" always copies')


def why_not_atomic(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], grads: list | None = None) -> str | None:
    """None when one step() per master ([Note: one group at a time]) cannot fail once a master
    changed ([Note: an update that cannot fail half-way]); else why it can. Without `grads` (before
    the step, while they are reduced) all but the gradients are asked."""
    if type(optimizer) not in ATOMIC_OPTIMIZERS:
        return f"{type(optimizer).__name__} is not torch's Adam or AdamW"
    if not all(g.get("fused") and not g.get("differentiable") for g in optimizer.param_groups):
        return "a param group is not fused"
    if any(getattr(optimizer, name, None) is not None for name in ("grad_scale", "found_inf")):
        return "a GradScaler drives the optimizer"
    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
             torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks)
    if any(hooks):
        return "the optimizer has step hooks"
    twins: dict = {}
    for master, grad in zip(masters, grads if grads is not None else [None] * len(masters)):
        reason = _tensors(master, grad) or _state(optimizer.state.get(master), master, _twin_state(optimizer, twins))
        if reason:
            return reason
    return None


def _tensors(master: torch.Tensor, grad) -> str | None:
    if master.device.type != "cpu" or not master.is_contiguous():
        return "a master is not a contiguous CPU tensor"
    if grad is None:
        return None
    if not isinstance(grad, torch.Tensor) or not grad.is_contiguous() or grad.shape != master.shape \
            or grad.dtype != master.dtype or grad.device != master.device:
        return "a gradient is not contiguous like its master"
    return None


def _twin_state(optimizer: torch.optim.Optimizer, twins: dict):
    def state_of(master: torch.Tensor) -> dict | str:
        index = next((i for i, g in enumerate(optimizer.param_groups) if any(p is master for p in g["params"])), None)
        if index is None:
            return "a master is in no param group"
        if index not in twins:
            twins[index] = _step_twin(optimizer, optimizer.param_groups[index], master.dtype)
        return twins[index]
    return state_of


def _step_twin(optimizer: torch.optim.Optimizer, param_group: dict, dtype: torch.dtype) -> dict | str:
    """The state two steps of the same class with `param_group`'s hyper-parameters leave, or why
    they raised (the real update would raise too, maybe after another group was updated)."""
    try:
        param = torch.zeros(3, dtype=dtype, requires_grad=True)
        twin = type(optimizer)([{**{k: v for k, v in param_group.items() if k != "params"}, "params": [param]}])  # type: ignore[call-arg]  # the subclass's constructor: its defaults are its own arguments
        for _ in range(2):
            param.grad = torch.ones(3, dtype=dtype)
            twin.step()
        return twin.state[param]
    except Exception as error:  # noqa: BLE001 - a probe: the step that copies reports the real error
        return f"a twin of a param group raised {type(error).__name__}"


def _state(state: dict | None, master: torch.Tensor, twin_state) -> str | None:
    if not state:
        return "a master has no optimizer state yet (the first step)"
    twin = twin_state(master)
    if isinstance(twin, str):
        return twin
    if state.keys() != twin.keys():
        return "a master's optimizer state has other entries than torch's"
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dtype != twin[key].dtype or value.device != master.device:
            return f"optimizer state '{key}' is not the tensor torch's step expects"
        shape = master.shape if twin[key].dim() else torch.Size([])
        if value.shape != shape or not value.is_contiguous():
            return f"optimizer state '{key}' is not the tensor torch's step expects"
    return None


@contextlib.contextmanager
def held_interrupts():
    """SIGINT (Ctrl-C) recorded instead of raised while the block runs, and delivered at its end.
    Only Python's main thread can set a handler; elsewhere, or with no Python handler, nothing is
    held (SIG_DFL ends the process, SIG_IGN ignores)."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if caught:  # after an error too: the KeyboardInterrupt then carries it as its context
            handler(*caught[0])
