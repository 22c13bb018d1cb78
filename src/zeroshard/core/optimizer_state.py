"""The optimizer's state per flat group, in the form checkpoints save and load (the checkpoint
contract): a mixin of ZeroOptimizer, which provides `groups`, `optimizer`, `streamed`,
`slot_states` and `param_groups`."""

from __future__ import annotations

import torch

from zeroshard.core.group import FlatGroup
from zeroshard.core.streamed import is_elementwise


class CheckpointState:
    """group_state / load_group_state and torch's state_dict / load_state_dict over them."""

    def group_state(self, group: FlatGroup) -> dict:
        """The optimizer state of one flat group as if the torch optimizer stepped `group.master` in
        one piece: elementwise tensors (1-D, numel = master.numel()) and scalars (Adam's `step`),
        whatever sub-groups the streamed step cuts it into. {} before the first step."""
        state = (
            self.streamed.state_of(group)
            if self.streamed is not None
            else dict(self.optimizer.state.get(group.master, {}))
        )
        if not self.slot_states.is_uniform(group):
            state = {k: v for k, v in state.items() if is_elementwise(v, group.master)}
            state.update(self.slot_states.expand(group))
        return state

    def load_group_state(self, group: FlatGroup, state: dict) -> None:
        """Replace one group's optimizer state with `state` (the form `group_state` returns)."""
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and not is_elementwise(value, group.master):
                raise ValueError(
                    f"optimizer state '{key}' of '{group.names[0]}...' has {value.numel()} elements, "
                    f"the group's shard has {group.master.numel()}"
                )
        state = self.slot_states.absorb(group, state)
        if self.streamed is not None:
            self.streamed.load_state(group, state)
        elif state:  # copies, as torch's load_state_dict makes: the caller keeps its tensors
            self.optimizer.state[group.master] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
        else:
            self.optimizer.state.pop(group.master, None)

    def state_dict(self) -> dict:
        """This rank's optimizer state in torch's form: `state` maps the index of each trainable flat
        group to its `group_state`; `param_groups` holds the hyper-parameters and, as `params`, the
        indices of the flat groups each optimizer param group steps."""
        param_groups = []
        for index, param_group in enumerate(self.param_groups):
            saved = {k: v for k, v in param_group.items() if k != "params"}
            saved["params"] = [i for i, g in enumerate(self.groups) if g.optimizer_group == index]
            param_groups.append(saved)
        return {
            "state": {i: self.group_state(group) for i, group in enumerate(self.groups)},
            "param_groups": param_groups,
        }

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` for the same layout (same world size, stage and model)."""
        saved_groups = state["param_groups"]
        if len(state["state"]) != len(self.groups) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state of {len(state['state'])} flat groups and {len(saved_groups)} param "
                f"groups does not fit this optimizer ({len(self.groups)} and {len(self.param_groups)})"
            )
        for param_group, saved in zip(self.param_groups, saved_groups):
            param_group.update({k: v for k, v in saved.items() if k != "params"})
        for index, group in enumerate(self.groups):
            self.load_group_state(group, state["state"][index])
