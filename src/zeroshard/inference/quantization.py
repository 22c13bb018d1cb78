"""Group-wise 8- and 4-bit weight quantization, the form DeepSpeed's ZeRO-Inference
(`weight_quantization.quantized_initialization`) and FlexGen store weights in: pure arithmetic.

[Note: group-wise weight quantization]
A tensor is cut into groups of `group_size` consecutive elements along `group_dim` (DeepSpeed's
`group_dim` 1: along the input features of a Linear weight, shape (out, in)); a row whose length is
not a multiple of the group size ends in a shorter group. Each group g keeps its own fp32 scale s_g:
  * asymmetric (`symmetric` False, DeepSpeed's and FlexGen's default): with m_g the group's minimum,
    s_g = (max_g - m_g) / (2^bits - 1), a code q = round((x - m_g) / s_g) in [0, 2^bits - 1], and
    x' = q * s_g + m_g;
  * symmetric: s_g = max|x| / (2^(bits-1) - 1), q = round(x / s_g) in [-(2^(bits-1) - 1),
    2^(bits-1) - 1], stored offset by 2^(bits-1), and x' = (q - offset) * s_g.
Rounding to nearest bounds every element's error by s_g / 2 (`error_bound`); a constant group
(s_g = 0) comes back exactly. Codes are packed: 8 bits one per byte, 4 bits two per byte (the first
code in the low nibble). Per element, int4 with group 64 and a minimum costs 0.5 + 8/64 = 0.625
bytes, 3.2x less than fp16; int8 1.125 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (8, 4)


@dataclass(frozen=True)
class QuantSpec:
    """DeepSpeed's `quantized_initialization` keys: `num_bits` 8 or 4, `group_size`, `group_dim`,
    `symmetric`. Invalid values raise ValueError naming the key, the value and what is allowed."""

    num_bits: int = 8
    group_size: int = 64
    group_dim: int = 1
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.num_bits not in BITS:
            raise ValueError(f"num_bits={self.num_bits!r}: allowed 8 or 4")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r}: a positive integer")
        if not isinstance(self.group_dim, int) or isinstance(self.group_dim, bool) or self.group_dim < 0:
            raise ValueError(f"group_dim={self.group_dim!r}: a dimension index >= 0")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric={self.symmetric!r}: true or false")

    @property
    def levels(self) -> int:
        return (1 << self.num_bits) - 1 if not self.symmetric else (1 << (self.num_bits - 1)) - 1


@dataclass
class Quantized:
    """One tensor in group-wise quantized form ([Note: group-wise weight quantization])."""

    packed: torch.Tensor  # uint8, 1-D: the codes, packed
    scale: torch.Tensor  # fp32, (rows, groups per row)
    minimum: torch.Tensor | None  # fp32, like scale; None when symmetric
    shape: torch.Size  # of the original tensor
    spec: QuantSpec

    @property
    def nbytes(self) -> int:
        extra = self.minimum.numel() * 4 if self.minimum is not None else 0
        return self.packed.numel() + self.scale.numel() * 4 + extra


def _rows(tensor: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """`tensor` as (rows, length along group_dim), group_dim last."""
    if tensor.dim() <= spec.group_dim:
        raise ValueError(
            f"group_dim={spec.group_dim} is not a dimension of a tensor of shape {list(tensor.shape)}: "
            f"allowed 0 to {tensor.dim() - 1}"
        )
    moved = tensor.movedim(spec.group_dim, -1)
    return moved.reshape(-1, moved.shape[-1]) if moved.dim() > 1 else moved.reshape(1, -1)


def _grouped(rows: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, groups, group) fp32 with a short last group padded by its own last element (so its
    minimum and maximum do not change), and the mask of real elements."""
    length = rows.shape[1]
    groups = -(-length // group)
    pad = groups * group - length
    values = rows.float()
    if pad:
        values = torch.cat([values, values[:, -1:].expand(-1, pad)], dim=1)
    mask = torch.ones(groups * group, dtype=torch.bool, device=rows.device)
    if pad:
        mask[length:] = False
    return values.view(rows.shape[0], groups, group), mask


def quantize(tensor: torch.Tensor, spec: QuantSpec) -> Quantized:
    """`tensor` (floating point, any shape with a `spec.group_dim`) in group-wise quantized form."""
    if not tensor.is_floating_point():
        raise ValueError(f"quantize takes a floating-point tensor, got {tensor.dtype}")
    rows = _rows(tensor.detach(), spec)
    values, mask = _grouped(rows, spec.group_size)  # (R, G, g)
    if spec.symmetric:
        scale = values.abs().amax(dim=2) / spec.levels  # (R, G)
        minimum = None
        shifted = values
    else:
        low, high = values.amin(dim=2), values.amax(dim=2)
        scale = (high - low) / spec.levels
        minimum = low
        shifted = values - low[:, :, None]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: codes 0 (or offset)
    codes = (shifted / safe[:, :, None]).round_()
    if spec.symmetric:
        codes = codes.clamp_(-spec.levels, spec.levels).add_(spec.levels + 1)  # stored unsigned
    else:
        codes = codes.clamp_(0, spec.levels)
    codes = codes.view(rows.shape[0], -1)[:, mask].reshape(-1).to(torch.uint8)  # real elements only
    return Quantized(_pack(codes, spec.num_bits), scale, minimum, tensor.shape, spec)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor `q` stands for, in `dtype`, shaped as it was."""
    spec = q.spec
    moved_shape = list(q.shape)
    length = moved_shape.pop(spec.group_dim)
    rows = math.prod(moved_shape) if moved_shape else 1
    groups = -(-length // spec.group_size)
    codes = unpack_codes(q.packed, spec.num_bits, rows * length).view(rows, length).float()
    if spec.symmetric:
        codes -= spec.levels + 1
    scale = q.scale.repeat_interleave(spec.group_size, dim=1)[:, :length]  # (R, length)
    values = codes * scale
    if q.minimum is not None:
        values += q.minimum.repeat_interleave(spec.group_size, dim=1)[:, :length]
    assert q.scale.shape == (rows, groups), (q.scale.shape, rows, groups)
    return values.view(*moved_shape, length).movedim(-1, spec.group_dim).to(dtype)


def error_bound(q: Quantized) -> torch.Tensor:
    """The largest error round-to-nearest allows each element (s_g / 2), shaped like the tensor."""
    spec = q.spec
    moved_shape = list(q.shape)
    length = moved_shape.pop(spec.group_dim)
    half = (q.scale / 2).repeat_interleave(spec.group_size, dim=1)[:, :length]
    return half.reshape(*moved_shape, length).movedim(-1, spec.group_dim)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return codes[0::2] | (codes[1::2] << 4)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    if bits == 8:
        return packed[:count]
    out = torch.empty(packed.numel() * 2, dtype=torch.uint8, device=packed.device)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return out[:count]
