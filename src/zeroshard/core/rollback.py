"""What an optimizer step changes, copied before it so that a failed step can be undone.

[Note: transactional step]
Everything in ZeroOptimizer.step that can disagree between ranks or fail on a collective (the fp16
overflow check, the gradient norm, which parameters got a gradient) is decided before the update;
the update itself is only this rank's arithmetic: gradient scaling and the torch optimizer over the
masters and the optimizer state, which a user's optimizer, an out-of-memory error or a store may
interrupt half-way. A `Snapshot` of the masters, of the optimizer state and of the per-parameter
scalar state ([Note: parameters without a gradient] in masked.py) is taken before and put back if
the update raises, so the step leaves them as they were. The cost is one more copy of this rank's
optimizer shard while the step runs (ZeroOptimizer.transactional = False saves it). At stage 0 that
copy is kept between steps (`SnapshotBuffers`) and overwritten in place by the next one: a fresh
copy of hundreds of MB is mostly page faults on a CPU (torch's CPU allocator caches nothing: 8x the
time of copying into a kept buffer, docs/performance.md), and stage 0 is chosen for speed; stages
1-3 are chosen for memory, where a kept copy would sit on top of the activations through forward
and backward, so they take a fresh copy each step and free it. With offloaded
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


class SnapshotBuffers:
    """Tensors a snapshot copies into, kept from one step to the next ([Note: transactional step])."""

    def __init__(self) -> None:
        self.kept: dict[tuple, torch.Tensor] = {}

    def copy(self, key: tuple, value: torch.Tensor) -> torch.Tensor:
        kept = self.kept.get(key)
        if kept is None or kept.shape != value.shape or kept.dtype != value.dtype or kept.device != value.device:
            kept = self.kept[key] = value.clone()
        else:
            kept.copy_(value)
        return kept

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kept.values())


class Snapshot:
    def __init__(self, groups, optimizer: torch.optim.Optimizer, slot_states,
                 buffers: SnapshotBuffers | None = None) -> None:
        self.groups = groups
        self.optimizer = optimizer
        self.slot_states = slot_states

        def keep(key, value):
            if buffers is None or not isinstance(value, torch.Tensor):
                return _copy(value)
            return buffers.copy(key, value)

        self.masters = [keep(("master", i), group.master) for i, group in enumerate(groups)]  # 1-D fp32
        self.state = {param: {k: keep(("state", id(param), k), v) for k, v in entry.items()}
                      for param, entry in optimizer.state.items()}
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
                else:  # a copy: a kept buffer must never become the live state it is a copy of
                    current[key] = _copy(value)
        self.slot_states.diverged = self.diverged
