"""Config sections of the offload stores: ``zero_optimization.offload_optimizer`` /
``offload_param`` (DeepSpeed's ``zero/offload_config.py``) and ``aio``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import AliasChoices, Field

from zeroshard.config.base import Fraction, NonNegInt, PosInt, Section

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: keep optimizer state (and its step) on CPU or NVMe."""

    section_path: ClassVar[str] = "zero_optimization.offload_optimizer"

    device: OffloadDevice = "none"
    """Where optimizer state lives: none, cpu or nvme."""
    nvme_path: str | None = None
    """Directory for the NVMe store (required when device is nvme)."""
    pin_memory: bool = False
    """Use page-locked CPU buffers (faster host-device copies, more pinned memory)."""
    buffer_count: NonNegInt = 4
    """Buffers in the NVMe swap pool (at least the number of states per parameter)."""
    ratio: Fraction = 1.0
    """Fraction of optimizer state offloaded; below 1 only with stage 3."""
    fast_init: bool = False
    """Faster optimizer initialisation when offloading to NVMe."""


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param``: keep stage-3 parameter shards on CPU or NVMe."""

    section_path: ClassVar[str] = "zero_optimization.offload_param"

    device: OffloadDevice = "none"
    """Where parameter shards live: none, cpu or nvme."""
    nvme_path: str | None = None
    """Directory for the NVMe store (required when device is nvme)."""
    pin_memory: bool = False
    """Use page-locked CPU buffers."""
    buffer_count: NonNegInt = 5
    """Buffers in the NVMe parameter pool."""
    buffer_size: NonNegInt = 100_000_000
    """Elements per buffer of the NVMe parameter pool."""
    max_in_cpu: NonNegInt = 1_000_000_000
    """Parameter elements kept in CPU memory when offloading to NVMe: the first shards up to this many
    stay resident, the rest stream. Acted on only when set (absent: every shard streams, where
    DeepSpeed's default 1e9 would keep any model below 4 GB resident); see [Note:
    max_in_cpu is acted on when set] in offload/split.py."""


def _check_nvme_path(section: OffloadOptimizerConfig | OffloadParamConfig | None, name: str) -> None:
    if section is not None and section.device == "nvme" and not section.nvme_path:
        raise ValueError(f"{name}.device is 'nvme' but {name}.nvme_path is not set")


class AioConfig(Section):
    """The ``aio`` section: asynchronous I/O settings of the NVMe store."""

    section_path: ClassVar[str] = "aio"

    block_size: PosInt = 1_048_576
    """Bytes per I/O request (accepted, not acted on: the NVMe store's aligned requests are 4 MiB,
    offload/blockio.py)."""
    queue_depth: PosInt = 8
    """I/O requests in flight (accepted, not acted on: the NVMe store keeps eight aligned requests in
    flight, offload/blockio.py)."""
    thread_count: PosInt = Field(1, validation_alias=AliasChoices("thread_count", "intra_op_parallelism"))
    """Threads that write released tensors back to the NVMe files (newer DeepSpeed calls it
    ``intra_op_parallelism``)."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches (accepted, not acted on)."""
    overlap_events: bool = True
    """Overlap submission and completion of requests (accepted, not acted on: reads ahead and
    write-back already overlap the step)."""
