"""Large aligned reads and writes of swap files, off the GIL: the NVMe store's fast path.

[Note: aligned direct I/O]
Positioned reads and writes of 4 MiB blocks with O_DIRECT, eight in flight, read as fast as `dd`
O_DIRECT and write faster than the swap files' memory mapping (measured with
benchmarks/offload_io.py: docs/offload_nvme.md, docs/bench/offload_io.txt), without passing the
bytes through the page cache (no copy, no cached pages to drop afterwards, nothing counted in RSS
but the buffer read into); the mapping moves them through the kernel's read-ahead, one fault at a
time. So a tensor the store brings in for a use is read with `DirectFile.read_into` into an
anonymous, page-aligned `Buffer`, and written back with `DirectFile.write_from`. O_DIRECT wants the
buffer address, the file offset and the length aligned to the device's logical block; ALIGN (4096)
covers every block size Linux supports below the page, the buffers are whole pages (mmap), offsets
are multiples of the block size, and swap files are preallocated to whole ALIGN blocks, so the
partial tail of a tensor is read and written as one whole block. A file system without O_DIRECT
(tmpfs, some FUSE) refuses the flag when the file is opened (or the first request with EINVAL): the
same requests then go through the page cache (`mode` "buffered"), whose pages a write-back flushes
and drops.

libc's pread/pwrite are called through ctypes, which releases the GIL around each call, so the
thread computing keeps running while I/O threads wait on the disk.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from zeroshard.offload.errors import StoreError

log = logging.getLogger(__name__)

ALIGN = 4096  # bytes: O_DIRECT alignment of address, offset and length (logical block <= page)
PAGE = os.sysconf("SC_PAGE_SIZE")
BLOCK_BYTES = 4 * 2**20  # bytes per request: 4 MiB, eight in flight (see [Note: aligned direct I/O])
DEPTH = 8

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.pread.argtypes = _LIBC.pwrite.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long)
_LIBC.pread.restype = _LIBC.pwrite.restype = ctypes.c_ssize_t
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_LIBC.mremap.restype = ctypes.c_void_p
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_LIBC.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_PROT_READ, _PROT_WRITE = 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value


class BlockIOError(StoreError):
    """A read or write of a swap file failed (I/O error, short file, no memory for the buffer)."""


def round_up(nbytes: int, to: int = ALIGN) -> int:
    return -(-nbytes // to) * to


def _errno_error(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


class IOClock:
    """Bytes moved and the time the disk was busy with them: the union of the intervals in which at
    least one request of a kind was in flight, so eight requests in parallel count their shared
    second once. `busy_s` is the union over both kinds. With `keep_spans`, the busy intervals
    themselves are kept (time.perf_counter: CLOCK_MONOTONIC, one clock for every process of a
    machine), so that a benchmark can join the busy time of several ranks sharing a disk."""

    def __init__(self, keep_spans: bool = False):
        self.keep_spans = keep_spans
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self.bytes = {"read": 0, "write": 0}
        self.busy = {"read": 0.0, "write": 0.0, "any": 0.0}
        self._active = {"read": 0, "write": 0, "any": 0}
        self._since = {"read": 0.0, "write": 0.0, "any": 0.0}

    @contextmanager
    def request(self, kind: str, nbytes: int):
        self._enter(kind)
        try:
            yield
        finally:
            self._leave(kind, nbytes)

    def _enter(self, kind: str) -> None:
        now = time.perf_counter()
        with self._lock:
            for key in (kind, "any"):
                if self._active[key] == 0:
                    self._since[key] = now
                self._active[key] += 1

    def _leave(self, kind: str, nbytes: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self.bytes[kind] += nbytes
            for key in (kind, "any"):
                self._active[key] -= 1
                if self._active[key] == 0:
                    self.busy[key] += now - self._since[key]
                    if key == "any" and self.keep_spans:
                        self.spans.append((self._since[key], now))

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "read_bytes": self.bytes["read"],
                "write_bytes": self.bytes["write"],
                "read_busy_s": self.busy["read"],
                "write_busy_s": self.busy["write"],
                "busy_s": self.busy["any"],
            }


def union_s(spans, start: float = float("-inf"), end: float = float("inf")) -> float:
    """Seconds covered by the union of `spans` ((start, end) pairs), clipped to [start, end]."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a:
            continue
        if a > reach:
            total, reach = total + b - a, b
        elif b > reach:
            total, reach = total + b - reach, b
    return total


