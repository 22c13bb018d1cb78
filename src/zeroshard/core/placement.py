"""Placement: where the model states that need not stay in compute memory live between uses.

The core never asks *what kind* of store it has (STYLE.md, habit 4): it holds objects that satisfy
`Store` and calls the same methods on all of them. `zeroshard.offload` provides the two kinds users
configure (CPU memory, NVMe files) and the policies that build them for a rank (`CPUOffload`,
`NVMeOffload`: offload/policy.py) from an `OffloadContext`; a test can pass any object with these
methods in a `Placement` of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from zeroshard.core.heap import trim_heap


@runtime_checkable
class Store(Protocol):
    """One home for offloaded tensors. Every method is safe to call on tensors the store does not
    hold (it ignores them), so callers never branch on the store's kind."""

    in_memory: bool  # do its tensors live in this process's memory (host RAM), not in files?

    @property
    def bytes_held(self) -> int:
        """Bytes of tensors created by `tensor()` and not yet destroyed."""

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of its tensors that live in files (the memory report's `offloaded_nvme`)."""

    def tensor(self, key: str, numel: int, dtype: torch.dtype, pieces=()) -> torch.Tensor:
        """A new zero-filled 1-D tensor that lives in this store. `pieces`: (offset, shape) of the
        whole parameters laid out in it, for a store that packs them by shape (inference/store.py);
        others ignore it. A store may free a released tensor's storage (that one does): a writer
        outside a step calls `stage` and `ready` first."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Is `tensor` one of this store's tensors?"""

    def addressable_from(self, device: torch.device) -> bool:
        """Can `device` compute on this store's tensors where they lie, with no copy? Host memory and
        memory-mapped files: from the CPU, not from a GPU. Decides where fp32 master weights go
        ([Note: master placement] in shard.py)."""

    def resident(self, tensor: torch.Tensor) -> bool:
        """Does `tensor` occupy this process's memory at rest (True for host memory; False for a
        tensor whose bytes live in a file)? Used by the memory report."""

    def held_bytes(self, tensor: torch.Tensor) -> int:
        """Bytes of this process's memory `tensor` takes at rest: its size, 0 for a tensor whose
        bytes live in a file, its packed size for a store that packs (inference/store.py). Used
        by the memory report."""

    def prefetch(self, tensors) -> None:
        """Start bringing these tensors in ahead of use."""

    def stage(self, tensors) -> None:
        """Start bringing these tensors in for a use that may write them; `ready` before the use,
        `release` after it."""

    def ready(self, tensors) -> None:
        """Block until the bringing-in that `prefetch` or `stage` started for these tensors is done
        (raise if it failed)."""

    def freeze(self, tensors, frozen: bool = True) -> None:
        """These tensors will not be written until unfrozen (ZeRO-Inference's weights): a store may
        skip writing them back."""

    def release(self, tensors) -> None:
        """These tensors are not needed until their next prefetch: write them back, free memory."""

    def check(self, tensors) -> None:
        """Raise before any change when a tensor's backing is damaged (deleted or truncated file)."""

    def wait(self) -> None:
        """Block until every release issued so far has completed."""

    def destroy(self) -> None:
        """Free everything the store holds."""


@dataclass(frozen=True)
class OffloadContext:
    """What an offload policy needs to build one rank's stores (core/policy.py `OffloadPolicy`)."""

    rank: int  # in the data-parallel group: store directories are named by it
    world_size: int  # of the data-parallel group: a rank holds about 1/world_size of the states
    model_numel: int  # elements of the model's parameters
    optimizer: torch.optim.Optimizer | None  # None: inference, no optimizer states to place
    shards_parameters: bool  # stage 3: parameter shards exist to be placed
    coordinate: dict | None = None  # this rank's tp/pp ranks under model parallelism, also in names

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's flat shards, with room for the padding of a few groups."""
        return -(-self.model_numel // self.world_size) + 1024


def place(
    offload,
    model: torch.nn.Module,
    rank: int,
    world_size: int,
    optimizer: torch.optim.Optimizer | None,
    shards_parameters: bool,
    coordinate: dict | None = None,
) -> Placement:
    """The stores `offload` (an OffloadPolicy, core/policy.py; None: nothing offloaded) builds for
    this rank's share of `model`: what training's and inference's `shard()` both ask."""
    if offload is None:
        return Placement()
    model_numel = sum(p.numel() for p in model.parameters())
    return offload.build(OffloadContext(rank, world_size, model_numel, optimizer, shards_parameters, coordinate))


@dataclass
class Placement:
    """Where offloaded states go; None = they stay where they are computed.

    optimizer_store: optimizer states, fp32 master shards, fp32 gradient shards;
    param_store: stage-3 parameter shards, which are also their master weights;
    sub_group_size: elements per optimizer sub-step when states are offloaded ([Note: streamed step] in
    core/optim/streamed.py).
    """

    optimizer_store: Store | None = None
    param_store: Store | None = None
    sub_group_size: int = 1_000_000_000

    def build(self, context: OffloadContext) -> Placement:
        """A Placement is the offload policy of stores built by the caller: it is its own result."""
        return self

    def stores(self) -> list[Store]:
        return list({id(s): s for s in (self.optimizer_store, self.param_store) if s is not None}.values())

    def trim_heap(self) -> None:
        """Where a store keeps its tensors in files, hand the process's freed heap back to the kernel
        ([Note: trimming the heap] in heap.py)."""
        if any(not store.in_memory for store in self.stores()):
            trim_heap()

    def destroy(self) -> None:
        for store in self.stores():
            store.destroy()
