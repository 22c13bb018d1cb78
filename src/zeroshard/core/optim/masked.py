"""Parameters without a gradient keep their value, optimizer state and step count.

[Note: parameters without a gradient]
Torch optimizers skip a parameter whose `.grad` is None, and DDP (find_unused_parameters=True)
leaves `.grad` None for a parameter no rank used: such a parameter keeps its value, its optimizer
state and its step count (Adam's bias correction reads that count). A parameter some ranks used is
averaged over all ranks, the others contributing zeros, as DDP does. zeroshard steps flat groups,
so it must do the same per parameter (slot):
  * each group records, per slot, whether this rank accumulated a gradient for it since the last
    step (`FlatGroup.grad_seen`); before the step one control all-reduce (max) over every group's
    flags tells every rank which slots got a gradient anywhere -- one byte per parameter tensor;
  * a group whose slots all got a gradient and share one step count takes the ordinary step over
    its whole master shard;
  * otherwise the group is stepped in *runs*: maximal ranges of its shard whose slots got a
    gradient and share the same scalar state. Each run is handed to the torch optimizer as a view
    of the master, with views of the group's elementwise state and its own copy of the scalar
    state, so an elementwise optimizer computes exactly what it computes for those parameters in
    torch. Slots without a gradient are not touched at all.
Torch keeps a step count per parameter; we keep one per group while they agree (the common case,
no cost) and a scalar state per slot once they differ (`SlotStates`), collapsing back when they
agree again. Every rank keeps the statuses of all slots of a group, also those outside its shard
(their update is computed on a one-element stand-in), so all ranks agree on the form of a group's
state. A slot that never stepped has no scalar state (None), so its first step starts the
optimizer's state afresh, as in torch. Checkpoints keep per-slot scalars as one scalar entry,
`zeroshard_per_parameter`: parameter name -> its scalars, found by name at any world size and
grouping; a group whose slots agree is saved as before.
"""

from __future__ import annotations

import torch

from zeroshard.core.group import FlatGroup

PER_PARAMETER = "zeroshard_per_parameter"  # the checkpoint's key of per-parameter scalar state


