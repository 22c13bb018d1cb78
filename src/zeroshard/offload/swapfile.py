"""One swap file of the NVMe store and the tensor that lives in it.

[Note: where a swap file's tensor lies]
The tensor the engine holds is the file's memory mapping (offload/store.py, [Note: why
memory-mapped files]): any consumer may read or write it at any time, and the kernel moves the
pages. For a use the store knows about ahead of time, the bytes come in faster by an aligned
direct read (offload/blockio.py, [Note: aligned direct I/O]) into an anonymous buffer, which is
then moved, pages and all (mremap), to the tensor's address in place of the mapping. The tensor's
address and its views never change, and at every moment the memory there holds the tensor's
current bytes: the mapping until the buffer is moved in, then the buffer, whose contents are the
file's. So `Home.BUFFER` is authoritative while it lasts: the release writes the buffer to the
file with an aligned direct write (unless the tensor is frozen: nothing ever writes it) and maps
the file at the address again, which frees the buffer. Reads into buffers are counted by
RLIMIT_DATA, as a file mapping's pages are not, so a cap bounds them.

A buffer is filled only for `stage` (a use that may write: the optimizer's sub-group) and for
`prefetch` of frozen tensors (ZeRO-Inference's weights); a caller of either calls `ready` before
the use, so no write races the read. Any other prefetch keeps the mapping and reads its pages
ahead (MADV_POPULATE_READ), as consumers that touch the tensor without telling the store (an
all-gather reading the shard at once) need.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import logging
import mmap
import os
import threading
from concurrent.futures import Future, wait as wait_for
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zeroshard.offload.blockio import Buffer, DirectFile, map_file_at, writable
from zeroshard.offload.errors import StoreError

log = logging.getLogger(__name__)

# [Note: system calls off the GIL]
# Python's mmap.madvise and mmap.flush keep the GIL for the whole system call, and a read-ahead
# (MADV_POPULATE_READ) or a write-back blocks on the disk: on a store thread, that stalled the
# thread computing, and made its every Python step wait (a ZeRO-Inference token from this store
# spent a quarter of its time so: in madvise, and in cheap calls waiting for the GIL). ctypes releases the GIL around a foreign call, so the store calls libc itself.
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.msync.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_POPULATE_READ = 22  # Linux >= 5.14: read the pages and map them, so their use takes no page faults
_MS_SYNC = 4  # Linux's value (the mmap module does not export it)


class Home(enum.Enum):
    MAPPING = "mapping"  # the file's shared mapping is at the tensor's address
    BUFFER = "buffer"  # an anonymous buffer read from the file is (see the note above)


@dataclass
class SwapFile:
    path: Path
    nbytes: int
    inode: int
    buffer: mmap.mmap
    tensor: torch.Tensor
    fd: int
    direct: DirectFile
    lock: threading.Lock = field(default_factory=threading.Lock)
    releasing: Future | None = None  # its last write-back: a read waits for it (no drop after the read)
    releases: int = 0  # how many times it was released: a read asked for before the last one is moot
    home: Home = Home.MAPPING
    reading: Future | None = None  # a read into a buffer in flight, which `ready` waits for
    frozen: bool = False  # never written after `freeze`: a buffer is read-only and not written back

    def syscall(self, name: str, *args) -> None:
        """libc `name`(start of the mapping, its length, *args); OSError on failure (see [Note:
        system calls off the GIL]). An empty tensor has no pages: nothing to do."""
        if self.nbytes and getattr(_LIBC, name)(self.tensor.data_ptr(), self.nbytes, *args) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    def close(self) -> None:
        self.direct.close()
        os.close(self.fd)


def read_into_buffer(item: SwapFile, releasing: Future | None, releases: int) -> None:
    """Read the file into a new buffer and move it to the tensor's address ([Note: where a swap
    file's tensor lies]). A release since the request (the use is over) makes it moot; a buffer
    already there is current. Raises BlockIOError (the tensor keeps its mapping, still valid)."""
    if releasing is not None:
        wait_for([releasing])  # its failure is wait()'s to raise; the tensor then keeps its buffer
    with item.lock:
        if item.releases != releases or item.home is Home.BUFFER or not item.nbytes:
            return
        buffer = Buffer(item.nbytes)
        try:
            item.direct.read_into(buffer.address, item.nbytes)
            if item.frozen:
                buffer.read_only()
            buffer.move_to(item.tensor.data_ptr())
        except OSError as error:
            raise StoreError(f"NVMe store cannot read {item.path} in ({item.nbytes} bytes): {error}") from error
        finally:
            buffer.free()
        item.home = Home.BUFFER


def make_writable(item: SwapFile) -> None:
    """A frozen tensor's buffer in place becomes writable (the caller holds `item.lock`)."""
    try:
        writable(item.tensor.data_ptr(), item.nbytes)
    except OSError as error:
        raise StoreError(f"NVMe store cannot unfreeze {item.path}: {error}") from error


def read_ahead(item: SwapFile, releasing: Future | None, releases: int, clock) -> None:
    """Read a tensor's pages through its mapping and map them (a use then takes no page faults). Only
    a hint: if it fails, the use faults the pages in itself, and `check` names a damaged file.
    The last write-back runs first (so it cannot drop the pages just read); a release since the
    request makes it moot (the pages would stay resident until the next release)."""
    if releasing is not None:
        wait_for([releasing])  # a failure is wait()'s to raise
    with item.lock:
        if item.releases != releases or item.home is Home.BUFFER:
            return
        with clock.request("read", item.nbytes):
            try:
                item.syscall("madvise", _MADV_POPULATE_READ)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    log.debug("NVMe store: read-ahead of %s failed: %s", item.path, error)
                    return
                try:  # a kernel before 5.14: an asynchronous read into the page cache
                    item.syscall("madvise", mmap.MADV_WILLNEED)
                except OSError as again:
                    log.debug("NVMe store: read-ahead of %s failed: %s", item.path, again)


def write_back(item: SwapFile, clock) -> None:
    """The tensor's bytes to disk, then out of this process and out of the page cache: the memory a
    released tensor used is free again, and its next use reads from the disk. A buffer is written
    with one aligned direct write (none when frozen) and replaced by the mapping; a mapping's dirty
    pages are synced and dropped. On failure a buffer stays (it holds the only current copy)."""
    with item.lock:
        try:
            if item.home is Home.BUFFER:
                if not item.frozen:
                    item.direct.write_from(item.tensor.data_ptr(), item.nbytes)
                map_file_at(item.tensor.data_ptr(), item.nbytes, item.fd)
                item.home = Home.MAPPING
                return
            with clock.request("write", 0):  # the dirty pages' count is the kernel's: bytes unknown here
                item.syscall("msync", _MS_SYNC)
            item.syscall("madvise", mmap.MADV_DONTNEED)
            os.posix_fadvise(item.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as error:  # e.g. ENOSPC on a thin-provisioned or copy-on-write file system
            raise StoreError(f"NVMe store cannot write {item.path} back ({item.nbytes} bytes): {error}") from error
