"""Full weights (a pretrained state dict, a safetensors file or a directory of them) into a sharded
engine: each rank reads only the element ranges of its own master shard, so no rank materialises
the whole model (except at stage 0, where every rank holds it anyway).

Under tensor/pipeline parallelism the full weights are the way between layouts ([Note: checkpoints
across layouts] in layout.py): a pipeline stage takes the parameters it has and leaves the other
stages' keys, and a parameter tensor parallelism cut is read whole (one parameter at a time) and this
tp rank's slice taken along its split dim, as DTensor's Shard (torch.chunk) or Megatron cut it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.checkpoint.common import agree, attempt
from zeroshard.checkpoint.files import CheckpointError, SafetensorsReader
from zeroshard.checkpoint.layout import Layout, layout_of, tp_split_dim
from zeroshard.checkpoint.manifest import model_aliases, persistent_buffers


class _StateDictSource:
    def __init__(self, state_dict: dict[str, torch.Tensor], where: str):
        self.tensors, self.where = state_dict, where

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        out.copy_(self.tensors[name].detach().reshape(-1)[lo:hi])

    def close(self) -> None:
        self.tensors = {}


INDEX = "model.safetensors.index.json"  # what save_pretrained(max_shard_size=...) writes beside its shards


class _SafetensorsSource:
    """One safetensors file, or the `*.safetensors` files of a directory (sharded Hugging Face
    checkpoints: those its model.safetensors.index.json names, when it has one), read by element range."""

    def __init__(self, path: Path):
        files = _indexed_files(path) if path.is_dir() else [path]
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files in this directory")
        self.where = str(path)
        self.readers = [SafetensorsReader(f) for f in files]
        self.owner: dict[str, SafetensorsReader] = {}
        for reader in self.readers:
            for name in reader.keys():
                if name in self.owner:
                    raise CheckpointError(f"{reader.path}: tensor '{name}' is also in {self.owner[name].path}")
                self.owner[name] = reader

    def keys(self) -> list[str]:
        return list(self.owner)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.owner[name].shape(name)

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        self.owner[name].read_into(name, lo, hi, out)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def _indexed_files(directory: Path) -> list[Path]:
    index = directory / INDEX
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            f"{index}: not a safetensors index (a JSON object with a 'weight_map' of tensor name -> file): {error}"
        ) from None
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise CheckpointError(f"{index}: names {len(missing)} file(s) that are missing: {missing[:3]}")
    return [directory / n for n in names]


def _open_source(source):
    if hasattr(source, "read_into"):  # already a source (module_weights.py: a training checkpoint)
        return source
    if isinstance(source, dict):
        return _StateDictSource(source, "the state dict")
    path = Path(source)
    if path.is_dir() or path.suffix == ".safetensors":
        return _SafetensorsSource(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    # torch.save files: memory-mapped, so only the pages of this rank's slices are read.
    return _StateDictSource(torch.load(path, map_location="cpu", mmap=True, weights_only=True), str(path))


def load_full_weights(engine, source, strict: bool = True) -> None:
    """Set the engine's parameters (and buffers) from full weights: a state dict, a safetensors
    file, a directory of safetensors files, or a torch.save file. A tied parameter is found under
    any of its names. `strict`: every parameter must be present and no unknown key may be (under
    pipeline parallelism the other stages' keys are expected). Optimizer state is left as it is.
    Collective (under tensor/pipeline parallelism: over every rank of the grid)."""
    layout = layout_of(engine)
    _, error = attempt(_load, engine, source, strict, layout)
    where = "a state dict" if isinstance(source, dict) else getattr(source, "where", source)
    agree(layout.comm if layout is not None else engine.comm, error, f"loading full weights from {where}")
    engine.refresh_parameters()


@torch.no_grad()
def _load(engine, source, strict: bool, layout: Layout | None) -> None:
    weights = _open_source(source)
    try:
        cuts = _tp_cuts(engine, layout)
        found = _match(engine, weights, strict, cuts, pipelined=layout is not None and layout.sizes["pp"] > 1)
        for group in engine.groups:
            group.open_master()
            for slot, lo, hi, dest in group.master_pieces():
                if slot.name in found and slot.name in cuts:
                    dest.copy_(cuts[slot.name].local(weights, found[slot.name], slot.shape).view(-1)[lo:hi])
                elif slot.name in found:
                    weights.read_into(found[slot.name], lo, hi, dest)
            group.release_master()  # an NVMe master goes to its file now: memory stays about one group
        buffers = persistent_buffers(engine.module)
        for name in set(buffers) & set(weights.keys()):
            value = torch.empty(buffers[name].numel(), dtype=buffers[name].dtype)
            weights.read_into(name, 0, value.numel(), value)
            buffers[name].copy_(value.view(buffers[name].shape))
    finally:
        weights.close()


@dataclass(frozen=True)
class _Cut:
    """How tensor parallelism cut one parameter: along `dim` of `full_shape`, this rank's slice `rank` of `size`."""

    dim: int
    full_shape: tuple
    rank: int
    size: int

    def local(self, weights, key: str, local_shape) -> torch.Tensor:
        """This rank's slice of the full tensor `key` (read whole: the slice is strided unless dim is 0)."""
        full = torch.empty(torch.Size(self.full_shape).numel(), dtype=torch.float32)  # 1-D, the whole parameter
        weights.read_into(key, 0, full.numel(), full)
        pieces = full.view(self.full_shape).chunk(self.size, dim=self.dim)
        piece = pieces[self.rank] if self.rank < len(pieces) else None
        if piece is None or tuple(piece.shape) != tuple(local_shape):
            raise CheckpointError(
                f"{weights.where}: '{key}' of shape {list(self.full_shape)} cut along dim {self.dim} "
                f"into {self.size} does not give tp rank {self.rank} its shape {list(local_shape)}"
            )
        return piece.contiguous()


def _tp_cuts(engine, layout: Layout | None) -> dict[str, _Cut]:
    """The parameters tensor parallelism cut, by name ([Note: checkpoints across layouts] in layout.py)."""
    if layout is None or layout.sizes["tp"] == 1:
        return {}
    size, rank, cuts = layout.sizes["tp"], layout.coordinate["tp"], {}
    for group in engine.groups:
        for slot, param, spec in zip(group.layout.slots, group.params, group.tp_specs):
            dim = tp_split_dim(param, spec)
            if dim == "unknown":
                raise CheckpointError(
                    f"parameter '{slot.name}' is split over tensor-parallel ranks along a dim the "
                    "model does not name: a Megatron-style parameter marked `tensor_model_parallel` "
                    "needs Megatron's `partition_dim` (and `partition_stride` 1) to take its slice "
                    "of full weights"
                )
            if dim is not None:  # Megatron cuts evenly; a DTensor knows its global shape
                full = (
                    tuple(spec.shape)
                    if spec is not None
                    else tuple(n * size if i == dim else n for i, n in enumerate(slot.shape))
                )
                cuts[slot.name] = _Cut(dim, full, rank, size)
    return cuts


def _match(engine, weights, strict: bool, cuts: dict | None = None, pipelined: bool = False) -> dict[str, str]:
    """Parameter name -> the key holding it in `weights` (its own name or a tied alias). `cuts`:
    parameters whose full shape is wanted (tensor parallelism); `pipelined`: keys of other pipeline
    stages are not unexpected."""
    cuts = cuts or {}
    names_of: dict[str, list[str]] = {s.name: [s.name] for g in engine.groups for s in g.layout.slots}
    for alias, name in model_aliases(engine.module).items():
        names_of[name].append(alias)
    keys = set(weights.keys())
    found, missing, reshaped = {}, [], []
    for group in engine.groups:
        for slot in group.layout.slots:
            key = next((k for k in names_of[slot.name] if k in keys), None)
            if key is None:
                missing.append(slot.name)
            elif tuple(weights.shape(key)) != (cuts[slot.name].full_shape if slot.name in cuts else tuple(slot.shape)):
                wanted = cuts[slot.name].full_shape if slot.name in cuts else slot.shape
                reshaped.append(f"'{key}': {list(weights.shape(key))} there, {list(wanted)} in the model")
            else:
                found[slot.name] = key
    known = {n for names in names_of.values() for n in names} | set(persistent_buffers(engine.module))
    unexpected = sorted(keys - known)
    problems = [f"{len(reshaped)} with a different shape ({reshaped[0]})"] if reshaped else []
    if strict and missing:
        problems.append(f"{len(missing)} parameter(s) missing (e.g. {missing[:3]})")
    if strict and unexpected and not pipelined:
        problems.append(f"{len(unexpected)} unexpected key(s) (e.g. {unexpected[:3]})")
    if problems:
        raise CheckpointError(f"{weights.where}: does not fit the model: " + "; ".join(problems))
    return found
