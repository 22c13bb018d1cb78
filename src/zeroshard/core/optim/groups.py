"""The user's optimizer re-pointed at the flat master shards; which param group holds a parameter;
whether the optimizer keeps state."""

from __future__ import annotations

import torch

from zeroshard.core.group import FlatGroup
from zeroshard.core.optim.whole import Owned, owned, whole_param_groups


def repoint_optimizer(optimizer: torch.optim.Optimizer, groups: list[FlatGroup]) -> dict[int, list[Owned]]:
    """Point each param group at its flat groups' masters (elementwise), or at the views of the
    parameters this rank owns in them (whole-parameter groups: core/optim/whole.py), which are
    returned by id(flat group)."""
    whole = whole_param_groups(optimizer)
    matrices = {id(g): owned(g) for g in groups if g.optimizer_group in whole}
    for index, param_group in enumerate(optimizer.param_groups):
        mine = [g for g in groups if g.optimizer_group == index]
        if index in whole:
            param_group["params"] = [m.view for g in mine for m in matrices[id(g)]]
        else:
            param_group["params"] = [g.master for g in mine]
    # Some optimizers (Adagrad) create state in their constructor: build a throwaway twin over the
    # shards to get that initial state, keeping the user's object and param-group dicts.
    twin = type(optimizer)([dict(g) for g in optimizer.param_groups])  # type: ignore[call-arg]  # the subclass's constructor: its defaults are its own arguments
    optimizer.state.clear()
    optimizer.state.update(twin.state)
    return matrices


def optimizer_group_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(param) -> index of the param group holding it."""
    index = {}
    for i, param_group in enumerate(optimizer.param_groups):
        for param in param_group["params"]:
            if id(param) in index:
                raise ValueError("a parameter appears in two optimizer param groups")
            index[id(param)] = i
    return index


def keeps_state(optimizer: torch.optim.Optimizer) -> bool:
    """Does this optimizer keep per-parameter state after a step (Adam, SGD with momentum), as
    opposed to none (plain SGD)? Asked of a twin over one element with each param group's
    hyper-parameters, so that the user's optimizer is not touched. Whole-parameter groups (Muon)
    keep a momentum."""
    if whole_param_groups(optimizer):
        return True
    for param_group in optimizer.param_groups:
        probe = torch.zeros(1, requires_grad=True)
        twin = type(optimizer)([{**{k: v for k, v in param_group.items() if k != "params"}, "params": [probe]}])  # type: ignore[call-arg]  # the subclass's constructor: its defaults are its own arguments
        probe.grad = torch.ones(1)
        twin.step()
        if twin.state.get(probe):
            return True
    return False
