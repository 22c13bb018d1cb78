"""The full state dict (the model's own names, tied aliases included), written group by group.

Safetensors output is streamed: the header is planned from the shapes alone, then each group's
parameters are written as they arrive, so memory stays at one group however large the model is
([Note: our own safetensors reader and writer] in files.py). A `.pt` file is collected in memory and
written with torch.save at the end, which cannot stream.

[Note: Hugging Face's sharded layout]
`fmt="hf"` writes a directory as transformers' `save_pretrained` does: the tensors, in order, cut
into files of at most `max_shard_bytes` (a tensor larger than that alone in its file), named
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` mapping each name to its
file and giving the total size; one file is `model.safetensors` with no index. Each file has the
metadata {"format": "pt"} that `from_pretrained` checks. The files stream like the single file (one
open at a time, in order), under temporary names until all are written; the index comes last.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import torch

from zeroshard.checkpoint.files import SafetensorsWriter, fsync_dir, write_atomic

FORMATS = ("safetensors", "pt", "hf")
HF_SHARD_BYTES = 5 * 1000**3  # transformers' save_pretrained default, max_shard_size="5GB"
HF_INDEX = "model.safetensors.index.json"


def format_for(path, fmt: str | None) -> str:
    """The output format: `fmt`, or guessed from the file suffix (.pt/.pth/.bin: pt)."""
    if fmt is None:
        return "pt" if Path(path).suffix in (".pt", ".pth", ".bin") else "safetensors"
    if fmt not in FORMATS:
        raise ValueError(f"output format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


def parse_size(text: str | int) -> int:
    """Bytes from an int or a size as transformers writes it ("5GB", "500MB", "2GiB")."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "b": 1}
        raw = str(text).strip().lower()
        unit = next((u for u in units if raw.endswith(u)), None)
        try:
            value = int(float(raw[: -len(unit)] if unit else raw) * (units[unit] if unit else 1))
        except ValueError:
            value = -1
    if value <= 0:
        raise ValueError(f"max_shard_size {text!r} is not a positive size (bytes, or like '5GB', '500MB', '2GiB')")
    return value


class _HFShards:
    """[Note: Hugging Face's sharded layout]: `specs` cut into files written one after another."""

    def __init__(self, directory: Path, specs: list, max_shard_bytes: int):
        self.directory = directory
        plan: list[list] = [[]]
        size = 0
        for spec in specs:
            nbytes = torch.Size(spec[2]).numel() * spec[1].itemsize
            if plan[-1] and size + nbytes > max_shard_bytes:
                plan.append([])
                size = 0
            plan[-1].append(spec)
            size += nbytes
        count = len(plan)
        self.names = ["model.safetensors"] if count == 1 else [
            f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)
        ]  # fmt: skip
        self.plan = plan
        self.file_of = {spec[0]: k for k, specs_k in enumerate(plan) for spec in specs_k}
        self.total = sum(torch.Size(s[2]).numel() * s[1].itemsize for s in specs)
        suffix = uuid.uuid4().hex[:8]
        self.temporary = [directory / f".{name}.tmp-{suffix}" for name in self.names]
        self._open: SafetensorsWriter | None = None
        self._index = -1

    def write(self, name: str, value: torch.Tensor) -> None:
        k = self.file_of[name]
        if k != self._index:  # the next file: tensors arrive in plan order
            self._close_open()
            self._index = k
            self._open = SafetensorsWriter(self.temporary[k], self.plan[k], {"format": "pt"})
        assert self._open is not None
        self._open.write(name, value)

    def _close_open(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def close(self) -> None:
        self._close_open()
        for temporary, name in zip(self.temporary, self.names):
            os.replace(temporary, self.directory / name)
        if len(self.names) > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {spec[0]: self.names[k] for k, specs in enumerate(self.plan) for spec in specs},
            }
            write_atomic(self.directory / HF_INDEX, (json.dumps(index, indent=2) + "\n").encode())
        fsync_dir(self.directory)

    def abort(self) -> None:
        if self._open is not None:
            self._open.abort()
            self._open = None
        for path in self.temporary:
            path.unlink(missing_ok=True)


class FullModelWriter:
    """Writes `params` (name, shape) in order, each under its tied aliases too, then the buffers.
    The file appears under its final name only when complete (temporary name + os.replace)."""

    def __init__(
        self,
        path,
        params: list[tuple[str, tuple[int, ...]]],
        aliases: dict[str, str],
        buffers: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        dtype: torch.dtype,
        fmt: str,
        max_shard_bytes: int = HF_SHARD_BYTES,
    ):
        """`fmt` "hf": `path` is a directory ([Note: Hugging Face's sharded layout])."""
        self.path = Path(path)
        self.dtype = dtype
        self.format = fmt
        self.aliases_of: dict[str, list[str]] = {}
        for alias, name in aliases.items():
            self.aliases_of.setdefault(name, []).append(alias)
        (self.path if fmt == "hf" else self.path.parent).mkdir(parents=True, exist_ok=True)
        self._temporary = self.path.with_name(f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}")
        specs = []
        for name, shape in params:
            specs += [(n, dtype, tuple(shape)) for n in [name, *self.aliases_of.get(name, [])]]
        specs += [(name, buffer_dtype, tuple(shape)) for name, (buffer_dtype, shape) in buffers.items()]
        self.tensors = len(specs)
        self.bytes = sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in specs)
        self._collected: dict[str, torch.Tensor] = {}
        self._stream: SafetensorsWriter | _HFShards | None = None
        if fmt == "safetensors":
            self._stream = SafetensorsWriter(self._temporary, specs, {"format": "pt"})
        elif fmt == "hf":
            self._stream = _HFShards(self.path, specs, max_shard_bytes)

    def add_param(self, name: str, value: torch.Tensor) -> None:
        """`value` (full shape, any dtype) under `name` and its aliases, converted to the output dtype."""
        converted = value.to("cpu", self.dtype, copy=self._stream is None)  # .pt keeps it: own copy
        for target in [name, *self.aliases_of.get(name, [])]:
            self._put(target, converted)

    def add_buffer(self, name: str, value: torch.Tensor) -> None:
        self._put(name, value.detach().to("cpu", copy=self._stream is None))

    def _put(self, name: str, value: torch.Tensor) -> None:
        if self._stream is not None:
            self._stream.write(name, value)
        else:
            self._collected[name] = value

    def close(self) -> None:
        if isinstance(self._stream, _HFShards):
            self._stream.close()
            return
        if self._stream is not None:
            self._stream.close()
        else:
            with open(self._temporary, "wb") as file:
                torch.save(self._collected, file)
                file.flush()
                os.fsync(file.fileno())
            self._collected = {}
        os.replace(self._temporary, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.abort()
        self._collected = {}
        self._temporary.unlink(missing_ok=True)
