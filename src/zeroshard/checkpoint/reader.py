"""Reading a saved checkpoint at any world size: element ranges of a parameter, assembled from the
source ranks' shard files.

[Note: resharding by element ranges]
Rank r of a checkpoint written at N ranks holds elements [r*S, (r+1)*S) of each group's padded flat
buffer (S = that group's shard_numel at N). A reader at M ranks wants, for each parameter piece
in its own shard, elements [lo, hi) *of that parameter*; the manifest gives the parameter's group
and offset in the source buffer, so the wanted source range is [offset + lo, offset + hi), which
spans source ranks (offset + lo) // S to (offset + hi - 1) // S. Padding never moves: N and M have
different shard sizes and paddings (4 -> 3 ranks), and source and target may even group parameters
differently (another stage-3 persistence threshold), yet a parameter's elements are found by name.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zeroshard.checkpoint.files import CheckpointError, SafetensorsReader
from zeroshard.checkpoint.manifest import BUFFERS, ParamIndex, master_key, rank_file, state_key


def _slices(group: dict, world_size: int) -> list[tuple[int, int, int]]:
    """(rank, start, end) of each source rank's slice of a group's flat buffer."""
    counts = group.get("shard_counts") or [group["shard_numel"]] * world_size
    starts = [sum(counts[:r]) for r in range(world_size)]
    return [(r, starts[r], starts[r] + counts[r]) for r in range(world_size)]


class CheckpointReader:
    """Element-range reads from one checkpoint directory. Files are opened on first use."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self.index = ParamIndex(manifest)
        self.world_size = int(manifest["world_size"])
        self._files: dict[str, SafetensorsReader] = {}

    def file(self, name: str) -> SafetensorsReader:
        if name not in self._files:
            self._files[name] = SafetensorsReader(self.path / name)
        return self._files[name]

    def read_group(self, group_index: int, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of a group's padded flat buffer for `key` ('master' or a state name)
        into `out` (1-D, hi - lo elements); see [Note: resharding by element ranges]."""
        group = self.manifest["groups"][group_index]
        name = master_key(group_index) if key == "master" else state_key(group_index, key)
        for rank, start, end in _slices(group, self.world_size):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                self.file(rank_file(rank)).read_into(name, a - start, b - start, out[a - lo : b - lo])

    def read_param(self, name: str, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of parameter `name` (flattened) for `key` into `out`."""
        group_index, offset = self.index.locate(name)
        if key != "master" and self.index.state_kinds(name).get(key) != "elementwise":
            raise CheckpointError(f"{self.path}: no optimizer state '{key}' saved for parameter '{name}'")
        self.read_group(group_index, key, offset + lo, offset + hi, out)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's non-parameter state (rank 0 wrote it), or {} when the model had none."""
        if not self.manifest.get("buffers"):
            return {}
        file = self.file(BUFFERS)
        return {name: file.read(name).view(file.shape(name)) for name in self.manifest["buffers"]}

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
