"""Muon for the hidden matrices and AdamW for everything else, as one torch optimizer.

Muon is meant for the 2-D weights of hidden layers; embeddings, the output head, biases and norms
take AdamW. Training scripts hold two optimizers for that (torch's documented recipe) or one with
param groups flagged `use_muon` (DeepSpeed's `MuonWithAuxAdam`). zeroshard shards one optimizer, so
`MuonWithAdamW` is the second form built from torch's own classes: its param groups are the dicts a
`torch.optim.Muon` and a `torch.optim.AdamW` step (the same objects, so LR schedulers built against
either drive this one), and its state is theirs. `combine(muon, adamw)` makes one from the two
optimizers of the first form; the numbers are those of stepping the two. The Muon half may be another
class a user declared (core/optim/declared.py), a Muon variant taking Muon's group keys.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.core.optim.declared import class_rule, register_whole_parameter_optimizer, whole_groups_rule

__all__ = ["MuonWithAdamW", "as_one_optimizer"]

# DeepSpeed's MuonWithAuxAdam defaults for a group that does not set them.
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}
ADAMW_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over param groups that each say `use_muon`: True groups are stepped by
    `torch.optim.Muon` (2-D parameters only), False ones by `torch.optim.AdamW`. A group's other
    keys are that optimizer's hyper-parameters; those it leaves out take DeepSpeed's defaults
    (Muon lr 0.02, momentum 0.95, weight_decay 0; AdamW lr 3e-4, betas (0.9, 0.95), eps 1e-10,
    weight_decay 0), then torch's. `muon`: the class of the Muon half (torch's by default; another
    must be declared with `zeroshard.register_whole_parameter_optimizer`)."""

    def __init__(self, params: Any, muon: type[torch.optim.Optimizer] = torch.optim.Muon):
        if not (isinstance(muon, type) and issubclass(muon, torch.optim.Optimizer)) or class_rule(muon) is None:
            raise ValueError(
                f"MuonWithAdamW(muon={muon!r}): the Muon half must be torch.optim.Muon or a class declared with "
                "zeroshard.register_whole_parameter_optimizer"
            )
        self.muon_class = muon
        groups = list(params)
        if not groups or not all(isinstance(g, dict) and isinstance(g.get("use_muon"), bool) for g in groups):
            raise ValueError(
                "MuonWithAdamW takes a list of param-group dicts, each with 'use_muon': True (Muon) or False (AdamW)"
            )
        for group in groups:
            for key, value in (MUON_DEFAULTS if group["use_muon"] else ADAMW_DEFAULTS).items():
                group.setdefault(key, value)
        super().__init__(groups, {})
        matrices = [g for g in self.param_groups if g["use_muon"]]
        others = [g for g in self.param_groups if not g["use_muon"]]
        # torch's optimizers keep the dicts they are given: one set of dicts, stepped by two optimizers
        self.muon = self.muon_class(matrices) if matrices else None  # type: ignore[call-arg]  # a Muon-like class
        self.adamw = torch.optim.AdamW(others) if others else None
        self._share_state()

    @classmethod
    def combine(cls, *optimizers: torch.optim.Optimizer) -> MuonWithAdamW:
        """One optimizer stepping what `optimizers` (a torch Muon and a torch AdamW, in any order)
        step, over their param-group dicts, with their hyper-parameters."""
        adamw = [o for o in optimizers if type(o) is torch.optim.AdamW]
        muon = [o for o in optimizers if type(o) is not torch.optim.AdamW]
        if len(adamw) > 1 or len(muon) != 1 or whole_groups_rule(muon[0]) is None or isinstance(muon[0], cls):
            kinds = [type(o).__name__ for o in optimizers]
            raise ValueError(
                f"optimizers {kinds}: zeroshard takes a list of optimizers as one torch.optim.Muon (the "
                "matrices; or a Muon class declared with zeroshard.register_whole_parameter_optimizer) and "
                "one torch.optim.AdamW (the other parameters)"
            )
        for optimizer in optimizers:
            if any(optimizer.state.values()):
                raise ValueError(
                    f"{type(optimizer).__name__} already has state: combine optimizers before their first step"
                )
        groups = []
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["use_muon"] = optimizer is muon[0]
                groups.append(group)
        return cls(groups, muon=type(muon[0]))

    def _share_state(self) -> None:
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share_state()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._share_state()  # whoever replaced `state` (torch's load_state_dict does) replaced it for both
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.step()
        return loss


register_whole_parameter_optimizer(MuonWithAdamW, lambda group: bool(group["use_muon"]))


def as_one_optimizer(optimizer):
    """The one torch optimizer zeroshard shards: `optimizer` itself, or a list/tuple of a Muon and
    an AdamW combined (`MuonWithAdamW.combine`)."""
    if isinstance(optimizer, (list, tuple)):
        return optimizer[0] if len(optimizer) == 1 else MuonWithAdamW.combine(*optimizer)
    return optimizer
