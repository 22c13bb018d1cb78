"""The two offload policies users pass to `zeroshard.shard(offload=...)`: `CPUOffload()` (ZeRO-Offload,
arXiv 2101.06840) and `NVMeOffload(path)` (ZeRO-Infinity, arXiv 2104.07857). Each works out its
rank's stores itself from the `OffloadContext` the core hands it (the data-parallel rank, the shard
size, the optimizer), so a caller never names a rank or a byte count.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from zeroshard.core.optim import lowbit
from zeroshard.core.placement import OffloadContext, Placement
from zeroshard.offload.blockio import MODES, IOPool
from zeroshard.offload.split import ResidentFirstStore
from zeroshard.offload.store import CPUStore, NVMeStore


def _check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name}={value!r}: True or False")


def _check_positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r}: an int >= 1")


def state_bytes_per_element(optimizer) -> float:
    """Upper bound on an optimizer's state bytes per parameter element, for a free-space check:
    SGD one buffer, AMSGrad three, Adam-like two (fp32 each), a block-wise optimizer's two moments
    as it keeps them (`_blockwise_bytes_per_element`)."""
    if type(optimizer).__name__ == "SGD":
        return 4
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        return 12
    if lowbit.is_torchao_class(type(optimizer)) or lowbit.is_bnb(optimizer):
        return _blockwise_bytes_per_element(optimizer)
    return 8


def _blockwise_bytes_per_element(optimizer) -> float:
    """Per element of the optimizer's parameters: for a parameter it quantizes, two moments of codes
    (one byte, half a byte at 4 bits) with an fp32 scale per block and a code map each (256 fp32
    entries, 16 at 4 bits; fp8 has none); 8 bytes for one it keeps in fp32 (a small one: [Note:
    block-wise optimizer states] in core/optim/lowbit.py)."""
    name = type(optimizer).__name__
    code_bytes, map_entries = (0.5, 16) if "4bit" in name else (1.0, 256)
    block = lowbit.BNB_BLOCK if lowbit.is_bnb(optimizer) else optimizer.block_size
    total = elements = 0.0
    for group in optimizer.param_groups:
        for param in group["params"]:
            numel = param.numel()
            elements += numel
            if lowbit.quantizes(optimizer, param.shape):
                total += 2 * (numel * code_bytes + 4 * -(-numel // block) + 4 * map_entries)
            else:
                total += 8 * numel
    return total / elements if elements else 8


def optimizer_shard_bytes(context: OffloadContext) -> int:
    """Bytes of one rank's optimizer states, fp32 master shard and fp32 gradient shard."""
    return math.ceil(context.shard_numel * (state_bytes_per_element(context.optimizer) + 4 + 4))


def param_shard_bytes(context: OffloadContext) -> int:
    """Bytes of one rank's stage-3 parameter shard (fp32: it is also the master)."""
    return context.shard_numel * 4


def _check_params(owner: str, params: bool, context: OffloadContext) -> None:
    if params and not context.shards_parameters:
        raise ValueError(
            f"{owner}(params=True) places stage 3's parameter shards, and this stage does not shard "
            "parameters: use params=False, or stage 3"
        )


@dataclass(frozen=True)
class CPUOffload:
    """Optimizer states, fp32 master shards and fp32 gradient shards in host memory, the optimizer
    step computed there; with `params=True`, stage 3's parameter shards too (between uses).

    `pin_memory`: page-locked host memory on a GPU machine, so copies to and from the GPU run
    asynchronously (no effect without CUDA). `sub_group_size`: elements per optimizer sub-step
    ([Note: streamed step] in core/optim/streamed.py)."""

    params: bool = False
    pin_memory: bool = True
    sub_group_size: int = 1_000_000_000

    def __post_init__(self) -> None:
        _check_bool("CPUOffload", "params", self.params)
        _check_bool("CPUOffload", "pin_memory", self.pin_memory)
        _check_positive_int("CPUOffload", "sub_group_size", self.sub_group_size)

    def build(self, context: OffloadContext) -> Placement:
        _check_params("CPUOffload", self.params, context)
        plan = Placement(sub_group_size=self.sub_group_size)
        store = CPUStore(pin_memory=self.pin_memory)
        plan.optimizer_store = store if context.optimizer is not None else None
        plan.param_store = store if self.params else None
        return plan


