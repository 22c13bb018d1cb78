"""4-bit weights in the layout of torch's packed int4 CPU matmul (`torch._weight_int4pack_mm_for_cpu`),
so a Linear layer multiplies by them without a dequantized copy: pure arithmetic.

[Note: the int4 kernel's layout]
The kernel takes a weight (out N, in K) as uint8 (N, K/2) and bf16 scales and zeros (K/g, N, 2) for
groups of g along K, and computes x @ W^T with W[n, k] = (q[n, k] - 8) * scale + zero, where q is
the 4-bit code; activations are bf16 (its fp32 path has no vectorized kernel: 30x slower at batch
1), accumulation fp32, the output bf16. Codes are interleaved in blocks of B output rows: for the
block of rows [bB, bB + B) and each k, B/2 bytes, byte j holding row bB + j in its low nibble and
row bB + B/2 + j in its high one. B depends on the CPU code torch dispatches to (64 with AVX-512,
32 with AVX2, another order on the generic path), so the layout is probed once against torch's own
converter (`torch._convert_weight_to_int4pack_for_cpu`, which needs int32 codes, 4 bytes an element)
and only a block size the probe confirms is used; `kernel_block()` is None elsewhere, and weights
are then dequantized as usual. Our group-wise codes map onto the kernel's form exactly:
asymmetric x' = q * s + m = (q - 8) * s + (m + 8 s), symmetric (stored offset 8) x' = (q - 8) * s;
only s and m + 8 s are rounded to bf16 (relative 2^-9, a small fraction of a 4-bit step).
"""

from __future__ import annotations

import functools

import torch

from zeroshard.inference.quantization import Quantized, QuantSpec

KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the kernel takes
_BLOCKS = (64, 32)  # block sizes of the layouts we know (AVX-512, AVX2)


def _interleave(codes: torch.Tensor, block: int) -> torch.Tensor:
    """uint8 codes (N, K) in [0, 16) -> the kernel's packed (N, K/2)."""
    n, k = codes.shape
    v = codes.view(n // block, 2, block // 2, k)
    low, high = v[:, 0].transpose(1, 2), v[:, 1].transpose(1, 2)  # (N/B, K, B/2)
    return torch.bitwise_or(low, torch.bitwise_left_shift(high, 4)).reshape(n, k // 2)


def _deinterleave(packed: torch.Tensor, block: int) -> torch.Tensor:
    """The kernel's packed (N, K/2) -> uint8 codes (N, K)."""
    n, half = packed.shape
    k = half * 2
    v = packed.view(n // block, k, block // 2)
    out = torch.empty(n // block, 2, block // 2, k, dtype=torch.uint8)
    torch.bitwise_and(v, 0x0F, out=out[:, 0].transpose(1, 2))
    torch.bitwise_right_shift(v, 4, out=out[:, 1].transpose(1, 2))
    return out.view(n, k)


@functools.cache
def kernel_block() -> int | None:
    """The block size of the int4 kernel's layout on this CPU, or None when it is not one we know
    ([Note: the int4 kernel's layout])."""
    convert = getattr(torch, "_convert_weight_to_int4pack_for_cpu", None)
    if convert is None or not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return None
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=generator)
    try:
        theirs = convert(codes, 1)
    except RuntimeError:
        return None
    for block in _BLOCKS:
        if torch.equal(_interleave(codes.to(torch.uint8), block), theirs):
            return block
    return None


def eligible(shape, spec: QuantSpec, block: int | None) -> bool:
    """Can a parameter of `shape` live in the kernel's layout: a Linear weight (out, in) with groups
    along the input features, of a size the kernel takes, in whole blocks of rows."""
    return (
        block is not None
        and spec.num_bits == 4
        and len(shape) == 2
        and spec.group_dim == 1
        and spec.group_size in KERNEL_GROUPS
        and shape[1] % spec.group_size == 0
        and shape[0] % block == 0
    )


def to_kernel(q: Quantized, block: int, codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
    """Write `q` (4 bits, groups along dim 1 of an (N, K) weight) in the kernel's form: packed codes
    into `codes_out` (uint8 (N, K/2)), scales and zeros into `scales_out` (bf16 (K/g, N, 2))."""
    n, k = q.shape
    codes = torch.empty(n * k, dtype=torch.uint8)
    codes[0::2] = q.packed & 0x0F
    codes[1::2] = q.packed >> 4
    codes_out.copy_(_interleave(codes.view(n, k), block))
    scale = q.scale  # (N, K/g)
    zero = torch.zeros_like(scale) if q.minimum is None else q.minimum + 8 * scale
    scales_out.copy_(torch.stack([scale.t(), zero.t()], dim=2))


def dequantize_kernel(codes: torch.Tensor, scales: torch.Tensor, group: int, block: int, out: torch.Tensor) -> None:
    """The fp32 weight (N, K) the kernel multiplies by, into `out`: (q - 8) * scale + zero."""
    n, k = out.shape
    q = _deinterleave(codes, block).view(n, k // group, group)
    grouped = out.view(n, k // group, group)
    grouped.copy_(q).sub_(8)
    grouped.mul_(scales[:, :, 0].t().float()[:, :, None])
    grouped.add_(scales[:, :, 1].t().float()[:, :, None])


def rows(codes: torch.Tensor, scales: torch.Tensor, group: int, block: int, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (any shape of int64) of the fp32 weight the kernel's form stands for, shaped
    (*index.shape, K): the same values `dequantize_kernel` gives those rows (an embedding lookup)."""
    n, half = codes.shape
    k = half * 2
    flat = index.reshape(-1)
    within = flat % block
    picked = codes.view(n // block, k, block // 2)[flat // block, :, within % (block // 2)]  # (L, K) bytes
    high = (within >= block // 2)[:, None]
    q = torch.where(high, torch.bitwise_right_shift(picked, 4), torch.bitwise_and(picked, 0x0F))
    out = torch.empty(flat.numel(), k // group, group, dtype=torch.float32)
    out.copy_(q.view(flat.numel(), k // group, group)).sub_(8)
    chosen = scales[:, flat, :].float()  # (K/g, L, 2)
    out.mul_(chosen[:, :, 0].t()[:, :, None])
    out.add_(chosen[:, :, 1].t()[:, :, None])
    return out.view(*index.shape, k)


def linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int, bias: torch.Tensor | None):
    """x @ W^T (+ bias) with W in the kernel's form; activations go through bf16, the result comes
    back in x's dtype."""
    n = codes.shape[0]
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch._weight_int4pack_mm_for_cpu(flat, codes, group, scales).to(x.dtype).view(*x.shape[:-1], n)
    if bias is not None:
        out += bias
    return out