def is_elementwise(value, param: torch.Tensor) -> bool:
    """Optimizer state with one entry per element of `param` (exp_avg, momentum_buffer, ...), as
    opposed to scalars (Adam's 0-dim `step`)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == param.shape


def scalars_of(state: dict | None, param: torch.Tensor) -> dict | None:
    """The scalar part of one optimizer state entry; None when the parameter never stepped."""
    if not state:
        return None
    return {k: v for k, v in state.items() if not is_elementwise(v, param)}


def _key(status: dict | None):
    if status is None:
        return None
    return tuple(sorted((k, float(v)) for k, v in status.items()))


def _copy(status: dict | None) -> dict | None:
    if status is None:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in status.items()}


def slot_ranges(group: FlatGroup) -> list[tuple[int, int, int]]:
    """(slot index, a, b): elements [a, b) of `group.master` belong to that slot."""
    start, end = group.opt_range
    out = []
    for index, slot in enumerate(group.layout.slots):
        lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if lo < hi:
            out.append((index, lo - start, hi - start))
    return out


class SlotStates:
    """Per flat group whose parameters' scalar optimizer states differ: one status per slot (a
    dict of scalars, or None for a slot that never stepped). Groups not listed are uniform: every
    slot has the scalar state the torch optimizer holds for the group."""

    def __init__(self) -> None:
        self.diverged: dict[int, list[dict | None]] = {}

    def statuses(self, group: FlatGroup, uniform: dict | None) -> list[dict | None]:
        return self.diverged.get(id(group)) or [uniform] * len(group.layout.slots)

    def plan(self, group: FlatGroup, seen: list[bool], uniform: dict | None):
        """None: step the whole group as one (every slot got a gradient, one scalar state). Else the
        runs (a, b, status) of master elements to step, in order; [] when none got a gradient."""
        if id(group) not in self.diverged and all(seen):
            return None
        statuses = self.statuses(group, uniform)
        runs: list[list] = []
        for index, a, b in slot_ranges(group):
            if not seen[index]:
                continue
            if runs and runs[-1][1] == a and _key(runs[-1][2]) == _key(statuses[index]):
                runs[-1][1] = b
            else:
                runs.append([a, b, statuses[index]])
        return [(a, b, status) for a, b, status in runs]

    def settle(
        self, group: FlatGroup, uniform: dict | None, seen: list[bool], results: list[tuple[int, int, dict]], advance
    ) -> dict | None:
        """After a stepped plan: every slot that got a gradient anywhere has its new scalar state --
        from this rank's runs where it holds the slot, else `advance(old)` (a scalar state's update
        never depends on gradient values, so every rank computes the same). Statuses cover all
        slots, so every rank agrees whether the group is uniform. Returns the group's one scalar
        state when every slot agrees again, else None."""
        statuses = list(self.statuses(group, uniform))
        exact = {}
        for index, a, b in slot_ranges(group):
            for lo, hi, status in results:
                if lo < b and a < hi:
                    exact[index] = status
        for index, got in enumerate(seen):
            if got:
                statuses[index] = exact[index] if index in exact else advance(statuses[index])
        if len({_key(status) for status in statuses}) == 1:
            self.diverged.pop(id(group), None)
            return _copy(statuses[0])
        self.diverged[id(group)] = statuses
        return None

    def is_uniform(self, group: FlatGroup) -> bool:
        return id(group) not in self.diverged

    # -- the checkpoint form ----------------------------------------------------------------------------
    def expand(self, group: FlatGroup) -> dict:
        """A diverged group's scalar state, one entry per parameter name (None: never stepped);
        the same on every rank, so the checkpoint keeps it once, like any scalar state."""
        statuses = self.diverged[id(group)]
        return {PER_PARAMETER: {slot.name: _copy(status) for slot, status in zip(group.layout.slots, statuses)}}

    def absorb(self, group: FlatGroup, state: dict) -> dict:
        """Inverse of `expand` on loading: takes the per-parameter entry out of `state` (the form
        ZeroOptimizer.group_state returns) and returns the rest, with the one scalar state put
        back when every parameter's agrees."""
        per_parameter = state.get(PER_PARAMETER)
        rest = {k: v for k, v in state.items() if k != PER_PARAMETER}
        self.diverged.pop(id(group), None)
        if per_parameter is None:
            return rest
        missing = [slot.name for slot in group.layout.slots if slot.name not in per_parameter]
        if missing:
            raise ValueError(f"optimizer state '{PER_PARAMETER}' of '{group.names[0]}...' lacks {missing[:3]}")
        statuses = [_copy(per_parameter[slot.name]) for slot in group.layout.slots]
        if len({_key(status) for status in statuses}) == 1:
            return {**rest, **statuses[0]} if statuses[0] is not None else {}
        self.diverged[id(group)] = statuses
        return rest


def step_runs(
    optimizer: torch.optim.Optimizer, param_group: int | None, param: torch.Tensor, grad: torch.Tensor, runs, new_state
) -> list[tuple[int, int, dict]]:
    """Step elements [a, b) of `param` for each run (a, b, status), as the torch optimizer steps
    a parameter of its own whose scalar state is `status` (None: never stepped) and whose
    elementwise state is that slice of `param`'s. `new_state(key, dtype)`: a zero tensor like
    `param`, for state the optimizer creates. Returns (a, b, new scalar state) per run."""
    assert param_group is not None  # FlatGroup.optimizer_group: None only for a frozen group, never stepped
    results = []
    for a, b, status in runs:
        state = optimizer.state.get(param) or {}
        view = param[a:b]
        given = (
            {}
            if status is None
            else {**{k: v[a:b] for k, v in state.items() if is_elementwise(v, param)}, **(_copy(status) or {})}
        )
        optimizer.state[view] = dict(given)
        view.grad = grad[a:b]
        saved = [pg["params"] for pg in optimizer.param_groups]
        try:
            for index, pg in enumerate(optimizer.param_groups):
                pg["params"] = [view] if index == param_group else []
            optimizer.step()
        finally:
            for pg, params in zip(optimizer.param_groups, saved):
                pg["params"] = params
            view.grad = None
            new = optimizer.state.pop(view, {})
        state = optimizer.state.setdefault(param, state)
        for key, value in new.items():
            if is_elementwise(value, view):
                if key not in state:
                    state[key] = new_state(key, value.dtype)
                if given.get(key) is not value:  # replaced, not updated in place (SGD's first momentum)
                    state[key][a:b].copy_(value)
        results.append((a, b, scalars_of(new, view) or {}))
    return results
