"""What an optimizer step changes, copied before it so that a failed step can be undone.

[Note: transactional step]
Everything in ZeroOptimizer.step that can disagree between ranks or fail on a collective (the fp16
overflow check, the gradient norm, which parameters got a gradient) is decided before the update;
the update itself is only this rank's arithmetic: gradient scaling and the torch optimizer over the
masters and the optimizer state, which a user's optimizer, an out-of-memory error or a store may
interrupt half-way. A `Snapshot` of the masters, of the optimizer state and of the per-parameter
scalar state ([Note: parameters without a gradient] in masked.py) is taken before and put back if
the update raises, so the step leaves them as they were. The cost is one more copy of this rank's
optimizer shard while the step runs (ZeroOptimizer.transactional = False saves it). With offloaded
optimizer states no copy is taken (Sharded sets transactional = False): the copy would bring the
states back into the memory they were offloaded from; the streamed step instead checks every swap
file before it updates anything, so a damaged store still fails before any change. The gradients of
the window are then scaled or partly consumed: the caller must zero_grad() before the next backward
(Sharded enforces it, [Note: failed steps] in sharded.py).
"""
from __future__ import annotations

import copy

import torch


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class Snapshot:
    def __init__(self, groups, optimizer: torch.optim.Optimizer, slot_states) -> None:
        self.groups = groups
        self.optimizer = optimizer
        self.slot_states = slot_states
        self.masters = [group.master.clone() for group in groups]  # 1-D fp32, like each master
        self.state = {param: {k: _copy(v) for k, v in entry.items()} for param, entry in optimizer.state.items()}
        self.diverged = copy.deepcopy(slot_states.diverged)

    @torch.no_grad()
    def restore(self) -> None:
        """Masters and optimizer state back as they were: in place where a tensor survives (a
        store's tensor stays that store's), entries created since dropped."""
        for group, saved in zip(self.groups, self.masters):
            group.master.copy_(saved)
        state = self.optimizer.state
        for param in [p for p in state if p not in self.state]:
            del state[param]
        for param, entry in self.state.items():
            current = state[param]
            for key in [k for k in current if k not in entry]:
                del current[key]
            for key, value in entry.items():
                old = current.get(key)
                if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape:
                    old.copy_(value)
                else:
                    current[key] = value
        self.slot_states.diverged = self.diverged
