"""`offload_param.max_in_cpu`: keep the first parameter shards in CPU memory, stream the rest from NVMe.

DeepSpeed's stage-3 engine keeps `max_in_cpu` elements of the parameter partitions in CPU memory when
they are offloaded to NVMe and swaps the rest. zeroshard does the same with one store made of two:
each tensor the store is asked for goes to CPU memory while the elements given there stay within
`max_in_cpu`, and from the first one that does not fit on, to the NVMe store. Tensors are asked
for in the order the groups are built (the model's module order), so the first units stay resident
and the later ones stream; a tensor is never split. What it buys: a token reads `max_in_cpu` fewer elements from the
disk, for that much more resident memory (the ZeRO-Inference benchmark gives zeroshard the same CPU
budget that Accelerate's disk offload gets, `benchmarks/zero_inference.py`).

[Note: max_in_cpu is acted on when set]
DeepSpeed's default is 1e9 elements (4 GB of fp32), which would keep every model below 4 GB wholly
in memory and make NVMe offload a no-op for it; DeepSpeed's ZeRO-Inference path (its partitioned
parameter swapper) streams every partition anyway. So zeroshard acts on the key only when the user
sets it (the config keeps DeepSpeed's value as the field's default): absent, every shard streams.
"""

from __future__ import annotations

import torch

from zeroshard.offload.store import CPUStore, NVMeStore


class ResidentFirstStore:
    """A `zeroshard.core.placement.Store`: the first `max_in_cpu` elements in `cpu`, the rest in `nvme`.
    `owns_nvme` False: `nvme` is shared with the optimizer states, which destroy and report it."""

    kind = "cpu+nvme"
    in_memory = False  # some of its tensors live in files

    def __init__(self, cpu: CPUStore, nvme: NVMeStore, max_in_cpu: int, owns_nvme: bool = True):
        self.cpu, self.nvme = cpu, nvme
        self.max_in_cpu = max_in_cpu
        self.owns_nvme = owns_nvme
        self.numel_in_cpu = 0
        self.counters = nvme.counters
        self._streamed_bytes = 0  # bytes of the NVMe tensors this store asked for

    def tensor(self, key: str, numel: int, dtype: torch.dtype, pieces=()) -> torch.Tensor:
        if not self._streamed_bytes and self.numel_in_cpu + numel <= self.max_in_cpu:
            self.numel_in_cpu += numel
            return self.cpu.tensor(key, numel, dtype)
        tensor = self.nvme.tensor(key, numel, dtype)  # and every later one: the resident ones are a prefix
        self._streamed_bytes += numel * tensor.element_size()
        return tensor

    @property
    def bytes_held(self) -> int:
        return self.cpu.bytes_held + self._streamed_bytes

    @property
    def offloaded_bytes(self) -> int:
        """Bytes in files; a shared NVMe store reports its files itself (its `offloaded_bytes`)."""
        return self._streamed_bytes if self.owns_nvme else 0

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.cpu.holds(tensor) or self.nvme.holds(tensor)

    def addressable_from(self, device: torch.device) -> bool:
        return self.cpu.addressable_from(device) and self.nvme.addressable_from(device)

    def resident(self, tensor: torch.Tensor) -> bool:
        return self.nvme.resident(tensor)  # True for a CPU tensor: the NVMe store does not hold it

    def held_bytes(self, tensor: torch.Tensor) -> int:
        return self.nvme.held_bytes(tensor)

    # Tensors in CPU memory need no prefetch, release or check (CPUStore's are no-ops); the NVMe store
    # ignores tensors it does not hold (the Store contract).
    def prefetch(self, tensors) -> None:
        self.nvme.prefetch(tensors)

    def stage(self, tensors) -> None:
        self.nvme.stage(tensors)

    def ready(self, tensors) -> None:
        self.nvme.ready(tensors)

    def freeze(self, tensors, frozen: bool = True) -> None:
        self.nvme.freeze(tensors, frozen)

    def release(self, tensors) -> None:
        self.nvme.release(tensors)

    def check(self, tensors) -> None:
        self.nvme.check(tensors)

    def wait(self) -> None:
        self.nvme.wait()

    def destroy(self) -> None:
        self.cpu.destroy()
        if self.owns_nvme:
            self.nvme.destroy()
        self.numel_in_cpu = self._streamed_bytes = 0
