"""The module weights of a training checkpoint (zeroshard's, or one DeepSpeed wrote) into an engine
that has no optimizer (ZeRO-Inference: `InferenceModel.load_checkpoint`), streamed group by group.

`load_checkpoint` (load.py) reads every state of a rank into new tensors before it changes anything
([Note: a failed load changes nothing]): a copy of this rank's shards beside the engine's, which an
engine whose weights are larger than memory cannot afford. Here the checkpoint is presented as full
weights read by element range (the source interface of weights.py), so `load_full_weights` reads
each group's shard straight into its master (in the CPU or NVMe store) and releases it before the
next, as it does for Hugging Face safetensors: memory stays about one group. The price is that a
failure while reading (an I/O error after verification) leaves the groups read so far loaded and
the others as they were; loading again sets every weight. Names and shapes are matched, and the
files verified (sizes, checksums), before anything is read, so a wrong or damaged checkpoint is
refused whole.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zeroshard.checkpoint.common import agree, attempt
from zeroshard.checkpoint.deepspeed import FP32, DeepSpeedCheckpoint, find as find_deepspeed
from zeroshard.checkpoint.load import find_checkpoint
from zeroshard.checkpoint.manifest import check_files
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.checkpoint.weights import load_full_weights


class _ZeroshardSource:
    """A zeroshard checkpoint as full weights: parameters re-sliced from the rank files by name."""

    def __init__(self, path: Path, manifest: dict):
        self.where = str(path)
        self.reader = CheckpointReader(path, manifest)
        self.shapes = {p["name"]: tuple(p["shape"]) for g in manifest["groups"] for p in g["params"]}
        self.buffers = self.reader.buffers()  # small, and written whole by rank 0

    def keys(self) -> list[str]:
        return [*self.shapes, *self.buffers]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name] if name in self.shapes else tuple(self.buffers[name].shape)

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        if name in self.shapes:
            self.reader.read_param(name, "master", lo, hi, out)
        else:
            out.copy_(self.buffers[name].reshape(-1)[lo:hi])

    def close(self) -> None:
        self.reader.close()


class _DeepSpeedSource:
    """A DeepSpeed checkpoint as full weights: its fp32 partitions (and frozen parameters, buffers).
    DeepSpeedCheckpoint holds one source rank's optimizer file at a time."""

    def __init__(self, path: Path):
        self.checkpoint = DeepSpeedCheckpoint(path)
        self.where = str(path)
        self.frozen = self.checkpoint.frozen()
        self.buffers = self.checkpoint.buffers()

    def keys(self) -> list[str]:
        return [*self.checkpoint.names(), *self.frozen, *self.buffers]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.checkpoint.index:
            return tuple(self.checkpoint.index[name].shape)
        return tuple(self.frozen[name] if name in self.frozen else self.buffers[name].shape)

    def read_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        if name in self.checkpoint.index:
            self.checkpoint.read(name, FP32, lo, hi, out)
        else:
            value = self.checkpoint.frozen_param(name) if name in self.frozen else self.buffers[name]
            out.copy_(value.reshape(-1)[lo:hi])

    def close(self) -> None:
        self.frozen, self.buffers = {}, {}


def _open(engine, load_dir: Path, tag, verify: bool):
    """The checkpoint at `load_dir` (`tag`, or the one `latest` names) as a weights source; every rank
    verifies a share of its files first. Collective."""
    comm = engine.comm
    deepspeed_dir, error = attempt(find_deepspeed, load_dir, tag)
    agree(comm, error, f"loading checkpoint from {load_dir}")
    if deepspeed_dir is not None:
        source, error = attempt(_DeepSpeedSource, deepspeed_dir)
        agree(comm, error, f"loading DeepSpeed checkpoint {deepspeed_dir}")
        return source
    found, error = attempt(find_checkpoint, load_dir, tag)
    agree(
        comm,
        error or (None if found is not None else f"{load_dir}: no 'latest' file and no tag given"),
        f"loading checkpoint from {load_dir}",
    )
    path, manifest = found
    if verify:
        files = sorted(manifest["files"])
        problems, error = attempt(check_files, path, manifest, files[comm.rank :: comm.world_size])
        every = [p for mine in comm.all_gather_objects(problems or [], f"verifying {path}") for p in mine]
        agree(comm, error or ("; ".join(every) if every else None), f"loading checkpoint {path}")
    source, error = attempt(_ZeroshardSource, path, manifest)
    agree(comm, error, f"loading checkpoint {path}")
    return source


def load_module_weights(engine, load_dir, tag=None, strict: bool = True, verify: bool = True) -> str:
    """Set the engine's parameters and buffers from a training checkpoint's module weights (fp32
    masters), each rank reading only its own shard's element ranges; optimizer state, scheduler and
    counters are not read. Returns the checkpoint directory read. Collective."""
    source = _open(engine, Path(load_dir), tag, verify)
    load_full_weights(engine, source, strict=strict)  # closes the source
    return source.where
