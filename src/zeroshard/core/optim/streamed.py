"""The optimizer step streamed through an offload store, one sub-group at a time.

[Note: streamed step]
ZeRO-Offload (arXiv 2101.06840 §4) and ZeRO-Infinity (arXiv 2104.07857 §5): the optimizer states of
a rank's shard do not all need to be in memory at once. The shard is cut into sub-groups of
`sub_group_size` elements and the user's torch optimizer runs on one sub-group at a time, for two
reasons. Memory: of the states in an NVMe store only the sub-group being updated, the next one being
read and those whose write-back is still under way are resident (NVMeStore.release bounds the last),
and whatever temporaries the torch optimizer makes are one sub-group's size, not the shard's. Time:
while the optimizer updates sub-group k, the store already reads sub-group k+1 and writes sub-group
k-1 back, so the disk works while the CPU computes: `stage` starts the read of k+1 (for the NVMe
store an aligned direct read into a buffer, [Note: where a swap file's tensor lies] in
offload/swapfile.py), `ready` waits for k's before its update, `release` writes k back behind it. A
CPU store's states are resident anyway; there only the temporaries shrink. A group's master is
staged whole, with its first sub-group, and a `sub_group_size` at least its shard steps the master
itself, so its state stays keyed by it. For the elementwise optimizers zeroshard accepts, stepping
one sub-group at a time gives bit for bit the result of one step over the whole shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from zeroshard.core.group import FlatGroup
from zeroshard.core.optim.masked import is_elementwise, step_runs


@dataclass
class SubGroup:
    group: FlatGroup
    start: int
    end: int
    param: torch.Tensor  # a view of group.master: what the torch optimizer updates and keys state by


def split(groups: list[FlatGroup], sub_group_size: int) -> list[SubGroup]:
    out = []
    for group in groups:
        size = group.master.numel()
        if sub_group_size >= size:  # the master itself, so optimizer state stays keyed by it
            out.append(SubGroup(group, 0, size, group.master))
            continue
        for start in range(0, size, max(1, sub_group_size)):
            end = min(start + sub_group_size, size)
            out.append(SubGroup(group, start, end, group.master[start:end]))
    return out


class StreamedStep:
    """Runs `optimizer.step()` one sub-group at a time, with state tensors living in `store`. Each
    group's master is read and written back through its own `master_store` (the optimizer store or
    the stage-3 param store, or none; [Note: master placement] in core/shard.py)."""

    def __init__(self, optimizer: torch.optim.Optimizer, sub_groups: list[SubGroup], store):
        self.optimizer = optimizer
        self.sub_groups = sub_groups
        self.store = store
        self._all_params = [list(pg["params"]) for pg in optimizer.param_groups]

    def state_tensors(self, sub: SubGroup) -> list[torch.Tensor]:
        return [t for t in self.optimizer.state.get(sub.param, {}).values() if is_elementwise(t, sub.param)]

    def subs_of(self, group: FlatGroup) -> list[SubGroup]:
        return [sub for sub in self.sub_groups if sub.group is group]

    def state_of(self, group: FlatGroup) -> dict:
        """The state of `group` joined over its sub-groups (see ZeroOptimizer.group_state). Sub-groups
        step together, so their scalar state (Adam's `step`) is the same; the first one's is taken."""
        subs = self.subs_of(group)
        states = [self.optimizer.state.get(sub.param, {}) for sub in subs]
        if not subs or not states[0]:
            return {}
        self.store.check([t for sub in subs for t in self.state_tensors(sub)])
        for sub, state in zip(subs, states):  # a sub-group without its share would lose it silently
            missing = [k for k, v in states[0].items() if is_elementwise(v, subs[0].param) and k not in state]
            if missing:
                raise RuntimeError(
                    f"optimizer state {missing} of '{group.names[0]}...' is missing for elements "
                    f"[{sub.start}, {sub.end}) of its shard"
                )
        out = {}
        for key, value in states[0].items():
            if is_elementwise(value, subs[0].param):
                out[key] = torch.cat([state[key].reshape(-1) for state in states])  # 1-D, numel = master
            else:
                out[key] = value
        return out

    def load_state(self, group: FlatGroup, state: dict) -> None:
        """Cut `state` (keyed as for the whole master) into the group's sub-groups, elementwise state
        straight into the store."""
        for sub in self.subs_of(group):
            if not state:
                self.optimizer.state.pop(sub.param, None)
                continue
            sub_state = {}
            for key, value in state.items():
                if is_elementwise(value, group.master):
                    home = self.store.tensor(f"{group.names[0]}.{sub.start}.{key}", sub.end - sub.start, value.dtype)
                    home.copy_(value[sub.start : sub.end])
                    sub_state[key] = home
                else:
                    sub_state[key] = value.clone() if isinstance(value, torch.Tensor) else value
            self.optimizer.state[sub.param] = sub_state
            self.store.release(list(sub_state.values()))
        self.store.wait()

    def _tensors(self, sub: SubGroup) -> list[torch.Tensor]:
        return self.state_tensors(sub) + [sub.param]

    def run(self, grads: dict[int, torch.Tensor], plans: dict | None = None) -> dict[int, list]:
        """`grads`: id(group) -> fp32 gradient matching group.master; `plans`: id(group) -> None
        (step it whole) or the runs to step ([Note: parameters without a gradient] in masked.py).
        Returns, per group stepped in runs, (a, b, new scalar state) in master elements."""
        plans = plans or {}
        results: dict[int, list] = {}
        subs = self.sub_groups
        self.check()
        self._prefetch(subs[0])
        try:
            for k, sub in enumerate(subs):
                if k + 1 < len(subs):
                    self._prefetch(subs[k + 1])  # double buffering: read k+1 while k computes
                self._ready(sub)
                plan = plans.get(id(sub.group))
                grad = grads[id(sub.group)][sub.start : sub.end]
                if plan is None:
                    sub.param.grad = grad
                    self._step_one(sub)
                    sub.param.grad = None
                else:
                    results.setdefault(id(sub.group), []).extend(self._step_runs(sub, grad, plan))
                self._adopt_new_state(sub)
                self._release(sub)
        finally:
            for pg, params in zip(self.optimizer.param_groups, self._all_params):
                pg["params"] = params
        started = time.monotonic()
        self.store.wait()
        for master_store in {id(g.master_store): g.master_store for g in self._offloaded_master_groups()}.values():
            if master_store is not self.store:
                master_store.wait()
        self.store.counters.wait_s += time.monotonic() - started
        return results

    def _step_runs(self, sub: SubGroup, grad: torch.Tensor, plan) -> list:
        """The runs of `plan` (master elements) that fall in this sub-group, stepped."""
        local = [
            (max(a, sub.start) - sub.start, min(b, sub.end) - sub.start, status)
            for a, b, status in plan
            if a < sub.end and sub.start < b
        ]
        if not local:
            return []
        done = step_runs(
            self.optimizer,
            sub.group.optimizer_group,
            sub.param,
            grad,
            local,
            lambda key, dtype: torch.zeros(sub.end - sub.start, dtype=dtype, device=sub.param.device),
        )
        return [(a + sub.start, b + sub.start, status) for a, b, status in done]

    def complete_state(self, group: FlatGroup) -> None:
        """After a step in runs, sub-groups none of whose parameters stepped get zero elementwise
        state too, so that the group's state joins over its sub-groups (`state_of`)."""
        subs = self.subs_of(group)
        keys = {
            k: t.dtype
            for sub in subs
            for k, t in self.optimizer.state.get(sub.param, {}).items()
            if is_elementwise(t, sub.param)
        }
        for sub in subs:
            state = self.optimizer.state.setdefault(sub.param, {})
            for key, dtype in keys.items():
                if key not in state:
                    state[key] = self.store.tensor(f"{group.names[0]}.{sub.start}.{key}", sub.end - sub.start, dtype)
                    self.store.release([state[key]])
        self.store.wait()

    def _offloaded_master_groups(self) -> list[FlatGroup]:
        groups = {id(sub.group): sub.group for sub in self.sub_groups if sub.group.master_store is not None}
        return list(groups.values())

    def check(self) -> None:
        """Every swap file is checked before anything is read or updated: a damaged store fails the
        step and leaves masters and optimizer states as they were (and never faults on a mapping)."""
        self.store.check([t for sub in self.sub_groups for t in self._tensors(sub)])
        for group in self._offloaded_master_groups():
            group.master_store.check([group.master])

    def _step_one(self, sub: SubGroup) -> None:
        for pg, params in zip(self.optimizer.param_groups, self._all_params):
            pg["params"] = [sub.param] if any(p is sub.param for p in params) else []
        self.optimizer.step()

    def _adopt_new_state(self, sub: SubGroup) -> None:
        """State the optimizer just created in RAM (first step) moves into the store."""
        state = self.optimizer.state.get(sub.param, {})
        for name, value in list(state.items()):
            if is_elementwise(value, sub.param) and not self._held_by_store(value):
                home = self.store.tensor(f"{sub.group.names[0]}.{sub.start}.{name}", value.numel(), value.dtype)
                home.copy_(value.reshape(-1))  # 1-D, like the sub-group it belongs to
                state[name] = home

    def _held_by_store(self, tensor: torch.Tensor) -> bool:
        return self.store.holds(tensor)

    def _prefetch(self, sub: SubGroup) -> None:
        self.store.stage(self.state_tensors(sub))
        if sub.group.master_store is not None and sub.start == 0:  # once per group, not per sub-group
            sub.group.master_store.stage([sub.group.master])

    def _ready(self, sub: SubGroup) -> None:
        self.store.ready(self.state_tensors(sub))
        if sub.group.master_store is not None and sub.start == 0:
            sub.group.master_store.ready([sub.group.master])

    def _release(self, sub: SubGroup) -> None:
        self.store.release(self.state_tensors(sub))
        if sub.group.master_store is not None and sub.end == sub.group.master.numel():
            sub.group.master_store.release([sub.group.master])
