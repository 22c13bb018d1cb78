"""`deepspeed.utils.zero_to_fp32`: a sharded checkpoint as one fp32 state dict, without a process group.

DeepSpeed's names, over zeroshard's consolidation (checkpoint/consolidate.py), which streams group by
group with memory bounded by the largest group.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from zeroshard.checkpoint.consolidate import consolidate

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (the model's own keys) of the checkpoint `tag` (default: `latest`) in
    `checkpoint_dir`, in memory. `exclude_frozen_parameters` and `lazy_mode` change nothing here:
    every parameter is written, and the result is a plain dict of tensors."""
    with tempfile.TemporaryDirectory(prefix="zeroshard-fp32-") as tmp:
        path = Path(tmp) / "model.pt"
        consolidate(checkpoint_dir, path, tag=tag, fmt="pt", progress=False)
        return torch.load(path, map_location="cpu", weights_only=True)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size: str = "5GB",
    safe_serialization: bool = False,
    tag=None,
    exclude_frozen_parameters: bool = False,
) -> str:
    """Write the full fp32 state dict to `output_dir` (`model.safetensors` with `safe_serialization`,
    else `pytorch_model.bin`), or to `output_dir` itself when it names a file (.bin, .pt, .safetensors:
    DeepSpeed's older signature). One file whatever `max_shard_size`. Returns the path written."""
    output = Path(output_dir)
    if output.suffix not in _FILE_SUFFIXES:
        os.makedirs(output, exist_ok=True)
        output = output / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    consolidate(checkpoint_dir, output, tag=tag, progress=False)
    return str(output)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into `model` (a plain module, not an engine) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    model.load_state_dict(state, strict=False)
    return model
