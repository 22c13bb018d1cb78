"""Full weights (a pretrained state dict, a safetensors file or a directory of them) into a sharded
engine: each rank reads only the element ranges of its own master shard, so no rank materialises
the whole model (except at stage 0, where every rank holds it anyway)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from zeroshard.checkpoint.common import agree, attempt
from zeroshard.checkpoint.files import CheckpointError, SafetensorsReader
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
        raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' of "
                              f"tensor name -> file): {error}") from None
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise CheckpointError(f"{index}: names {len(missing)} file(s) that are missing: {missing[:3]}")
    return [directory / n for n in names]


def _open_source(source):
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
    any of its names. `strict`: every parameter must be present and no unknown key may be.
    Optimizer state is left as it is. Collective."""
    _, error = attempt(_load, engine, source, strict)
    where = "a state dict" if isinstance(source, dict) else source
    agree(engine.comm, error, f"loading full weights from {where}")
    engine.refresh_parameters()


@torch.no_grad()
def _load(engine, source, strict: bool) -> None:
    weights = _open_source(source)
    try:
        found = _match(engine, weights, strict)
        for group in engine.groups:
            for slot, lo, hi, dest in group.master_pieces():
                if slot.name in found:
                    weights.read_into(found[slot.name], lo, hi, dest)
            group.release_master()  # an NVMe master goes to its file now: memory stays about one group
        buffers = persistent_buffers(engine.module)
        for name in set(buffers) & set(weights.keys()):
            value = torch.empty(buffers[name].numel(), dtype=buffers[name].dtype)
            weights.read_into(name, 0, value.numel(), value)
            buffers[name].copy_(value.view(buffers[name].shape))
    finally:
        weights.close()


def _match(engine, weights, strict: bool) -> dict[str, str]:
    """Parameter name -> the key holding it in `weights` (its own name or a tied alias)."""
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
            elif tuple(weights.shape(key)) != tuple(slot.shape):
                reshaped.append(f"'{key}': {list(weights.shape(key))} there, {list(slot.shape)} in the model")
            else:
                found[slot.name] = key
    known = {n for names in names_of.values() for n in names} | set(persistent_buffers(engine.module))
    unexpected = sorted(keys - known)
    problems = [f"{len(reshaped)} with a different shape ({reshaped[0]})"] if reshaped else []
    if strict and missing:
        problems.append(f"{len(missing)} parameter(s) missing (e.g. {missing[:3]})")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) (e.g. {unexpected[:3]})")
    if problems:
        raise CheckpointError(f"{weights.where}: does not fit the model: " + "; ".join(problems))
    return found
