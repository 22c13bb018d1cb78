"""Large buffers made each step, on transparent huge pages.

[Note: huge pages]
torch's CPU allocator caches nothing: every large tensor is fresh memory from the kernel (glibc
maps a block over its mmap threshold afresh and unmaps it on free), and its first touch faults one
4 KiB page at a time. Here that is 20 ms per 50 MB, four times the copy that fills the buffer (a
copy into a fresh 50 MB tensor 19.9 ms, into a kept one 5.0 ms), and zeroshard makes such buffers
every step: a stage-3 unit's gathered parameters (twice per step), the stage-2/3 full gradients
and gradient shards, the two-rank reduce-scatter's receive buffer, the transactional step's copy
of masters and optimizer state at stages 1-3 (docs/performance.md; stage 0 keeps its copy). Kept buffers would avoid the faults but hold
the memory between uses, which is what stages 1-3 are chosen to save.

So those buffers are asked for transparent huge pages with madvise(MADV_HUGEPAGE) before anything
writes them: one fault per 2 MiB, and the fresh copy takes 4.9 ms, a kept buffer's time. Only the
2 MiB-aligned interior of a buffer is advised (its ends stay 4 KiB pages), so nothing more is
resident than is written, only CPU tensors of at least `MIN_BYTES`, and only where the kernel's
THP mode is "madvise" (with "always" every large mapping gets them already, with "never" none can).
Memory is the same bytes; only the faults are fewer. `ZEROSHARD_HUGE_PAGES=0` turns it off (a
kernel whose compaction stalls on huge-page faults). torch's own `THP_MEM_ALLOC_ENABLE=1` advises
every allocation torch makes, activations included, for any system in the process; this advises
only zeroshard's buffers, whatever the environment.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages): the transparent huge page size
MIN_BYTES = 4 << 20  # below this, at most one huge page would fit inside: not worth a syscall
_MADV_HUGEPAGE = 14
_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise():
    """libc's madvise, or None where huge pages cannot be asked for: not Linux, THP mode other
    than "madvise", or turned off with ZEROSHARD_HUGE_PAGES=0."""
    if not sys.platform.startswith("linux") or os.environ.get("ZEROSHARD_HUGE_PAGES", "1") == "0":
        return None
    try:
        with open(_MODE_FILE) as f:
            if "[madvise]" not in f.read():
                return None
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advised() -> bool:
    """Does `advise` ask for huge pages in this process?"""
    return _madvise() is not None


def advise(tensor: torch.Tensor) -> torch.Tensor:
    """Ask for huge pages under `tensor`'s memory; call before it is first written. Returns it."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < MIN_BYTES:
        return tensor
    madvise = _madvise()
    if madvise is None:
        return tensor
    start = (tensor.data_ptr() + HUGE - 1) & ~(HUGE - 1)
    end = (tensor.data_ptr() + nbytes) & ~(HUGE - 1)
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal costs the faults, no more
    return tensor


def empty(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A 1-D tensor of fresh memory on huge pages ([Note: huge pages])."""
    return advise(torch.empty(numel, dtype=dtype, device=device))


def zeros(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    return empty(numel, dtype, device).zero_()


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    return advise(torch.empty_like(tensor, memory_format=torch.contiguous_format))


def clone(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` in fresh memory on huge pages."""
    return empty_like(tensor).copy_(tensor)


def regrow(storage_owner: torch.Tensor, nbytes: int) -> None:
    """Grow `storage_owner`'s storage back to `nbytes` (a stage-3 gather reusing its buffer's
    storage object, [Note: parameter storage] in group.py) on huge pages."""
    storage_owner.untyped_storage().resize_(nbytes)
    advise(storage_owner)
