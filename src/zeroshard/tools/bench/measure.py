"""Meters used on the ranks: peak memory, communication of torch's own implementations, state bytes.

[Note: measuring peak memory] On CPU, process RSS overstates live memory when glibc keeps freed blocks
in its heap. So memory is measured in launches that set `MALLOC_MMAP_THRESHOLD_=65536`: every tensor
larger than 64 kB is its own mapping, returned to the kernel when freed, and we call `malloc_trim(0)`
between configurations. That setting also maps every large tensor afresh at each allocation, which
slows every system's step by a different amount (docs/bench/peers.txt records both kinds of launch), so
`zeroshard bench` times each configuration in launches of its own with glibc's defaults, as a user's
script runs, and measures its memory in another launch with the setting (bench/separate.py; `--sweep`
and `--max-model` measure memory only). The peak of a step is the kernel's high-water mark (VmHWM in
/proc/self/status), reset before the measured steps by writing 5 to /proc/self/clear_refs (Linux >=
4.0). Where that is not possible, a thread samples RSS every millisecond (which can miss a short
spike). On GPU it is the caching allocator's `max_memory_allocated`. `PeakMemory.method` says which
one ran.
"""

from __future__ import annotations

import gc
import statistics
import threading
from collections import defaultdict
from pathlib import Path

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zeroshard.core.heap import trim_heap

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def trim() -> None:
    """Collect garbage and hand glibc's free heap pages back to the kernel."""
    gc.collect()
    trim_heap()


def freeze_survivors() -> None:
    """Collect garbage once, then leave what survived (the imports, the corpus) out of
    every later collection ([Note: collections that skip the imports])."""
    gc.collect()
    gc.freeze()


# [Note: collections that skip the imports]
# `trim()` runs before and after every measured configuration. A full collection walks every object
# the process holds, and with torch, sympy and torch._dynamo imported that is hundreds of thousands of
# objects that live as long as the process, walked again at each of a configuration's collections.
# gc.freeze() moves them to the permanent generation, which collections skip, so a collection after
# it walks only what the configurations created (the command's time before and after:
# docs/bench/bench_command.txt). The frozen objects are never freed; they are the imports and the
# corpus, counted in every configuration's baseline alike.


def rss() -> int:
    return psutil.Process().memory_info().rss


def _vm_hwm() -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("VmHWM missing from /proc/self/status")


class PeakMemory:
    """Peak memory of this rank between `reset()` and `peak()`; see [Note: measuring peak memory]."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = self._pick_method()
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _pick_method(self) -> str:
        if self.device.type == "cuda":
            return "cuda max_memory_allocated"
        try:
            _CLEAR_REFS.write_text("5")
            _vm_hwm()
            return "RSS high-water mark (VmHWM, reset via clear_refs), MALLOC_MMAP_THRESHOLD_=65536"
        except OSError:
            return "RSS sampled every 1 ms by a thread, MALLOC_MMAP_THRESHOLD_=65536"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method.startswith("RSS high-water"):
            _CLEAR_REFS.write_text("5")
        else:
            self._start_sampler()

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.method.startswith("RSS high-water"):
            return _vm_hwm()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return max(self._sampled, rss())

    def current(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else rss()

    def _start_sampler(self) -> None:
        self._stop.clear()
        self._sampled = rss()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self._sampled = max(self._sampled, rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()


def step_stats(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


def tensor_bytes(tensors) -> int:
    """Bytes of the local storage of `tensors` (a DTensor counts its local shard)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the local one in .optim
    return tensor_bytes(t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor))


# Which tensor argument is the full (unsharded) one, and the paper's factor (ZeRO §7: all-reduce = 2Ψ).
_C10D_OPS = {
    "allreduce_": ("all_reduce", 0, 2),
    "allreduce_coalesced_": ("all_reduce", 0, 2),
    "broadcast_": ("broadcast", 0, 1),
    "_allgather_base_": ("all_gather", 0, 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 1),
    "allgather_": ("all_gather", 0, 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 1),
    "reduce_scatter_": ("reduce_scatter", 1, 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1),
}


class C10dByteCounter(TorchDispatchMode):
    """Counts the collectives torch's own data-parallel implementations issue, in the paper's convention.

    Python dispatch makes every op slower, so peers count on one step and time the others without it.
    """

    def __init__(self):
        super().__init__()
        self.paper: dict[str, int] = defaultdict(int)
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = str(func.name()).partition("::")
        if namespace == "c10d":
            self._count(name, args)
        return func(*args, **kwargs)

    def _count(self, name: str, args) -> None:
        if name not in _C10D_OPS:
            if name not in ("barrier", "monitored_barrier_"):
                self.unknown.add(name)
            return
        kind, position, factor = _C10D_OPS[name]
        full = [t for t in tree_leaves(args[position]) if isinstance(t, torch.Tensor)]
        self.paper[kind] += factor * sum(t.numel() * t.element_size() for t in full)
