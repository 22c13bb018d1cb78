"""Generation on a sharded model: transformers' `generate` on the module of a core `Sharded`, safe on
several stage-3 ranks, where every forward is a collective."""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch

from zeroshard.core.sharded import Sharded

GATHER = ("units", "whole")


def generate(sharded: Sharded, *args, gather: str = "units", **kwargs):
    """`sharded.module.generate(*args, **kwargs)` under `torch.no_grad()`. `gather` says how stage 3
    gathers: "units", each unit for each forward (then `synced_gpus` defaults to True on several
    ranks, so that a rank whose sequences end first keeps running the forwards, collectives, the
    others need: transformers turns it on only for DeepSpeed and FSDP), or "whole", the whole model
    once for the call (`Sharded.gathered_model`), which needs no collective per token. Nothing stays
    gathered afterwards, even on error. The train/eval mode is left as it is."""
    whole = sharded.policy.shard_parameters and gather == "whole"
    if sharded.policy.shard_parameters and sharded.comm.world_size > 1 and not whole:
        kwargs.setdefault("synced_gpus", True)
    module = cast(Any, sharded.module)  # a transformers model: generate
    try:
        with torch.no_grad(), sharded.gathered_model() if whole else contextlib.nullcontext():
            return module.generate(*args, **kwargs)
    finally:
        for unit in sharded._units:  # a forward that raised may have left its unit gathered
            unit.reshard()
