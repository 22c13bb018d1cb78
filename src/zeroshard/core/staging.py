"""The temporaries a collective runs on when the caller's tensors are not on the communicator's
device: copies only, no communication (comm.py's Communicator calls the collectives).

[Note: staging host tensors]
NCCL moves only CUDA tensors and gloo is only sure to move CPU ones, while callers hold tensors
wherever their placement put them (a master in host memory under CPU offload, zero.Init shards on
the CPU, a checkpoint gather into host memory). One rule, here and nowhere else: a collective
argument whose device is not `self.device` is staged through a temporary on `self.device` — inputs
copied in before the collective, outputs copied back when it completes (at `wait()` for an async
one) — and the bytes copied are counted (`ByteCounter.staged`), so a run shows when it pays for
this. Callers never think about devices.
"""

from __future__ import annotations

import torch

from zeroshard.core.comm_bytes import ByteCounter


class Staging:
    """The temporaries of one collective on the communicator's `device`, the bytes copied counted in
    its `counter` ([Note: staging host tensors])."""

    def __init__(self, device: torch.device, counter: ByteCounter):
        self.device, self.counter = device, counter
        self.kept: list[torch.Tensor] = []  # alive until the collective completes
        self.copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (caller's tensor, temporary)

    def __call__(self, tensor: torch.Tensor, read: bool = True, written: bool = False) -> torch.Tensor:
        """The tensor the collective runs on: `tensor` itself, or a temporary on the right device."""
        if tensor.device == self.device:
            return tensor
        temp = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        if read:
            temp.copy_(tensor)
            self.counter.staged += tensor.numel() * tensor.element_size()
        self.kept.append(temp)
        if written:
            self.copy_back.append((tensor, temp))
        return temp

    def finish(self) -> None:
        for tensor, temp in self.copy_back:
            tensor.copy_(temp)
            self.counter.staged += tensor.numel() * tensor.element_size()
        self.copy_back.clear()
        self.kept.clear()
