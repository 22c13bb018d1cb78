"""`deepspeed.accelerator.get_accelerator()`: the device abstraction DeepSpeed scripts call.

Scripts written for DeepSpeed never name `torch.cuda` directly; they ask the accelerator for
`device_name()`, `set_device()`, `is_bf16_supported()`, `manual_seed_all()`, ... Two implementations
with DeepSpeed's method names: CUDA (when torch sees a GPU) and CPU. `DS_ACCELERATOR=cpu|cuda` picks
one explicitly, as in DeepSpeed. Each method is the torch call it names; nothing is cached but the
choice of accelerator.
"""

from __future__ import annotations

import abc
import contextlib
import os

import torch

_SUPPORTED = ("cpu", "cuda")


class _Accelerator(abc.ABC):
    """Methods whose meaning does not depend on the device kind."""

    _name = "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None):
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        return f"{self._name}:{self.current_device()}" if self._name != "cpu" else "cpu"

    # Each device kind answers these itself (CPU_Accelerator, CUDA_Accelerator).
    @abc.abstractmethod
    def current_device(self) -> int: ...

    @abc.abstractmethod
    def empty_cache(self) -> None: ...

    @abc.abstractmethod
    def is_bf16_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool: ...

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # -- random numbers ---------------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int):
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int | None = None):
        return torch.default_generator

    # -- data types -------------------------------------------------------------------------------
    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def is_triton_supported(self) -> bool:
        return False

    # -- ranges (profiler markers) ----------------------------------------------------------------
    def range_push(self, msg: str, domain=None, category=None) -> None:
        return None

    def range_pop(self, domain=None) -> None:
        return None

    def lazy_call(self, callback):
        return callback()

    # -- tensors ----------------------------------------------------------------------------------
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy where a GPU exists (pinning needs one); the tensor itself otherwise."""
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def op_builder_dir(self) -> str:
        return "zeroshard"

    def export_envs(self) -> list[str]:
        return []

    def visible_devices_envs(self) -> list[str]:
        return []

    def get_compile_backend(self) -> str:
        return "inductor"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_name={self._name!r})"


class CPU_Accelerator(_Accelerator):  # noqa: N801 - DeepSpeed's class name
    """The CPU: one "device" per process, gloo for collectives."""

    _name = "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # DeepSpeed's: one CPU device whatever the index (torch.device("cpu", 1) is cpu)

    def set_device(self, device_index) -> None:
        return None

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def device_count(self) -> int:
        """Processes on this machine (torchrun's LOCAL_WORLD_SIZE), as DeepSpeed's CPU accelerator."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed_all(self, seed: int):
        return torch.manual_seed(seed)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def set_rng_state(self, new_state, device_index=None) -> None:
        torch.set_rng_state(new_state)

    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        return None

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    def default_stream(self, device_index=None):
        return None

    def Event(self, **kwargs):  # noqa: N802
        return None

    def empty_cache(self) -> None:
        return None

    # Memory counters: torch has no CPU allocator statistics; 0, as DeepSpeed reports without psutil.
    def memory_allocated(self, device_index=None) -> int:
        return 0

    def max_memory_allocated(self, device_index=None) -> int:
        return 0

    def reset_max_memory_allocated(self, device_index=None) -> None:
        return None

    def memory_cached(self, device_index=None) -> int:
        return 0

    def max_memory_cached(self, device_index=None) -> int:
        return 0

    def reset_max_memory_cached(self, device_index=None) -> None:
        return None

    def memory_reserved(self, device_index=None) -> int:
        return 0

    def max_memory_reserved(self, device_index=None) -> int:
        return 0

    def memory_stats(self, device_index=None) -> dict:
        return {}

    def reset_peak_memory_stats(self, device_index=None) -> None:
        return None

    def total_memory(self, device_index=None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "gloo"


class CUDA_Accelerator(_Accelerator):  # noqa: N801 - DeepSpeed's class name
    """NVIDIA GPUs through torch.cuda, NCCL for collectives."""

    _name = "cuda"

    def set_device(self, device_index) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index=None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, device_index=None):
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state, device_index=None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def Stream(self, *args, **kwargs):  # noqa: N802
        return torch.cuda.Stream(*args, **kwargs)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    def Event(self, **kwargs):  # noqa: N802
        return torch.cuda.Event(**kwargs)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index=None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index=None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl"

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()


class _Choice:
    """The accelerator of this process, chosen on first use (not at import: CUDA may be set up later)."""

    accelerator: _Accelerator | None = None


def get_accelerator() -> _Accelerator:
    if _Choice.accelerator is None:
        _Choice.accelerator = _choose()
    return _Choice.accelerator


def set_accelerator(accelerator: _Accelerator) -> None:
    """DeepSpeed's override hook: make `accelerator` the one `get_accelerator()` returns."""
    if not isinstance(accelerator, _Accelerator):
        raise TypeError(
            f"set_accelerator() takes a CPU_Accelerator or CUDA_Accelerator, got {type(accelerator).__name__}"
        )
    _Choice.accelerator = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in _SUPPORTED


def _choose() -> _Accelerator:
    name = os.environ.get("DS_ACCELERATOR")
    if name is not None and name not in _SUPPORTED:
        raise ValueError(f"DS_ACCELERATOR={name!r}: zeroshard supports {', '.join(_SUPPORTED)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("DS_ACCELERATOR=cuda but torch sees no CUDA device")
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return CUDA_Accelerator() if name == "cuda" else CPU_Accelerator()
