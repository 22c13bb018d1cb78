"""The user's optimizer re-pointed at the flat master shards; which param group holds a parameter;
whether the optimizer keeps state."""

from __future__ import annotations

import torch

from zeroshard.core.group import FlatGroup


def repoint_optimizer(optimizer: torch.optim.Optimizer, groups: list[FlatGroup]) -> None:
    for index, param_group in enumerate(optimizer.param_groups):
        param_group["params"] = [g.master for g in groups if g.optimizer_group == index]
    # Some optimizers (Adagrad) create state in their constructor: build a throwaway twin over the
    # shards to get that initial state, keeping the user's object and param-group dicts.
    twin = type(optimizer)([dict(g) for g in optimizer.param_groups])  # type: ignore[call-arg]  # the subclass's constructor: its defaults are its own arguments
    optimizer.state.clear()
    optimizer.state.update(twin.state)


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
    hyper-parameters, so that the user's optimizer is not touched."""
    for param_group in optimizer.param_groups:
        probe = torch.zeros(1, requires_grad=True)
        twin = type(optimizer)([{**{k: v for k, v in param_group.items() if k != "params"}, "params": [probe]}])  # type: ignore[call-arg]  # the subclass's constructor: its defaults are its own arguments
        probe.grad = torch.ones(1)
        twin.step()
        if twin.state.get(probe):
            return True
    return False
