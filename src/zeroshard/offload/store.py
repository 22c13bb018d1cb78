"""Offload stores: where tensors that do not need to stay in device memory live between uses.

One interface, two homes (DESIGN.md, "Offload stores"):
  * `CPUStore` — host memory (page-locked when a GPU exists, so copies to it can be asynchronous).
  * `NVMeStore` — one preallocated file per tensor under the user's `nvme_path`, memory-mapped. The
    tensor the engine holds *is* the mapping, so every consumer (optimizer, all-gather, checkpoint)
    reads and writes it like any tensor, while the kernel moves the bytes. zeroshard steers that
    movement explicitly: `stage` (a use that may write) and `prefetch` of frozen tensors read the
    next tensors with aligned direct reads into buffers moved in place of the mapping, any other
    `prefetch` reads the mapping's pages ahead (MADV_POPULATE_READ); `ready` waits for a tensor's
    read; `release` writes back and drops the pages from memory, on a thread pool, so that I/O of
    sub-group k+1 overlaps the math on sub-group k and resident memory stays bounded by the
    tensors in use.

[Note: why memory-mapped files]
The tensor stays the mapping: every consumer (optimizer, all-gather, checkpoint) keeps using plain
tensors at any moment, and writes to it need no staging buffer; explicit buffered pwrite/pread on a
thread pool would need one and writes more slowly than the mapping (measured with
benchmarks/offload_io.py: docs/offload_nvme.md, docs/bench/offload_io.txt). Uses the store is told
of ahead of time read and write with aligned direct I/O instead ([Note: where a swap file's tensor
lies] in offload/swapfile.py). Files are preallocated with posix_fallocate, so a full disk is an
error before training starts rather than SIGBUS in a step; each use first checks that the file still
exists with its full size, so a deleted or truncated swap file is reported instead of crashing the
process.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import shutil
import time
import weakref
from concurrent.futures import Future, wait as wait_for
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.offload.blockio import ALIGN, DirectFile, IOPool, Workers, round_up
from zeroshard.offload.cleanup import (
    PASSING_MARK,
    create_locked_dir,
    describe_others,
    keep_on_sigterm,
    reclaim_dead,
    release_root,
    remove_on_sigterm,
)
from zeroshard.offload.errors import StoreError
from zeroshard.offload.swapfile import Home, SwapFile, make_writable, read_ahead, read_into_buffer, write_back

log = logging.getLogger(__name__)

WRITE_BEHIND_BYTES = 32 * 2**20  # released bytes that may wait for their write-back (see NVMeStore.release)

# [Note: a build's files count as free]
# A model built under zero.Init(remote_device="nvme") keeps its slices in a store of its own
# (`passing=True`), whose files are deleted as the engine takes each parameter, before the states
# that replace them are complete: at any moment the two together exceed the engine's bytes by at
# most one unit's slices. So the engine's free-space check counts the passing stores' bytes on the
# same file system as free; otherwise a model whose slices fill a third of the disk could not be
# trained on it, although it fits.
_PASSING: weakref.WeakSet = weakref.WeakSet()


@dataclass
class IOCounters:
    prefetched_bytes: int = 0
    released_bytes: int = 0
    wait_s: float = 0.0  # time the training thread waited for the store


class CPUStore:
    """Host memory (zeroshard.core.placement.Store). On a CPU-only machine this is the memory the
    engine computes in, so the offload moves no bytes; the same configuration moves states off the
    GPU on a GPU machine."""

    kind = "cpu"
    in_memory = True
    offloaded_bytes = 0  # nothing it holds lives outside this process's memory

    def __init__(self, pin_memory: bool = False):
        self.pin = pin_memory and torch.cuda.is_available()
        self.counters = IOCounters()
        self.bytes_held = 0
        self._held: dict[int, torch.Tensor] = {}  # id -> tensor, so `holds` can answer

    def tensor(self, key: str, numel: int, dtype: torch.dtype, pieces=()) -> torch.Tensor:
        self.bytes_held += numel * torch.empty(0, dtype=dtype).element_size()
        tensor = torch.zeros(numel, dtype=dtype, pin_memory=self.pin)
        self._held[id(tensor)] = tensor
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._held

    def addressable_from(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def resident(self, tensor: torch.Tensor) -> bool:
        return True

    def held_bytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def prefetch(self, tensors) -> None:
        pass

    def stage(self, tensors) -> None:
        pass

    def ready(self, tensors) -> None:
        pass

    def freeze(self, tensors, frozen: bool = True) -> None:
        pass

    def release(self, tensors) -> None:
        pass

    def check(self, tensors) -> None:
        pass

    def wait(self) -> None:
        pass

    def destroy(self) -> None:
        self._held.clear()
        self.bytes_held = 0


class NVMeStore:
    """Memory-mapped swap files under `nvme_path` (zeroshard.core.placement.Store)."""

    kind = "nvme"
    in_memory = False

    def __init__(
        self,
        nvme_path: str | os.PathLike,
        rank: int,
        bytes_needed: int,
        threads: int = 2,
        coordinate: dict | None = None,
        io: IOPool | None = None,
        passing: bool = False,
    ):
        """`rank`: the data-parallel rank; `coordinate`: under tensor/pipeline parallelism this rank's
        {"tp": t, "pp": p} too, named in the directory (see `store_stem`); `io`: the threads and
        request size of aligned reads and writes (default: offload/blockio.py's); `passing`: its
        files are deleted while another store fills ([Note: a build's files count as free])."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise StoreError(f"NVMe store: threads must be a positive integer (aio.thread_count), got {threads!r}")
        self.threads = threads
        self.io = io if io is not None else IOPool()
        stem = store_stem(rank, coordinate) + (PASSING_MARK if passing else "")
        self.root, lock = make_root(Path(nvme_path), stem, bytes_needed)
        self.counters = IOCounters()
        self.bytes_held = 0
        self._files: dict[int, SwapFile] = {}  # id(tensor) -> its swap file
        self._pool = Workers(threads, "zeroshard-nvme")
        self._pending: list[tuple[Future, int]] = []  # write-backs and their bytes
        # Reads ahead run on their own threads, so that a read is never queued behind write-backs;
        # two reads in flight keep the mapping's disk busier than one, the next read going on while
        # the consumer of the last one computes. Four: ZeRO-Inference's units are 4-12 MB (one Linear
        # each), one to three aligned requests, so four tensors in flight keep the I/O pool's eight
        # requests busy.
        self._readers = Workers(max(4, threads), "zeroshard-nvme-read")
        # Files go away on destroy(), at normal interpreter exit and on SIGTERM, whichever comes
        # first; after SIGKILL the next store on the same path reclaims them ([Note: swap files
        # of dead processes] in offload/cleanup.py).
        self._finalizer = weakref.finalize(self, release_root, self.root, lock)
        atexit.register(self._finalizer)
        remove_on_sigterm(self.root)
        if passing:
            _PASSING.add(self)

    def tensor(self, key: str, numel: int, dtype: torch.dtype, pieces=()) -> torch.Tensor:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        path = self.root / f"{key}.swp"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # Whole aligned blocks ([Note: aligned direct I/O]); the blocks are reserved now, so
                # a full disk is ENOSPC here, not later.
                os.posix_fallocate(fd, 0, round_up(max(nbytes, 1), ALIGN))
                buffer = mmap.mmap(fd, max(nbytes, 1))
                direct = DirectFile(path, self.io)
            except OSError:
                os.close(fd)
                raise
        except OSError as error:
            raise StoreError(f"NVMe store cannot create {path} ({nbytes} bytes): {error}") from error
        tensor = torch.frombuffer(buffer, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)
        self._files[id(tensor)] = SwapFile(path, nbytes, path.stat().st_ino, buffer, tensor, fd, direct)
        self.bytes_held += nbytes
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._files

    def addressable_from(self, device: torch.device) -> bool:
        return device.type == "cpu"  # the mapping is host memory: the CPU computes on it in place

    def resident(self, tensor: torch.Tensor) -> bool:
        return not self.holds(tensor)  # its bytes live in a file; pages come and go

    def held_bytes(self, tensor: torch.Tensor) -> int:
        return 0 if self.holds(tensor) else tensor.numel() * tensor.element_size()

    @property
    def offloaded_bytes(self) -> int:
        return self.bytes_held

    @property
    def io_mode(self) -> str:
        """How the store's reads for a known use reach the files: "mapped" (zeroshard.nvme_io), or
        its aligned requests' path: "direct" (O_DIRECT), "buffered" (asked for, or the file system
        refuses O_DIRECT: tmpfs), "mixed" or "none" (no files yet)."""
        if self.io.mode == "mapped":
            return "mapped"
        modes = {item.direct.mode for item in self._files.values()}
        return modes.pop() if len(modes) == 1 else ("mixed" if modes else "none")

    def _mapped(self, tensors) -> list[SwapFile]:
        return [self._files[id(t)] for t in tensors if id(t) in self._files]

    def check(self, tensors) -> None:
        """A swap file that vanished or shrank is an error, never garbage or SIGBUS."""
        for mapped in self._mapped(tensors):
            try:
                stat = mapped.path.stat()
            except FileNotFoundError:
                raise StoreError(f"NVMe swap file {mapped.path} is missing (deleted while training?)") from None
            if stat.st_ino != mapped.inode or stat.st_size < mapped.nbytes:
                raise StoreError(
                    f"NVMe swap file {mapped.path} is truncated or replaced: {stat.st_size} "
                    f"bytes on disk, {mapped.nbytes} expected"
                )

    def prefetch(self, tensors) -> None:
        """Start reading these tensors, on the reader threads: the caller goes on computing. Frozen
        tensors are read into buffers (call `ready` before their use), others through the mapping
        ([Note: where a swap file's tensor lies] in offload/swapfile.py)."""
        self._read(tensors, buffered=None)

    def stage(self, tensors) -> None:
        """Start reading these tensors into buffers for a use that may write them: call `ready`
        before it, and `release` after it (which writes them back with aligned direct writes)."""
        self._read(tensors, buffered=True)

    def _read(self, tensors, buffered: bool | None) -> None:
        mapped = self._mapped(tensors)
        self.check(tensors)
        for item in mapped:
            if item.home is Home.BUFFER or (item.reading is not None and not item.reading.done()):
                continue  # there already, or on its way
            if self.io.mode != "mapped" and (buffered or (buffered is None and item.frozen)):
                item.reading = self._readers.submit(read_into_buffer, item, item.releasing, item.releases)
            else:
                self._readers.submit(read_ahead, item, item.releasing, item.releases, self.io.clock)
            self.counters.prefetched_bytes += item.nbytes

    def ready(self, tensors) -> None:
        """Until the reads `prefetch`/`stage` started for these tensors are done; a failed read is
        raised here (StoreError naming the file), before anything used a tensor half read."""
        started = time.perf_counter()
        try:
            for item in self._mapped(tensors):
                reading, item.reading = item.reading, None
                if reading is not None and (error := reading.exception()) is not None:  # exception() waits
                    raise error
        finally:
            self.counters.wait_s += time.perf_counter() - started

    def freeze(self, tensors, frozen: bool = True) -> None:
        """These tensors are not written until `freeze(tensors, False)`: their reads go into buffers
        that are read-only (a write faults, it is never lost) and released without a write-back.
        Unfreezing waits for their reads and makes a buffer in place writable, written back at its
        release."""
        for item in self._mapped(tensors):
            if not frozen and item.frozen:
                self.ready([item.tensor])
                if item.releasing is not None:  # a write landing between its write and its remap is lost
                    wait_for([item.releasing])
                with item.lock:
                    if item.home is Home.BUFFER:
                        make_writable(item)
            item.frozen = frozen

    def release(self, tensors) -> None:
        """Write these tensors back and drop their pages from memory, off the training thread; waits
        while more than WRITE_BEHIND_BYTES of earlier releases are not written back yet (a caller
        that writes faster than the disk, such as a model's load, would otherwise keep every dirty
        page resident). A frozen tensor's buffer writes nothing: it is only unmapped."""
        for item in self._mapped(tensors):
            self.counters.released_bytes += item.nbytes
            item.releases += 1
            item.releasing = self._pool.submit(write_back, item, self.io.clock)
            self._pending.append((item.releasing, item.nbytes))
        self._pending = [(f, n) for f, n in self._pending if not f.done() or f.exception()]
        behind = [(f, n) for f, n in self._pending if not f.done()]
        while len(behind) > 1 and sum(n for _, n in behind) > WRITE_BEHIND_BYTES:
            started = time.perf_counter()
            wait_for([behind.pop(0)[0]])  # its failure stays in _pending for wait() to raise
            self.counters.wait_s += time.perf_counter() - started

    def drop(self, tensors) -> None:
        """Forget these tensors and delete their files: their values are no longer needed (a
        zero.Init shard once the engine holds its parameter). A tensor keeps its mapping, valid
        until the tensor is freed; the disk space returns when the last mapping goes."""
        for item in self._mapped(tensors):
            if item.releasing is not None:
                wait_for([item.releasing])  # a failure stays in _pending for wait() to raise
            del self._files[id(item.tensor)]
            item.close()
            item.path.unlink(missing_ok=True)
            self.bytes_held -= item.nbytes

    @property
    def empty(self) -> bool:
        """No tensor lives in this store (none made yet, or every one dropped)."""
        return not self._files

    def wait(self) -> None:
        """Until every write-back has finished; the first failure is raised once (a retried step
        writes its tensors back again)."""
        pending, self._pending = self._pending, []
        errors = [error for f, _ in pending if (error := f.exception()) is not None]  # exception() waits
        if errors:
            raise errors[0]

    def destroy(self) -> None:
        self.wait()
        self._pool.shutdown()
        self._readers.shutdown()
        self.io.shutdown()
        for item in self._files.values():
            item.close()
        self._files.clear()  # the tensors keep their mappings alive until they are dropped
        self._finalizer()
        keep_on_sigterm(self.root)
        self.bytes_held = 0


def store_stem(rank: int, coordinate: dict | None = None) -> str:
    """`zeroshard-<pid>-rank<dp>[-tp<t>-pp<p>]`: a dp rank repeats in every tp/pp part of a grid, so
    the directory says which part too. Uniqueness comes from the pid and the nonce that
    `create_locked_dir` appends (ranks sharing a dp rank are other processes, or in one process
    other stores); the coordinate is for the people reading `describe_others` and `ls`."""
    extra = "".join(f"-{d}{int(coordinate.get(d, 0))}" for d in ("tp", "pp")) if coordinate else ""
    return f"zeroshard-{os.getpid()}-rank{rank}{extra}"


def _passing(root: Path) -> list[NVMeStore]:
    """This process's passing stores on `root`'s file system."""
    device = root.stat().st_dev
    return [s for s in list(_PASSING) if s.root.exists() and s.root.stat().st_dev == device]


def make_root(base: Path, stem: str, bytes_needed: int) -> tuple[Path, int]:
    """This store's directory under `base` and the descriptor of the lock that marks it alive, after
    reclaiming what dead processes left there; StoreError when `base` is unwritable or too full."""
    try:
        base.mkdir(parents=True, exist_ok=True)
        reclaim_dead(base)
        root, lock = create_locked_dir(base, stem)
    except OSError as error:
        raise StoreError(f"offload nvme_path '{base}' is not writable: {error}") from error
    try:
        probe = root / ".probe"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as error:
        release_root(root, lock)
        raise StoreError(f"offload nvme_path '{base}' is not writable: {error}") from error
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # the other ranks of this node do the same
    passing = _passing(root)
    passing_bytes = local_ranks * sum(store.bytes_held for store in passing)
    free = shutil.disk_usage(root).free + passing_bytes
    bytes_needed *= local_ranks
    if free < bytes_needed:
        release_root(root, lock)
        counted = f" (counting {passing_bytes / 1e9:.2f} GB of zero.Init's slices, deleted as the engine takes them)"
        raise StoreError(
            f"offload nvme_path '{base}' has {free / 1e9:.2f} GB free{counted if passing_bytes else ''}, this "
            f"rank needs {bytes_needed / 1e9:.2f} GB for the offloaded states of this node's ranks"
            + describe_others(base)
        )
    return root, lock
