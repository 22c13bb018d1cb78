"""How to move offloaded tensors between memory and disk: explicit buffered reads/writes on a thread
pool, a memory mapping steered with read-ahead and write-back, and aligned O_DIRECT requests into
page-aligned anonymous buffers (offload/blockio.py: what zeroshard's NVMe store does for the uses
it is told of ahead of time, [Note: aligned direct I/O]).

    python benchmarks/offload_io.py --path /work/nvme --gigabytes 2

Each method moves the same bytes in 64 MiB tensors; the page cache is dropped for the file before
every pass (posix_fadvise DONTNEED), so reads come from the disk. `dd` O_DIRECT (16 MiB blocks) of
the same file runs in the same invocation, and the direct path says whether O_DIRECT was taken or
the file system refused it (buffered fallback).
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zeroshard.offload.blockio import Buffer, DirectFile, IOPool

CHUNK = 64 * 2**20


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def threadpool(path: str, nbytes: int, write: bool, threads: int = 2) -> float:
    chunks = [torch.ones(CHUNK // 4) for _ in range(nbytes // CHUNK)]
    fd = os.open(path, os.O_RDWR)

    def move(i):
        view = memoryview(chunks[i].numpy()).cast("B")
        (os.pwrite if write else os.preadv)(fd, view if write else [view], i * CHUNK)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(move, range(len(chunks))))
    if write:
        os.fsync(fd)
    os.close(fd)
    return nbytes / (time.perf_counter() - started) / 1e9


def mapped(path: str, nbytes: int, write: bool) -> float:
    fd = os.open(path, os.O_RDWR)
    buffer = mmap.mmap(fd, nbytes)
    tensor = torch.frombuffer(buffer, dtype=torch.float32)
    started = time.perf_counter()
    for i in range(nbytes // CHUNK):
        if i + 1 < nbytes // CHUNK:
            buffer.madvise(mmap.MADV_WILLNEED, (i + 1) * CHUNK, CHUNK)  # read ahead the next one
        part = tensor[i * CHUNK // 4 : (i + 1) * CHUNK // 4]
        if write:
            part.fill_(1.0)
        else:
            part.sum()
    if write:
        buffer.flush()
    elapsed = time.perf_counter() - started
    del tensor, part
    buffer.close()
    os.close(fd)
    return nbytes / elapsed / 1e9


def direct(path: str, nbytes: int, write: bool) -> float:
    """The store's path: each 64 MiB tensor one DirectFile request set (4 MiB blocks, 8 in flight),
    two tensors in flight (the store's two readers), into page-aligned anonymous buffers."""
    pool = IOPool()
    files = DirectFile(Path(path), pool)
    direct.mode = files.mode
    buffers = [Buffer(CHUNK) for _ in range(2)]

    def move(i):
        address = buffers[i % 2].address
        if write:
            files.write_from_at(address, CHUNK, i * CHUNK)
        else:
            files.read_into_at(address, CHUNK, i * CHUNK)

    started = time.perf_counter()
    with ThreadPoolExecutor(2) as tensors:
        list(tensors.map(move, range(nbytes // CHUNK)))
    elapsed = time.perf_counter() - started
    for buffer in buffers:
        buffer.free()
    files.close()
    pool.shutdown()
    return nbytes / elapsed / 1e9


def dd(path: str, nbytes: int, write: bool) -> float:
    flags = (
        ["if=/dev/zero", f"of={path}", "oflag=direct", "conv=notrunc"]
        if write
        else [f"if={path}", "of=/dev/null", "iflag=direct"]
    )
    result = subprocess.run(["dd", *flags, "bs=16M", f"count={nbytes // 2**24}"], capture_output=True, text=True)
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", result.stderr)
    return int(match.group(1)) / float(match.group(2)) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", required=True)
    parser.add_argument("--gigabytes", type=float, default=2)
    args = parser.parse_args()
    nbytes = int(args.gigabytes * 2**30) // CHUNK * CHUNK
    path = os.path.join(args.path, "offload-io.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    os.close(fd)
    print(f"{nbytes / 1e9:.1f} GB in 64 MiB tensors, page cache dropped before each pass")
    print(
        f"$ python benchmarks/offload_io.py --path {args.path} --gigabytes {args.gigabytes}; "
        f"load average {os.getloadavg()[0]:.1f} at the start"
    )
    methods = (
        ("dd O_DIRECT, 16 MiB blocks", dd),
        ("thread pool (2 threads, pread/pwrite)", threadpool),
        ("memory map + read-ahead", mapped),
        ("aligned direct (4 MiB x 8, store)", direct),
    )
    for name, fn in methods:
        for write in (True, False):
            drop_cache(path)
            rate = fn(path, nbytes, write)
            mode = f"  ({direct.mode} I/O)" if fn is direct else ""
            print(f"  {name:<40} {'write' if write else 'read ':<5} {rate:6.2f} GB/s{mode}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    os.unlink(path)


if __name__ == "__main__":
    main()
