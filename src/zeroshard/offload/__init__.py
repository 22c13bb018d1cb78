"""Offload of optimizer states, master weights and stage-3 parameters to CPU memory or NVMe files
(ZeRO-Offload, arXiv 2101.06840; ZeRO-Infinity, arXiv 2104.07857)."""

from __future__ import annotations

import torch

from zeroshard.core.placement import OffloadContext, Placement
from zeroshard.offload.blockio import IOPool
from zeroshard.offload.policy import CPUOffload, NVMeOffload, optimizer_shard_bytes, param_shard_bytes
from zeroshard.offload.split import ResidentFirstStore
from zeroshard.offload.store import CPUStore, NVMeStore, StoreError

__all__ = ["CPUOffload", "CPUStore", "NVMeOffload", "NVMeStore", "ResidentFirstStore", "StoreError", "build_placement"]


def _store(section, rank: int, bytes_needed: int, aio, coordinate: dict | None = None, nvme_io: str = "mapped"):
    if section is None or section.device == "none":
        return None
    if section.device == "cpu":
        return CPUStore(pin_memory=section.pin_memory)
    # aio.thread_count threads write released tensors back (DeepSpeed's default: 1), exactly as given.
    threads = aio.thread_count if aio is not None else 1
    return NVMeStore(
        section.nvme_path, rank, bytes_needed, threads=threads, coordinate=coordinate, io=IOPool(mode=nvme_io)
    )


def build_placement(
    zero,
    aio,
    optimizer: torch.optim.Optimizer | None,
    model_numel: int,
    rank: int,
    world_size: int,
    coordinate: dict | None = None,
    nvme_io: str = "mapped",
) -> Placement:
    """`optimizer` None (inference): there are no optimizer states, so no optimizer store. `rank`,
    `world_size`: of the data-parallel group; `coordinate`: this rank's tp/pp ranks under model
    parallelism, which NVMe swap directories name (offload/store.py `store_stem`); `nvme_io`: the
    `zeroshard.nvme_io` setting (offload/blockio.py)."""
    context = OffloadContext(rank, world_size, model_numel, optimizer, zero.stage == 3, coordinate)
    param_bytes = param_shard_bytes(context)
    plan = Placement(sub_group_size=int(zero.sub_group_size))
    if optimizer is not None:
        optimizer_bytes = optimizer_shard_bytes(context)
        plan.optimizer_store = _store(zero.offload_optimizer, rank, optimizer_bytes, aio, coordinate, nvme_io)
    same = (
        zero.offload_param is not None
        and zero.offload_optimizer is not None
        and zero.offload_param.device == zero.offload_optimizer.device == "nvme"
        and zero.offload_param.nvme_path == zero.offload_optimizer.nvme_path
    )
    plan.param_store = (
        plan.optimizer_store if same else _store(zero.offload_param, rank, param_bytes, aio, coordinate, nvme_io)
    )
    if plan.param_store is not None and keeps_some_in_cpu(zero.offload_param):
        assert isinstance(plan.param_store, NVMeStore)  # keeps_some_in_cpu: device nvme
        plan.param_store = ResidentFirstStore(
            CPUStore(pin_memory=zero.offload_param.pin_memory),
            plan.param_store,
            zero.offload_param.max_in_cpu,
            owns_nvme=not same,
        )
    return plan


def keeps_some_in_cpu(section) -> bool:
    """Is `offload_param.max_in_cpu` acted on? Set by the user with NVMe offload: [Note: max_in_cpu
    is acted on when set] in offload/split.py."""
    return section.device == "nvme" and "max_in_cpu" in section.model_fields_set
