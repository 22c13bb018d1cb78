"""The fp64 sum of squares the gradient norm is made of, and the stage-0 norm summed when asked."""

from __future__ import annotations

import math
import warnings

import torch

# fp64 squares are summed chunk by chunk through one scratch buffer of this many elements: 1 MiB
# stays in cache, so the fp32 -> fp64 copy and the dot product that reads it back cost a pass over
# the gradient each, where `chunk.double().pow(2).sum()` over large chunks writes two fp64
# temporaries and reads them back from memory (measured: docs/performance.md, "The fp64 norm through
# a 1 MiB scratch").
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


# [Note: the stage-0 norm, computed when asked]
# At stage 0 every rank holds the whole reduced gradient, and the step needs the norm only to clip
# or unscale. Summing it every step for get_global_grad_norm() would cost a pass over the gradient
# that a DDP script that does not clip never spends (measured: docs/performance.md), and DeepSpeed's
# stage-0 engine reports None there. So without clipping or loss scaling the step keeps the gradient
# tensors and their version counters, and the norm is summed when first asked, by each rank from its
# own copy: no collective, so a rank that logs alone may ask. Stage 0 keeps its gradient buffer
# across steps ([Note: zeroed when first read]), so holding it costs no memory. Anything that writes
# the buffer (the next backward, a checkpoint load) moves the version; asked after that, the norm is
# gone: None, and a warning says when to ask.
class NormWhenAsked:
    """The global gradient norm of one stage-0 step, summed on first request."""

    def __init__(self, grads: list[torch.Tensor]):
        self.grads = list(grads)
        self.versions = [grad._version for grad in self.grads]
        self.norm: float | None = None if self.grads else 0.0

    def value(self) -> float | None:
        if self.norm is None and self.grads:
            if any(grad._version != version for grad, version in zip(self.grads, self.versions)):
                self.grads = []
                warnings.warn(
                    "get_global_grad_norm(): at stage 0 without gradient clipping the norm is "
                    "computed when asked, from the gradients the step used; they were overwritten "
                    "since (by a backward or a load), so it is None. Ask right after step(), or "
                    "set a gradient clipping to have every step compute it",
                    stacklevel=3,
                )
                return None
            total = torch.zeros((), dtype=torch.float64, device=self.grads[0].device)
            for grad in self.grads:
                total += sum_of_squares(grad)
            self.norm, self.grads = math.sqrt(total.item()), []
        return self.norm
