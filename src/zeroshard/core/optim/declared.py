"""Which optimizers update whole parameters: torch's Muon, and the classes users declare.

[Note: declaring a whole-parameter optimizer]
An optimizer whose update of a parameter reads that whole parameter (its gradient, its state) but
no other parameter -- Muon, or a user's variant of it -- runs under every stage: its param groups
get owner-aligned layouts and each rank steps the parameters it owns, whole (core/optim/whole.py).
zeroshard cannot see that property in a class, so it knows torch's Muon, MuonWithAdamW (its
`use_muon` groups), torchao's block-wise AdamW8bit, AdamW4bit, AdamWFp8 and their Adam twins
([Note: block-wise optimizer states] in lowbit.py) and bitsandbytes' 8-bit optimizers ([Note:
bitsandbytes' 8-bit states] in lowbit.py), and a user declares any other class with
`register_whole_parameter_optimizer`,
saying which of its param groups need whole parameters (all by default); the others must be
elementwise. An optimizer that reads across parameters (a global norm, a trust ratio over several
tensors) must not be declared: each rank would compute it from the parameters it owns only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.core.optim.lowbit import is_bnb_class, is_torchao_class

__all__ = ["register_whole_parameter_optimizer"]


def _every_group(group: dict) -> bool:
    return True


_RULES: dict[type, Callable[[dict], bool]] = {torch.optim.Muon: _every_group}


def register_whole_parameter_optimizer(
    cls: type[torch.optim.Optimizer], groups: Callable[[dict], bool] | None = None
) -> None:
    """Declare that `cls` (and its subclasses) updates each parameter of the param groups for which
    `groups(param_group)` is true (default: every group) from that parameter alone, as a function of
    the whole tensor: zeroshard then gives each such parameter one owning rank, which steps it whole,
    at every stage ([Note: declaring a whole-parameter optimizer]). Its other param groups must be
    elementwise: zeroshard steps them on flat shards."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_whole_parameter_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}")
    if groups is not None and not callable(groups):
        raise TypeError(
            f"register_whole_parameter_optimizer: groups must be a callable(param_group) -> bool, got {groups!r}"
        )
    _RULES[cls] = groups if groups is not None else _every_group


def whole_groups_rule(optimizer: object) -> Callable[[dict], bool] | None:
    """Which of `optimizer`'s param groups need whole parameters, or None: an optimizer nobody declared."""
    return class_rule(type(optimizer))


def class_rule(cls: type) -> Callable[[dict], bool] | None:
    """The declaration of `cls` or of its nearest declared base class; None where there is none."""
    declared = next((_RULES[c] for c in cls.__mro__ if c in _RULES), None)
    if declared is None and (is_torchao_class(cls) or is_bnb_class(cls)):
        return _every_group
    return declared


def declared_classes() -> tuple[type, ...]:
    return tuple(_RULES)
