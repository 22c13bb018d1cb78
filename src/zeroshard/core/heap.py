"""The process's heap: handing freed memory back to the kernel.

[Note: trimming the heap]
PyTorch's CPU tensors come from glibc's malloc. A block above glibc's mmap threshold is mapped and
unmapped on its own, but the threshold rises to the size of the largest such block freed (up to
32 MB), after which blocks of that size come from the heap, and a freed block below the heap's top
stays with the process. Where the model states live in files, a rank's anonymous memory is almost
all such temporaries (gathered units, gradients, activations, an optimizer's scratch), and what
the heap keeps of them grows with the model, most of it not in use (measured, and the trim's
effect on the steps' peak: docs/bench/offload_nvme_trim.txt). So with a store in files
the engine trims the heap (malloc_trim(0), which releases the free pages of every arena) once it is
built and after every optimizer step, where the step's temporaries are all freed: the next step
starts from what is in use. In memory nothing is trimmed: there the heap's pages are what the next
step reuses, and a step is too short to pay for giving them back and faulting them in again.
"""

from __future__ import annotations

import ctypes

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; musl and macOS have none


def trim_heap() -> None:
    """Hand glibc's free heap pages back to the kernel (malloc_trim(0)); elsewhere nothing."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
