"""`zero.GatheredParameters`: full parameters on demand, for custom initialisation, EMA or inspection.

Works on the parameters of a live engine (it enters `engine.gathered_parameters`) and on those of a model
built under `zero.Init` that is not handed to an engine yet ([Note: per-parameter partitioning]).
Parameters that zeroshard does not partition need nothing: for them the context does nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn

from zeroshard.compat.zero import partition as part
from zeroshard.config import ConfigKeyNotActedOnWarning
from zeroshard.core.registry import engine_of


class GatheredParameters:
    """`with GatheredParameters(params, modifier_rank=0): ...` gathers `params` (one parameter or an
    iterable) in full on every rank. On exit, with `modifier_rank` set, that rank's values are broadcast
    and partitioned again (the master weights of an engine take them, so training continues from
    them); without it, changes are discarded where parameters are partitioned. Every rank must enter it."""

    def __init__(
        self, params, modifier_rank: int | None = None, fwd_module: nn.Module | None = None, enabled: bool = True
    ):
        self.params = _unique_params(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._stack = contextlib.ExitStack()
        if fwd_module is not None:
            warnings.warn(
                "zeroshard accepts but does not act on GatheredParameters(fwd_module=...): a parameter "
                "used in another module's forward is not registered to be gathered there",
                ConfigKeyNotActedOnWarning,
                stacklevel=2,
            )

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        engines: dict[int, tuple[Any, list]] = {}  # id(engine) -> (a Sharded, its parameters)
        partitioned = []
        for param in self.params:  # the same order on every rank, so the same collectives
            if part.record_of(param) is not None:
                partitioned.append(param)
            elif (engine := engine_of(param)) is not None:
                engines.setdefault(id(engine), (engine, []))[1].append(param)
        with self._stack as stack:
            for engine, params in engines.values():
                stack.enter_context(engine.gathered_parameters(params, modifier_rank=self.modifier_rank))
            if partitioned:
                stack.enter_context(part.gathered(partitioned, self.modifier_rank))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type, exc, tb):
        return self._stack.__exit__(exc_type, exc, tb)


def _unique_params(params) -> list:
    if params is None:
        return []
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    seen, out = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out
