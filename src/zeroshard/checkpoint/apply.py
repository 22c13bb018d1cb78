"""The last phase of every load: what was read, put into the engine at once.

[Note: a failed load changes nothing]
Reading can fail half-way on any rank (a file deleted or damaged after verification, an I/O
error, verify=False). So a load (load.py, deepspeed_load.py, dcp.py) reads into new tensors only,
collected in a `Loaded`, and the engine's masters, optimizer state, accumulated gradients and
buffers are replaced (`apply_loaded`, no I/O from the checkpoint) only after every rank has agreed
that all of its reads succeeded. The price: while loading, a rank holds the loaded states beside
its current ones (for Adam, 12 bytes per element of its shard more, transiently).

[Note: a load hands its tensors over]
The optimizer state a load read is new tensors of its own, one set per group, dropped once applied.
So `apply_loaded` gives them to the optimizer (`load_group_state(..., take=True)`) instead of having
it copy them as torch's load_state_dict would: a copy would cost the time of one more pass over the
states and, while it is made, their memory a third time (current, read, copied).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Loaded:
    """Everything one rank read for a load, not yet applied."""

    copies: list = field(default_factory=list)  # (destination, loaded value): masters, grads, buffers
    states: list = field(default_factory=list)  # (group, optimizer state to load_group_state)
    grads: list = field(default_factory=list)  # groups whose accumulated gradients were read


@torch.no_grad()
def apply_loaded(engine, loaded: Loaded) -> None:
    for destination, value in loaded.copies:
        destination.copy_(value)
    for group in loaded.grads:  # which parameters had a gradient ([Note: parameters without a gradient])
        group.note_loaded_grads()
    for group, state in loaded.states:
        engine.optimizer.load_group_state(group, state, take=True)  # [Note: a load hands its tensors over]


def restore_param_groups(engine, saved: list[dict]) -> None:
    """Hyper-parameters (lr, betas, weight decay, ...), as torch's Optimizer.load_state_dict does."""
    for group, values in zip(engine.optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})
