"""How fast the checksums a checkpoint may carry run on this machine, against copying the same bytes
([Note: checksums] in src/zeroshard/checkpoint/files.py).

    python benchmarks/checksums.py --out docs/bench/checksums.txt

One process, one thread. For a buffer of `--mib` MiB of random bytes, the best of `--repeat` runs of:
sha256 and XXH3-128 over the buffer (what a save, a snapshot and a verified load compute per byte),
a copy into a preallocated tensor (host memory's pace), and a write into a file under `--dir` (default
/dev/shm, host memory through the page cache; point it at a disk to compare). GiB/s = size / time.
Then what a snapshot's files cost there ([Note: snapshot files written over] in checkpoint/snapshot.py):
the same bytes written over a file that already holds them, copied into a mapping of a new file
allocated first (posix_fallocate, as a received file is), and into a pre-faulted mapping of an
existing file; the new files' runs include removing them, as a snapshot removes the one it replaces.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from two_ranks import write_record


def best_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default: 256)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each, the best counts (default: 5)")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where the write goes (default: /dev/shm)")
    parser.add_argument("--out", type=Path, help="also write the record (date, cores, command, table) to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    size = args.mib * 2**20
    data = os.urandom(size)
    source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # the pages exist before the timed copies

    def write() -> None:
        with tempfile.NamedTemporaryFile(dir=args.dir) as file:
            file.write(data)
            file.flush()

    existing = args.dir / f".zeroshard-checksums-{os.getpid()}"
    existing.write_bytes(data)

    def write_over() -> None:
        with open(existing, "r+b") as file:
            file.write(data)
            file.flush()

    def into_mapping(path: Path, populate: int) -> None:
        with open(path, "r+b") as file:
            if populate == 0:
                os.posix_fallocate(file.fileno(), 0, size)
            with mmap.mmap(file.fileno(), size, flags=mmap.MAP_SHARED | populate) as mapped:
                view = torch.frombuffer(mapped, dtype=torch.uint8)
                view.copy_(source)
                del view  # the map cannot close while a tensor points into it

    def into_new_mapping() -> None:
        with tempfile.NamedTemporaryFile(dir=args.dir) as file:
            into_mapping(Path(file.name), 0)

    rows = {
        "sha256": lambda: hashlib.sha256(data).hexdigest(),
        "xxh3_128": lambda: xxhash.xxh3_128(data).hexdigest(),
        "copy in memory": lambda: target.copy_(source),
        f"write to {args.dir}": write,
        "write over a file": write_over,
        "new mapped file": into_new_mapping,
        "file mapped, pre-faulted": lambda: into_mapping(existing, mmap.MAP_POPULATE),
    }
    lines = [f"{args.mib} MiB, best of {args.repeat}, xxhash {xxhash.VERSION}", f"{'what':<26} {'GiB/s':>8}"]
    try:
        for name, fn in rows.items():
            lines.append(f"{name:<26} {size / best_seconds(fn, args.repeat) / 2**30:>8.2f}")
    finally:
        existing.unlink(missing_ok=True)
    text = "\n".join(lines)
    print(text)
    write_record(args.out, __file__, text)


if __name__ == "__main__":
    main()