class Buffer:
    """Anonymous, page-aligned memory (private: counted by RLIMIT_DATA, unlike a file mapping's pages)
    that a read fills; `move_to` puts its pages at another address in place of what is mapped there."""

    def __init__(self, nbytes: int):
        self.nbytes = round_up(max(nbytes, 1), PAGE)
        address = _LIBC.mmap(None, self.nbytes, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if address in (None, _MAP_FAILED):
            raise BlockIOError(
                f"no memory for a {self.nbytes}-byte I/O buffer: "
                f"{os.strerror(ctypes.get_errno())} (RLIMIT_DATA or the machine's memory)"
            )
        self.address = address

    def read_only(self) -> None:
        """Writes to it fault from now on: for tensors the store holds frozen (never written back)."""
        if _LIBC.mprotect(self.address, self.nbytes, _PROT_READ) != 0:
            raise _errno_error("mprotect")

    def move_to(self, address: int) -> None:
        """Atomically replace the pages at `address` (this buffer's size) with this buffer's: a thread
        reading there sees the old bytes or these, never a hole. The buffer is consumed."""
        if _LIBC.mremap(self.address, self.nbytes, self.nbytes, _MREMAP_MAYMOVE | _MREMAP_FIXED, address) in (
            None,
            _MAP_FAILED,
        ):
            raise _errno_error("mremap")
        self.address = None

    def free(self) -> None:
        if self.address is not None:
            _LIBC.munmap(self.address, self.nbytes)
            self.address = None


def writable(address: int, nbytes: int) -> None:
    """Make a buffer that `Buffer.read_only` protected, now moved to `address`, writable again."""
    if _LIBC.mprotect(address, round_up(max(nbytes, 1), PAGE), _PROT_READ | _PROT_WRITE) != 0:
        raise _errno_error("mprotect")


def map_file_at(address: int, nbytes: int, fd: int) -> None:
    """Map `fd` from offset 0 at `address` again (shared, read-write), replacing what is there (a
    buffer that `Buffer.move_to` put there, whose pages are freed)."""
    length = round_up(max(nbytes, 1), PAGE)
    if _LIBC.mmap(address, length, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED, fd, 0) in (None, _MAP_FAILED):
        raise _errno_error("mmap")


MODES = ("direct", "buffered", "mapped")  # "mapped": the store reads through its mapping (swapfile.py)


def open_direct(path: Path, mode: str = "direct") -> tuple[int, str]:
    """A descriptor of `path` for aligned requests and the path taken: O_DIRECT, or "buffered" where
    the file system refuses it (tmpfs) or `mode` asks for it. Other errors are raised."""
    if mode != "direct":
        return os.open(path, os.O_RDWR), "buffered"
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT), "direct"
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
    return os.open(path, os.O_RDWR), "buffered"


