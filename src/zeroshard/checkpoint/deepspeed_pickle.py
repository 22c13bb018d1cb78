"""Loading DeepSpeed's checkpoint files safely, without DeepSpeed installed.

[Note: safe loading of DeepSpeed pickles]
DeepSpeed writes its checkpoint files with torch.save, which pickles: a file found on a shared disk
could run any code at `torch.load(weights_only=False)`. We load with `weights_only=True` (tensors,
containers and numbers only) and allow, by name, exactly the few DeepSpeed types its ZeRO
checkpoints hold; each is received by a stand-in class of ours registered under DeepSpeed's
qualified name (torch's `safe_globals([(stand_in, "deepspeed....Name")])`), so the stand-in is what
the unpickler builds and DeepSpeed is never imported. Any other global is refused, with an error
that names the file and the type. The stand-ins only hold the attributes DeepSpeed pickled; the
loader reads the few it needs (the loss scaler's state) and ignores the rest.
"""

from __future__ import annotations

import enum
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.checkpoint.files import CheckpointError


class PickledObject:
    """A DeepSpeed object as pickled: its attributes, nothing else (no behaviour)."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class DeepSpeedLossScaler(PickledObject):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler (static) or DynamicLossScaler: cur_scale,
    cur_iter, last_overflow_iter, cur_hysteresis, ... as attributes."""


class ZeroStageEnum(int, enum.Enum):
    """deepspeed.runtime.zero.config.ZeroStageEnum, pickled as a call with the stage number."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclass
class FragmentAddress:
    """deepspeed.utils.tensor_fragment.fragment_address (stage 1/2 `param_slice_mappings`)."""

    numel: int = 0
    start: int = 0


# The allow-list: every non-torch type a DeepSpeed 0.19 ZeRO checkpoint holds, and what receives it.
ALLOWED = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": DeepSpeedLossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DeepSpeedLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load(path: Path, mmap: bool = True) -> dict:
    """One DeepSpeed checkpoint file, loaded safely (see [Note: safe loading of DeepSpeed pickles]).
    `mmap`: tensors stay in the file until read, so memory holds what is used, not the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    try:
        with torch.serialization.safe_globals([(cls, name) for name, cls in ALLOWED.items()]):
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointError(_refusal(path, error)) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(
            f"{path}: not a readable torch.save file ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a {type(value).__name__}, not the dict DeepSpeed writes")
    return value


def _refusal(path: Path, error: Exception) -> str:
    found = _GLOBAL.search(str(error))
    if found is not None:
        what = f"the type '{found.group(1)}'"
    else:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - the file is damaged as well; say what we know
            unsafe = []
        what = f"the type(s) {unsafe}" if unsafe else f"content torch refuses ({str(error).splitlines()[0]})"
    return (
        f"{path}: refused to load: it contains {what}, which is not one of the types DeepSpeed "
        f"checkpoints hold (tensors, containers, numbers and {', '.join(sorted(ALLOWED))}). "
        "Loading it would run code chosen by whoever wrote the file"
    )