@dataclass(frozen=True)
class NVMeOffload:
    """States in memory-mapped files under `path`, one directory per rank: the optimizer's
    (`optimizer=True`: states, fp32 masters, fp32 gradient shards) and stage 3's parameter shards
    (`params=True`; ZeRO-Inference's weights). What is not offloaded stays where it is computed.

    `max_in_cpu`: the first parameter shards, in module order, up to that many elements stay in host
    memory (page-locked with `pin_memory` where a GPU exists) and the rest stream from the files
    (offload/split.py). `io`: how the files are read, "direct", "buffered" or "mapped"
    (offload/blockio.py); None: "direct" for inference (no optimizer), which reads every weight once
    per forward, "mapped" for training. `threads`: threads writing released tensors back
    (DeepSpeed's `aio.thread_count`). `sub_group_size`: elements per optimizer sub-step ([Note:
    streamed step] in core/optim/streamed.py). Before any file is made, the free space under `path`
    is checked against the rank's share."""

    path: str | os.PathLike
    optimizer: bool = True
    params: bool = True
    max_in_cpu: int | None = None
    pin_memory: bool = True
    io: str | None = None
    threads: int = 1
    sub_group_size: int = 1_000_000_000

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"NVMeOffload.path={self.path!r}: a directory (str or path)")
        for name in ("optimizer", "params", "pin_memory"):
            _check_bool("NVMeOffload", name, getattr(self, name))
        if not (self.optimizer or self.params):
            raise ValueError("NVMeOffload(optimizer=False, params=False) offloads nothing: set one, or pass no offload")
        if self.max_in_cpu is not None:
            if isinstance(self.max_in_cpu, bool) or not isinstance(self.max_in_cpu, int) or self.max_in_cpu < 0:
                raise ValueError(f"NVMeOffload.max_in_cpu={self.max_in_cpu!r}: elements, an int >= 0, or None")
            if not self.params:
                raise ValueError("NVMeOffload.max_in_cpu keeps parameter shards in memory: it needs params=True")
        if self.io is not None and self.io not in MODES:
            raise ValueError(f"NVMeOffload.io={self.io!r}: one of {', '.join(map(repr, MODES))}, or None")
        _check_positive_int("NVMeOffload", "threads", self.threads)
        _check_positive_int("NVMeOffload", "sub_group_size", self.sub_group_size)

    def build(self, context: OffloadContext) -> Placement:
        _check_params("NVMeOffload", self.params, context)
        offload_optimizer = self.optimizer and context.optimizer is not None
        if not (offload_optimizer or self.params):
            raise ValueError(
                "NVMeOffload(params=False) offloads optimizer states, and there is no optimizer (inference): "
                "use params=True at stage 3, or pass no offload"
            )
        needed = (optimizer_shard_bytes(context) if offload_optimizer else 0) + (
            param_shard_bytes(context) if self.params else 0
        )
        io = self.io or ("mapped" if context.optimizer is not None else "direct")
        # One store (one directory) for everything this rank offloads, as when a config names the
        # same nvme_path for both sections.
        store = NVMeStore(
            self.path, context.rank, needed, threads=self.threads, coordinate=context.coordinate, io=IOPool(mode=io)
        )
        plan = Placement(sub_group_size=self.sub_group_size)
        plan.optimizer_store = store if offload_optimizer else None
        plan.param_store = store if self.params else None
        if self.params and self.max_in_cpu is not None:
            cpu = CPUStore(pin_memory=self.pin_memory)
            plan.param_store = ResidentFirstStore(cpu, store, self.max_in_cpu, owns_nvme=not offload_optimizer)
        return plan
