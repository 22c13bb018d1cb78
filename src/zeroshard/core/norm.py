"""The fp64 sum of squares the gradient norm is made of, chunk by chunk through a kept scratch."""
from __future__ import annotations

import torch

# fp64 squares are summed chunk by chunk through one scratch buffer of this many elements: 1 MiB
# stays in cache, so the fp32 -> fp64 copy and the dot product that reads it back cost a pass over
# the gradient each (profiled in docs/performance.md: 20x faster than `chunk.double().pow(2).sum()`
# over 4M-element chunks, which allocated and wrote two fp64 temporaries per chunk).
_NORM_CHUNK = 1 << 17


def sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """sum(x ** 2) over a 1-D tensor, in fp64 (0-dim, on the tensor's device). Each fp32 square is
    exact in fp64 (24-bit mantissas), so only the summation order differs from an fp64 reference."""
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    if tensor.numel() == 0:
        return total
    scratch = torch.empty(min(_NORM_CHUNK, tensor.numel()), dtype=torch.float64, device=tensor.device)
    for chunk in tensor.split(_NORM_CHUNK):
        wide = scratch[: chunk.numel()]
        wide.copy_(chunk)
        total += torch.dot(wide, wide)
    return total
