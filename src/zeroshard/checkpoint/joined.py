"""The full model of a tensor/pipeline-parallel checkpoint: each parameter's tp slices joined along
the dim they were cut on, the pipeline stages' parameters side by side ([Note: checkpoints across
layouts] in layout.py).

Parameter by parameter: its slices are read from every tp part (re-assembled over that part's dp
ranks by element range), joined, and appended to the output, so peak memory is about two copies of
the largest parameter, not the model. A parameter every tp rank holds whole (LayerNorm, the bias of
a row-parallel linear) is taken from tp rank 0; one that several pipeline stages hold (embeddings
tied across the first and the last stage) from the first stage that has it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.layout import describe
from zeroshard.checkpoint.manifest import BUFFERS, MANIFEST, check_file, check_files, read_manifest
from zeroshard.checkpoint.output import HF_SHARD_BYTES, FullModelWriter
from zeroshard.checkpoint.reader import CheckpointReader


class _Param:
    """One parameter of the full model: where its tp slices are, and how they join."""

    def __init__(self, name: str, pp: int, entries: list[dict], where: Path):
        self.name, self.pp = name, pp
        self.local_shapes = [list(e["shape"]) for e in entries]  # tp rank order
        self.split = entries[0].get("tp_split_dim")
        if len(entries) == 1 or self.split is None:
            self.shape = self.local_shapes[0]
            self.split = None
            return
        if self.split == "unknown":
            raise CheckpointError(
                f"{where}: parameter '{name}' is split over tensor-parallel ranks along a dim the model did not "
                "name: a Megatron-style parameter marked `tensor_model_parallel` needs Megatron's `partition_dim` "
                "(and `partition_stride` 1) when the checkpoint is saved, for its slices to be joined; consolidate "
                "each tp part on its own (pass its tp<t>_pp<p> directory) to get the slices"
            )
        rest = [s[: self.split] + s[self.split + 1 :] for s in self.local_shapes]
        if any(r != rest[0] for r in rest) or any(e.get("tp_split_dim") != self.split for e in entries):
            raise CheckpointError(
                f"{where}: the tp slices of '{name}' do not fit together (shapes "
                f"{self.local_shapes}, split dims {[e.get('tp_split_dim') for e in entries]})"
            )
        self.shape = list(self.local_shapes[0])
        self.shape[self.split] = sum(s[self.split] for s in self.local_shapes)


def _read_parts(path: Path, manifest: dict, verify: bool) -> dict[tuple[int, int], tuple[Path, dict]]:
    parts = {}
    for part in manifest["parts"]:
        part_path, name = path / part["dir"], f"{part['dir']}/{MANIFEST}"
        if verify:
            problems = (
                [p for p in [check_file(path, name, manifest["files"][name])] if p is not None]
                if name in manifest["files"]
                else [f"{path / name}: not listed in {path / MANIFEST}"]
            )
            part_manifest = read_manifest(part_path) if not problems else None
            problems += check_files(part_path, part_manifest) if part_manifest is not None else []
            if problems:
                raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
        parts[(part["tp"], part["pp"])] = (part_path, read_manifest(part_path))
    mesh = manifest["mesh"]
    expected = {(t, p) for t in range(mesh["tp"]) for p in range(mesh["pp"])}
    if set(parts) != expected:
        raise CheckpointError(
            f"{path / MANIFEST}: a checkpoint at {describe(mesh)} needs the parts "
            f"{sorted(expected)}, it lists {sorted(parts)}"
        )
    return parts


def _plan(path: Path, mesh: dict, parts: dict) -> list[_Param]:
    """The full model's parameters, stage by stage, in the order tp rank 0's part has them."""
    planned, seen = [], set()
    for pp in range(mesh["pp"]):
        by_name = []
        for tp in range(mesh["tp"]):
            part_path, manifest = parts[(tp, pp)]
            by_name.append({p["name"]: p for g in manifest["groups"] for p in g["params"]})
        first = by_name[0]
        for tp, names in enumerate(by_name[1:], start=1):
            if set(names) != set(first):
                odd = sorted(set(names) ^ set(first))
                raise CheckpointError(
                    f"{parts[(tp, pp)][0] / MANIFEST}: holds other parameters than tp rank 0 of the "
                    f"same pipeline stage (e.g. {odd[:3]}): the parts are not of one model"
                )
        for name in first:
            if name not in seen:
                seen.add(name)
                planned.append(_Param(name, pp, [names[name] for names in by_name], parts[(0, pp)][0]))
    return planned


def consolidate_layout(
    path: Path,
    manifest: dict,
    output,
    dtype: torch.dtype,
    fmt: str,
    verify: bool,
    max_shard_bytes: int = HF_SHARD_BYTES,
) -> dict:
    """Write the full model of the tp/pp checkpoint at `path` (`manifest`: its top manifest) to
    `output`; returns what `consolidate` reports."""
    mesh = manifest["mesh"]
    parts = _read_parts(path, manifest, verify)
    planned = _plan(path, mesh, parts)
    readers = {key: CheckpointReader(part_path, part_manifest) for key, (part_path, part_manifest) in parts.items()}
    try:
        aliases: dict[str, str] = {}
        buffers: dict[str, tuple] = {}  # name -> (reader, dtype, shape), from the first stage that has it
        for pp in range(mesh["pp"]):
            reader = readers[(0, pp)]
            for alias, name in reader.manifest["aliases"].items():
                aliases.setdefault(alias, name)
            if reader.manifest.get("buffers"):
                file = reader.file(BUFFERS)
                for name in reader.manifest["buffers"]:
                    buffers.setdefault(name, (file, file.dtype(name), file.shape(name)))
        aliases = {a: n for a, n in aliases.items() if a not in {p.name for p in planned}}
        writer = FullModelWriter(
            output,
            [(p.name, tuple(p.shape)) for p in planned],
            aliases,
            {n: (d, s) for n, (_, d, s) in buffers.items()},
            dtype,
            fmt,
            max_shard_bytes,
        )
        try:
            for param in planned:
                writer.add_param(param.name, _joined(param, [readers[(tp, param.pp)] for tp in range(mesh["tp"])]))
            for name, (file, _, shape) in buffers.items():
                writer.add_buffer(name, file.read(name).view(shape))
            writer.close()
        except BaseException:
            writer.abort()
            raise
    finally:
        for reader in readers.values():
            reader.close()
    largest = max((4 * torch.Size(p.shape).numel() for p in planned), default=0)
    return {
        "writer": writer,
        "groups": sum(len(m["groups"]) for _, m in parts.values()),
        "largest_bytes": largest,
        "parts": len(parts),
    }


def _joined(param: _Param, readers: list[CheckpointReader]) -> torch.Tensor:
    """The full fp32 value of `param`: its tp slices read and concatenated along its split dim."""
    count = 1 if param.split is None else len(readers)
    slices = []
    for reader, shape in zip(readers[:count], param.local_shapes):
        value = torch.empty(torch.Size(shape).numel(), dtype=torch.float32)  # 1-D, this slice
        reader.read_param(param.name, "master", 0, value.numel(), value)
        slices.append(value.view(shape))
    return slices[0] if count == 1 or param.split is None else torch.cat(slices, dim=param.split)
