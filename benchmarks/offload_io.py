"""How to move offloaded tensors between memory and disk: explicit reads/writes on a thread pool
versus a memory mapping steered with read-ahead and write-back (what zeroshard's NVMe store does).

    python benchmarks/offload_io.py --path /work/nvme --gigabytes 2

Each method moves the same bytes in 64 MiB tensors; the page cache is dropped for the file before
every pass (posix_fadvise DONTNEED), so reads come from the disk. Compare with `dd` O_DIRECT.
"""
from __future__ import annotations

import argparse
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

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
        part = tensor[i * CHUNK // 4: (i + 1) * CHUNK // 4]
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
    for name, fn in (("thread pool (2 threads, pread/pwrite)", threadpool), ("memory map + read-ahead", mapped)):
        for write in (True, False):
            drop_cache(path)
            print(f"  {name:<40} {'write' if write else 'read ':<5} {fn(path, nbytes, write):6.2f} GB/s")
    os.unlink(path)


if __name__ == "__main__":
    main()
