"""One full state dict file (the model's own names, tied aliases included), written group by group.

Safetensors output is streamed: the header is planned from the shapes alone, then each group's
parameters are written as they arrive, so memory stays at one group however large the model is
([Note: our own safetensors reader and writer] in files.py). A `.pt` file is collected in memory and
written with torch.save at the end, which cannot stream.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch

from zeroshard.checkpoint.files import SafetensorsWriter, fsync_dir

FORMATS = ("safetensors", "pt")


def format_for(path, fmt: str | None) -> str:
    """The output format: `fmt`, or guessed from the file suffix (.pt/.pth/.bin: pt)."""
    if fmt is None:
        return "pt" if Path(path).suffix in (".pt", ".pth", ".bin") else "safetensors"
    if fmt not in FORMATS:
        raise ValueError(f"output format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


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
    ):
        self.path = Path(path)
        self.dtype = dtype
        self.format = fmt
        self.aliases_of: dict[str, list[str]] = {}
        for alias, name in aliases.items():
            self.aliases_of.setdefault(name, []).append(alias)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._temporary = self.path.with_name(f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}")
        specs = []
        for name, shape in params:
            specs += [(n, dtype, tuple(shape)) for n in [name, *self.aliases_of.get(name, [])]]
        specs += [(name, buffer_dtype, tuple(shape)) for name, (buffer_dtype, shape) in buffers.items()]
        self.tensors = len(specs)
        self.bytes = sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in specs)
        self._collected: dict[str, torch.Tensor] = {}
        self._stream = None
        if fmt == "safetensors":
            self._stream = SafetensorsWriter(self._temporary, specs, {"format": "pt"})

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