class DirectFile:
    """Aligned, large requests on one swap file, `depth` of them in flight on a shared I/O pool."""

    def __init__(self, path: Path, pool: IOPool):
        self.path = path
        self.pool = pool
        self.fd, self.mode = open_direct(path, pool.mode)
        self._mode_lock = threading.Lock()

    def read_into(self, address: int, nbytes: int) -> None:
        """Bytes [0, round_up(nbytes)) of the file into memory at `address` (page aligned, that long)."""
        self.read_into_at(address, nbytes, 0)

    def write_from(self, address: int, nbytes: int) -> None:
        """Memory at `address` into bytes [0, round_up(nbytes)) of the file, on the disk when it returns."""
        self.write_from_at(address, nbytes, 0)

    def read_into_at(self, address: int, nbytes: int, offset: int) -> None:
        """`read_into` of the file's bytes from `offset` (a multiple of ALIGN)."""
        self._transfer("read", address, round_up(nbytes), offset)
        if self.mode == "buffered":  # the bytes are in the buffer now: the cache's copy goes
            os.posix_fadvise(self.fd, offset, round_up(nbytes), os.POSIX_FADV_DONTNEED)

    def write_from_at(self, address: int, nbytes: int, offset: int) -> None:
        """`write_from` into the file's bytes from `offset` (a multiple of ALIGN)."""
        self._transfer("write", address, round_up(nbytes), offset)
        if self.mode == "buffered":  # O_DIRECT bypassed the cache; here the pages must reach the disk
            try:  # and leave the cache, as the mapping's write-back does (memory is free again)
                os.fdatasync(self.fd)
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError as error:
                raise BlockIOError(f"cannot write {self.path} back: {error}") from error

    def _transfer(self, kind: str, address: int, length: int, start: int) -> None:
        if address % ALIGN or start % ALIGN:
            raise BlockIOError(
                f"{kind} of {self.path}: buffer address {address:#x} or file offset {start} is not {ALIGN}-byte aligned"
            )
        requests = [
            (offset, min(self.pool.block_bytes, length - offset)) for offset in range(0, length, self.pool.block_bytes)
        ]
        futures = [
            self.pool.submit(self._request, kind, address - start, start + offset, size) for offset, size in requests
        ]
        errors = [f.exception() for f in futures]  # waits for every one: none still writes the buffer
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]

    def _request(self, kind: str, address: int, offset: int, size: int) -> None:
        call = _LIBC.pread if kind == "read" else _LIBC.pwrite
        done = 0
        with self.pool.clock.request(kind, size):
            while done < size:
                moved = call(self.fd, address + offset + done, size - done, offset + done)
                if moved < 0:
                    code = ctypes.get_errno()
                    if code == errno.EINTR:
                        continue
                    if code == errno.EINVAL and self.mode == "direct" and self._fall_back():
                        continue  # accepted at open, refused per request: same request, buffered
                    raise BlockIOError(
                        f"{kind} of {self.path} failed at byte {offset + done} "
                        f"({size - done} bytes, {self.mode} I/O): {os.strerror(code)}"
                    )
                if moved == 0:
                    raise BlockIOError(
                        f"{kind} of {self.path} stopped at byte {offset + done}: the file ends "
                        f"there, {offset + size} bytes expected (truncated swap file?)"
                    )
                done += moved

    def _fall_back(self) -> bool:
        with self._mode_lock:
            if self.mode == "direct":
                log.info("NVMe store: %s refuses O_DIRECT requests; using buffered I/O for it", self.path)
                buffered = os.open(self.path, os.O_RDWR)
                os.dup2(buffered, self.fd)  # every request in flight retries on the same descriptor number
                os.close(buffered)
                self.mode = "buffered"
        return True

    def close(self) -> None:
        os.close(self.fd)


class Workers:
    """`count` threads running submitted calls in order, each returning a Future. Their stacks are
    small (STACK_BYTES) and made at once: RLIMIT_DATA counts a thread's stack (glibc's default 8 MiB
    each), and a store's dozen I/O threads would otherwise take ~100 MB of a capped process's
    budget (tests/test_inference.py's capped run)."""

    STACK_BYTES = 512 * 1024  # a pread through ctypes and a Python frame or two

    def __init__(self, count: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        previous = threading.stack_size(self.STACK_BYTES)
        try:
            self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(count)]
            for thread in self._threads:
                thread.start()
        finally:
            threading.stack_size(previous)

    @property
    def count(self) -> int:
        return len(self._threads)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()


class IOPool:
    """The threads that issue a store's requests (`depth` in flight) and the clock they report to."""

    def __init__(self, depth: int = DEPTH, block_bytes: int = BLOCK_BYTES, mode: str = "direct"):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise StoreError(f"NVMe store: I/O depth must be a positive integer, got {depth!r}")
        if (
            isinstance(block_bytes, bool)
            or not isinstance(block_bytes, int)
            or block_bytes < ALIGN
            or block_bytes % ALIGN
        ):
            raise StoreError(
                f"NVMe store: I/O block size must be a positive multiple of {ALIGN} bytes, got {block_bytes!r}"
            )
        if mode not in MODES:
            raise StoreError(f"NVMe store: zeroshard.nvme_io must be one of {list(MODES)}, got {mode!r}")
        self.depth, self.block_bytes, self.mode = depth, block_bytes, mode
        self.clock = IOClock()
        self._threads = Workers(depth, "zeroshard-nvme-io")

    def submit(self, fn, *args):
        return self._threads.submit(fn, *args)

    def shutdown(self) -> None:
        self._threads.shutdown()
