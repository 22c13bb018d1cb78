"""Block-wise quantized optimizer states: torchao's AdamW8bit, AdamW4bit, AdamWFp8 and their Adam
twins, in the flat form checkpoints hold.

[Note: block-wise optimizer states]
These optimizers keep each moment of a parameter quantized in blocks of `block_size` consecutive
elements of the flattened parameter: one code per element (8 bits; 4 bits, two to a byte; or fp8)
and one fp32 scale per block. A parameter with fewer than 4096 elements, or whose size is not a
multiple of the block, keeps plain fp32 moments. Stepping a flat shard, such an optimizer would see
one tensor per shard: other blocks, other scales, other choices of what to quantize than the same
optimizer stepping the model's parameters. So they are whole-parameter optimizers ([Note: declaring
a whole-parameter optimizer] in declared.py): each parameter lies whole in its owner's slice, the
owner steps it as a tensor of the parameter's shape, and every block, scale and choice is the
one-process optimizer's; the update equals it bit for bit.

A checkpoint re-slices optimizer state by parameter name, element by element ([Note: resharding by
element ranges] in checkpoint/reader.py), so a quantized moment `key` is saved as two elementwise
tensors: `key.codes` (uint8, one code per element, an fp8 code as its bit pattern) and `key.scale`
(fp32, each element its block's scale). That costs 5 bytes per element on disk against the 1.03 (or
0.53) in memory, and it is exact: dequantizing and quantizing again is not (the signed map has +1 and
no -1, so a block whose largest magnitude is negative would come back with another scale).
Loading builds the optimizer's own zero buffer for the parameter and fills its codes and scales.
"""

from __future__ import annotations

from typing import Any

import torch

# The torchao classes (and their subclasses) whose states are block-wise; matched by name, so that
# zeroshard never imports torchao: an optimizer of theirs exists only where the user imported it.
TORCHAO_MODULE = "torchao.optim"
TORCHAO_CLASSES = frozenset({"Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8"})
SIGNED_KEYS = frozenset({"exp_avg"})  # the first moment; the second (and AMSGrad's max) are >= 0
CODES, SCALE = ".codes", ".scale"


def is_torchao_class(cls: type) -> bool:
    return any(c.__module__.startswith(TORCHAO_MODULE) and c.__name__ in TORCHAO_CLASSES for c in cls.__mro__)


def is_blockwise(value: object) -> bool:
    """A quantized state tensor (torchao's OptimState8bit, OptimState4bit, OptimStateFp8)."""
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "block_size")


def state_nbytes(value: Any) -> int:
    """Bytes a state tensor holds: a quantized one's codes and scales, not its fp32 appearance."""
    if is_blockwise(value):
        names, _ = value.__tensor_flatten__()
        return sum(getattr(value, name).numel() * getattr(value, name).element_size() for name in names)
    return value.numel() * value.element_size()


def clone(value: Any) -> torch.Tensor:
    """A copy of a quantized state (torchao's subclasses implement no aten.clone): its inner tensors
    cloned, its attributes kept."""
    names, attributes = value.__tensor_flatten__()
    return type(value).__tensor_unflatten__(
        {name: getattr(value, name).clone() for name in names}, attributes, None, None
    )


def copy_into(destination: Any, source: Any) -> None:
    """`destination`'s codes and scales (and code map) become `source`'s, in place."""
    for name in destination.__tensor_flatten__()[0]:
        getattr(destination, name).copy_(getattr(source, name))


def quantizes(optimizer: torch.optim.Optimizer, shape: torch.Size) -> bool:
    """Does `optimizer` keep a parameter of `shape` in block-wise states? Its own rule, asked of a
    buffer on the meta device (nothing allocated)."""
    new_buffer = getattr(optimizer, "_new_buffer", None)
    if new_buffer is None or not is_torchao_class(type(optimizer)):
        return False
    return is_blockwise(new_buffer(torch.empty(shape, device="meta"), True))


def flat_pieces(key: str, value: Any) -> dict[str, torch.Tensor]:
    """A quantized state of one parameter as elementwise 1-D tensors of its numel ([Note: block-wise
    optimizer states])."""
    numel = value.numel()
    codes = value.codes.reshape(-1)
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)  # fp8: the bit pattern
    if codes.numel() * 2 == numel:  # 4-bit: element 2i in the high nibble, 2i+1 in the low one
        codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).reshape(-1)
    if codes.numel() != numel:
        raise ValueError(f"optimizer state '{key}': {codes.numel()} codes for {numel} elements")
    return {key + CODES: codes, key + SCALE: value.scale.repeat_interleave(value.block_size)}


def new_buffer(optimizer: torch.optim.Optimizer, view: torch.Tensor, key: str) -> Any:
    """The zero buffer a torchao optimizer makes for `view`'s state `key` (quantized or plain, by its rule)."""
    return getattr(optimizer, "_new_buffer")(view, key in SIGNED_KEYS)  # noqa: B009 - a torchao class


def quantized_from(optimizer: torch.optim.Optimizer, view: torch.Tensor, key: str, values: torch.Tensor) -> Any:
    """`values` (plain moments, another optimizer's) in the optimizer's own buffer for `view`'s `key`."""
    buffer = new_buffer(optimizer, view, key)
    buffer.copy_(values.view(view.shape))
    return buffer


def rebuild(optimizer: torch.optim.Optimizer, view: torch.Tensor, key: str, pieces: dict) -> torch.Tensor:
    """The optimizer's own quantized buffer for `view`'s state `key`, filled from `flat_pieces`'s
    form (`pieces`: its two tensors, each of view.numel() elements)."""
    buffer = new_buffer(optimizer, view, key)
    # A checkpoint reader may hand the codes over in the master's dtype: their values, 0-255, are exact.
    codes, scale = pieces[key + CODES].to(torch.uint8), pieces[key + SCALE].to(torch.float32)
    blocks = scale.view(-1, buffer.block_size)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):  # a smaller block_size keeps every value
        raise ValueError(
            f"optimizer state '{key}{SCALE}' is not one scale per block of {buffer.block_size} elements: saved "
            "with a smaller block_size than this optimizer's"
        )
    if buffer.codes.numel() * 2 == codes.numel():
        codes = (codes[0::2] << 4) | codes[1::2]
    buffer.codes.copy_(codes.view(buffer.codes.dtype).view(buffer.codes.shape))
    buffer.scale.copy_(blocks[:, 0])
    return buffer
