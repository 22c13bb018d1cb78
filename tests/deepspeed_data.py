"""The checkpoints DeepSpeed itself wrote, in tests/data/deepspeed/ (tests/test_deepspeed_checkpoints.py
resumes them; tests/test_inference.py loads them for inference): their directory, the module of the
model they were made with, and DeepSpeed's full fp32 weights at each save."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data" / "deepspeed"
_spec = importlib.util.spec_from_file_location("tiny_model", DATA / "tiny_model.py")
tm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tm)


def reference_weights(source: str) -> dict:
    """DeepSpeed's full fp32 weights at the save: its zero_to_fp32 output, or, for the checkpoint
    zero_to_fp32 does not read (BF16_Optimizer), the masters its running engine held."""
    file = DATA / source / "zero_to_fp32.pt"
    return torch.load(file if file.is_file() else DATA / source / "masters.pt", weights_only=True)
