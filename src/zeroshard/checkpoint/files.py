"""The files of a checkpoint: safetensors written as a stream and read by element range, checksums,
atomic small files.

[Note: checksums]
Every file a checkpoint or snapshot writes is recorded in its manifest with its size and a checksum,
checked when it is read. The checksum guards against files that were torn, truncated or damaged
on their way (a crash mid-write, a full disk, a copy between machines), not against someone who
edits them: the manifest that holds the checksums lies beside the files. So it is xxHash's
128-bit XXH3 (the `xxhash` package), not a cryptographic hash. Hashing runs over every byte a save
writes, a snapshot sends and receives, and a load verifies. sha256 on one core is no faster than
writing the same bytes to a file in host memory and several times slower than copying them, so it
would set the pace of a save, a snapshot and a load; XXH3 is faster than both
(docs/bench/checksums.txt). A record names its algorithm by its key: `{"xxh3_128": <hex>,
"bytes": n}`; checkpoints of format versions 1 and 2 carry `{"sha256": <hex>, "bytes": n}` and are
verified with sha256.

[Note: our own safetensors reader and writer]
A safetensors file is 8 bytes of header length (little-endian u64), a JSON header giving each
tensor's dtype, shape and byte range, then the raw little-endian bytes, back to back. The
`safetensors` package writes a file only from tensors that are all in memory at once, and reads
through a memory map whose touched pages count towards the process's resident memory until it is
closed. Checkpoints need three things it does not offer:
  * write a file whose tensors arrive one at a time (consolidation: peak memory ~ one unit),
  * hash the bytes while they are written (no second pass over a shard to checksum it),
  * read an arbitrary element range of a flattened tensor (the part of a parameter that falls into
    one rank's shard) straight into a destination buffer.
So this module writes and reads the format itself (it is that small). The files are ordinary
safetensors files: the tests read them with `safetensors.torch.load_file` and `safe_open`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import struct
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import xxhash

_HEADER_LIMIT = 100 * 1024 * 1024  # the safetensors reference reader's limit, too


class _Digest(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


# [Note: checksums]: the algorithm a record is written with, and every one a record may name
CHECKSUM = "xxh3_128"
CHECKSUMS: dict[str, Callable[..., _Digest]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_HASH_CHUNK = 1024 * 1024  # small: hashing must not add to the peak memory of consolidation

DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded: damaged, incomplete, or from another model.
    The message names the file and the problem."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype '{name}'")
    return dtype


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a CPU tensor that is already contiguous)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only for Python >= 3.12


class SafetensorsWriter:
    """A safetensors file whose header is known up front and whose tensors are written one by one,
    in `specs` order. The file's checksum is computed while writing; `close()` returns its record
    ([Note: checksums]). `write_over`: a file already at `path` is written over from its start and
    cut to size at `close()`, keeping the storage it has (a tmpfs file's pages), instead of being
    truncated first."""

    def __init__(
        self,
        path,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        write_over: bool = False,
    ):
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, dtype, shape in specs:
            if name in header:
                raise ValueError(f"tensor '{name}' listed twice")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
        self.path = Path(path)
        self._pending = list(specs)
        self._next = 0
        self._hash = CHECKSUMS[CHECKSUM]()
        self._bytes = 0
        self._write_over = write_over and self.path.is_file()
        self._file = open(self.path, "r+b" if self._write_over else "wb")
        self._emit(memoryview(struct.pack("<Q", len(raw))))
        self._emit(memoryview(raw))

    def _emit(self, data: memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._bytes += data.nbytes

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._pending):
            raise ValueError(f"{self.path.name}: tensor '{name}' written after the last one")
        expected, dtype, shape = self._pending[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (expected, dtype, tuple(shape)):
            raise ValueError(
                f"{self.path.name}: expected tensor '{expected}' {dtype} {list(shape)} next, "
                f"got '{name}' {tensor.dtype} {list(tensor.shape)}"
            )
        self._emit(_as_bytes(tensor))
        self._next += 1

    def close(self) -> dict:
        """Flush and fsync; returns the file's record, {"xxh3_128": ..., "bytes": ...}."""
        if self._next != len(self._pending):
            missing = [name for name, _, _ in self._pending[self._next :]]
            raise ValueError(f"{self.path.name}: {len(missing)} tensors never written, first '{missing[0]}'")
        if self._write_over:
            self._file.truncate(self._bytes)  # what is left of the file it was written over
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return {CHECKSUM: self._hash.hexdigest(), "bytes": self._bytes}

    def abort(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def write_safetensors(
    path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, write_over: bool = False
) -> dict:
    """All of `tensors` into one file; returns its record ([Note: checksums]). `write_over`: as
    SafetensorsWriter's."""
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    writer = SafetensorsWriter(path, specs, metadata, write_over)
    try:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


class SafetensorsReader:
    """Reads element ranges of the tensors in one safetensors file with positioned reads (no mmap).
    Every structural problem is a CheckpointError naming the file."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file is missing") from None
        try:
            self._parse_header(os.fstat(self._file.fileno()).st_size)
        except BaseException:
            self._file.close()
            raise

    def _damaged(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {problem} (truncated or corrupted file)")

    def _parse_header(self, size: int) -> None:
        head = self._file.read(8)
        if len(head) < 8:
            raise self._damaged(f"only {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _HEADER_LIMIT):
            raise self._damaged(f"header claims {length} bytes but the file has {size}")
        try:
            header = json.loads(self._file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._damaged(f"header is not valid JSON ({error})") from None
        if not isinstance(header, dict):
            raise self._damaged("header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + length
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        for name, entry in header.items():
            try:
                dtype, shape = CODE_DTYPES[entry["dtype"]], tuple(entry["shape"])
                begin, end = entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._damaged(f"header entry of tensor '{name}' is malformed") from None
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise self._damaged(f"tensor '{name}' has {end - begin} bytes for shape {list(shape)}")
            if self._data_start + end > size:
                raise self._damaged(
                    f"tensor '{name}' ends at byte {self._data_start + end} but the file has {size} bytes"
                )
            self.entries[name] = (dtype, shape, self._data_start + begin)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[0]

    def _entry(self, name: str):
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: has no tensor '{name}' (damaged or not this checkpoint's file)")
        return self.entries[name]

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor, in the file's dtype (1-D, CPU)."""
        dtype, shape, _ = self._entry(name)
        hi = math.prod(shape) if hi is None else hi
        out = torch.empty(hi - lo, dtype=dtype)
        self._read_raw(name, lo, hi, out)
        return out

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of the flattened tensor into `out` (1-D, hi - lo elements, any dtype/device)."""
        assert out.dim() == 1 and out.numel() == hi - lo, (out.shape, lo, hi)
        if out.dtype == self._entry(name)[0] and out.device.type == "cpu" and out.is_contiguous():
            self._read_raw(name, lo, hi, out)
        else:
            out.copy_(self.read(name, lo, hi))

    def _read_raw(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        dtype, shape, start = self.entries[name]
        if not 0 <= lo <= hi <= math.prod(shape):
            raise IndexError(f"{self.path}: elements [{lo}, {hi}) outside tensor '{name}' {list(shape)}")
        # The tensor's memory through ctypes, not numpy: numpy() would mark its storage not resizable
        # for good, and the quantized store frees a master's storage between uses (inference/store.py).
        nbytes = out.numel() * out.element_size()
        buffer = (
            memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B") if nbytes else memoryview(b"")
        )
        position, done = start + lo * dtype.itemsize, 0
        while done < buffer.nbytes:
            got = os.preadv(self._file.fileno(), [buffer[done:]], position + done)
            if got == 0:
                raise self._damaged(f"tensor '{name}' ends early")
            done += got

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def record_of(data: bytes | memoryview) -> dict:
    """The record of bytes in memory: {"xxh3_128": ..., "bytes": ...} ([Note: checksums])."""
    return {CHECKSUM: CHECKSUMS[CHECKSUM](data).hexdigest(), "bytes": len(data)}


def algorithm_of(record: dict) -> str:
    """The checksum a record carries (one of CHECKSUMS)."""
    return next(name for name in CHECKSUMS if name in record)


def matches(data: bytes | memoryview, record: dict) -> bool:
    """Whether bytes in memory have the size and checksum of `record`, in the record's algorithm."""
    algorithm = algorithm_of(record)
    return len(data) == record["bytes"] and CHECKSUMS[algorithm](data).hexdigest() == record[algorithm]


def hash_file(path, algorithm: str = CHECKSUM) -> dict:
    """The record of a file, {algorithm: ..., "bytes": ...}, read in chunks (constant memory)."""
    digest, size = CHECKSUMS[algorithm](), 0
    chunk = bytearray(_HASH_CHUNK)
    view = memoryview(chunk)
    with open(path, "rb") as file:
        while got := file.readinto(chunk):
            digest.update(view[:got])
            size += got
    return {algorithm: digest.hexdigest(), "bytes": size}


def fsync_dir(path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path, data: bytes | memoryview, record: dict | None = None) -> dict:
    """Write `data` to a temporary name beside `path`, fsync, then rename over `path`; return its
    record (`record`, where the caller has already computed it; [Note: checksums])."""
    path = Path(path)
    temporary = temporary_beside(path)
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        put_in_place(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return record if record is not None else record_of(data)


def temporary_beside(path: Path) -> Path:
    """A fresh name in `path`'s directory for a file that becomes `path` once complete."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


def put_in_place(temporary: Path, path: Path) -> None:
    """Make the written file `temporary` durable and rename it over `path` (a reader of the file it
    replaces keeps that one), then make the rename durable."""
    with open(temporary, "rb+") as file:
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)
