"""`deepspeed.utils.module_utils`, also served as `deepspeed.compression.helper` (where DeepSpeed-Chat's
LoRA module imports them from): get or replace a submodule by its dotted name."""

from __future__ import annotations

from torch import nn

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: nn.Module, module_name: str):
    """`model.a.b.c` for `module_name` "a.b.c"."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: nn.Module, module_name: str, module) -> None:
    """Sets `model.a.b.c = module` for `module_name` "a.b.c"."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)
