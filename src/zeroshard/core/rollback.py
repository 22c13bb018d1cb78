"""What an optimizer step changes, copied before it so that a failed step can be undone.

[Note: transactional step]
Everything in ZeroOptimizer.step that can disagree between ranks or fail on a collective (the fp16
overflow check, the gradient norm, which parameters got a gradient) is decided before the update;
the update itself is only this rank's arithmetic: gradient scaling and the torch optimizer over the
masters and the optimizer state, which a user's optimizer, an out-of-memory error or a store may
interrupt half-way. A `Snapshot` of the masters, of the optimizer state and of the per-parameter
scalar state ([Note: parameters without a gradient] in masked.py) is taken before and put back if
the update raises, so the step leaves them as they were. The cost is one more copy of this rank's
masters and optimizer state while the step runs (ZeroOptimizer.transactional = False saves it),
less, at stages 2/3, the gradient shards the step frees as it goes ([Note: one group at a time]).
No cheaper copy keeps the guarantee: when the last group's update fails, every earlier group has
its new values and must get its old ones back, so both are in memory then, unless the update could
be undone exactly, which floating-point arithmetic does not allow. At stage 0 that
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

[Note: one group at a time]
Where one optimizer.step() per flat group is the same update as one step() over all of them
(`steps_apart_alike`: torch's optimizers, which keep every state per tensor), ZeroOptimizer steps the
groups one after the other: it copies a group's master and state just before that group's update,
and frees the group's gradient shard as soon as the update has read it ([Note: gradient shard
lifetime] in grad_buffers.py). So the copies of the groups already stepped take the memory their gradients
leave: at the step's peak a rank holds its masters, optimizer state and their copy, and no gradient
(on the 202M GPT at stage 3: 403 MB less than copying everything before one step() over all,
docs/stage3_memory.md). An optimizer that counts steps per param group (apex's and DeepSpeed's
FusedAdam) would count one step per group: it gets one step() over all groups, and the copy of
everything before it. A failing group's update is undone with every group before it (all were
copied); the gradients are spent either way ([Note: failed steps] in sharded.py). A hook registered
on the inner torch optimizer (`register_step_pre_hook` / `post_hook`) therefore runs once per flat
group per step.
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
    """Copies of what an update changes, taken group by group just before each group's update
    ([Note: one group at a time]), put back by `restore` if the update raises."""

    def __init__(self, optimizer: torch.optim.Optimizer, slot_states, buffers: SnapshotBuffers | None = None) -> None:
        self.optimizer = optimizer
        self.slot_states = slot_states
        self.buffers = buffers
        self.before = set(optimizer.state)  # entries made by the update are dropped by restore
        self.diverged = copy.deepcopy(slot_states.diverged)
        self.masters: list[tuple] = []  # (group, its master's copy: 1-D fp32)
        self.state: dict = {}  # param -> {key: copy} for the entries of the groups kept
        self.nbytes = 0  # bytes copied (kept buffers included)

    def _copy(self, key: tuple, value):
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        self.nbytes += value.numel() * value.element_size()
        return value.clone() if self.buffers is None else self.buffers.copy(key, value)

    def keep(self, group, params) -> None:
        """Copy `group`'s master and the optimizer state of `params`, the tensors the optimizer keys
        that group's state by (its master, or its sub-groups), before they change."""
        self.masters.append((group, self._copy(("master", id(group)), group.master)))
        for param in params:
            if param in self.before:
                self.state[param] = {k: self._copy(("state", id(param), k), v)
                                     for k, v in self.optimizer.state[param].items()}

    @torch.no_grad()
    def restore(self) -> None:
        """Masters and optimizer state back as they were: in place where a tensor survives (a
        store's tensor stays that store's), entries created since dropped."""
        for group, saved in self.masters:
            group.master.copy_(saved)
        state = self.optimizer.state
        for param in [p for p in state if p not in self.before]:
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


def steps_apart_alike(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Is one `optimizer.step()` per flat group (the other groups' gradients None) the same update
    as one step() over all of them ([Note: one group at a time])? True for torch's optimizers,
    which keep every state per tensor; False for one that counts steps per param group (apex's and
    DeepSpeed's FusedAdam keep `group["step"]`). Asked of twins over two 3-element tensors on
    `device` (the masters') with each param group's hyper-parameters, three steps each, so the
    user's optimizer is not touched; a twin that cannot step there answers False (one step() over
    all groups, which is never wrong)."""
    try:
        return _alike(optimizer, device)
    except Exception:  # noqa: BLE001 - a probe only: the real step reports the optimizer's errors
        return False


def _alike(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    generator = torch.Generator().manual_seed(0)
    rounds = [[torch.randn(3, generator=generator).to(device) for _ in range(2)] for _ in range(3)]
    for param_group in optimizer.param_groups:
        hyper = {k: v for k, v in param_group.items() if k != "params"}
        twins = []
        for _ in range(2):
            params = [torch.linspace(-1.0, 1.0, 3, device=device).requires_grad_() for _ in range(2)]
            twins.append((params, type(optimizer)([{**copy.deepcopy(hyper), "params": params}])))
        (together, one), (apart, other) = twins
        for grads in rounds:
            for param, grad in zip(together, grads):
                param.grad = grad.clone()
            one.step()
            for param, grad in zip(apart, grads):
                for q in apart:
                    q.grad = None
                param.grad = grad.clone()
                other.step()
        if not all(torch.equal(a, b) for a, b in zip(together, apart)):
            return False
        if not all(_same(one.state[a], other.state[b]) for a, b in zip(together, apart)):
            return False
        if not _same({k: v for k, v in one.param_groups[0].items() if k != "params"},
                     {k: v for k, v in other.param_groups[0].items() if k != "params"}):
            return False
    return True


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)
