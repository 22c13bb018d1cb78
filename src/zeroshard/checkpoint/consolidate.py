"""Consolidation: a sharded checkpoint -> one full state dict file, without a process group.

Streams group by group (a unit has a group per optimizer param group, split under 30 MiB at
stages 2/3 on CPU, [Note: gathered buffers under glibc's mmap ceiling]): each group's master
weights are read from the rank files straight into one fp32 buffer, converted parameter by
parameter and appended to the output. Peak memory is one group's buffer (plus one converted
parameter for bf16), not the model; the test suite measures it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from zeroshard.checkpoint.deepspeed import find as find_deepspeed
from zeroshard.checkpoint.deepspeed_convert import consolidate_deepspeed
from zeroshard.checkpoint.files import CheckpointError, dtype_name
from zeroshard.checkpoint.joined import consolidate_layout
from zeroshard.checkpoint.manifest import (
    BUFFERS,
    MANIFEST,
    check_files,
    checkpoint_path,
    is_layout,
    read_manifest,
    resolve_tag,
)
from zeroshard.checkpoint.output import HF_SHARD_BYTES, FullModelWriter, format_for, parse_size
from zeroshard.checkpoint.reader import CheckpointReader

log = logging.getLogger(__name__)


def open_checkpoint(checkpoint_dir, tag=None) -> tuple[Path, dict]:
    """(directory, manifest) of `tag` in `checkpoint_dir`, of the tag `latest` names, or of
    `checkpoint_dir` itself when it is one checkpoint (holds a manifest)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: no such checkpoint directory")
    if tag is None and (checkpoint_dir / MANIFEST).is_file():
        return checkpoint_dir, read_manifest(checkpoint_dir)
    resolved = resolve_tag(checkpoint_dir, tag)
    if resolved is None:
        raise CheckpointError(
            f"{checkpoint_dir}: neither a 'latest' file nor a {MANIFEST}: pass the "
            "directory of one checkpoint, or a tag"
        )
    path = checkpoint_path(checkpoint_dir, resolved)
    return path, read_manifest(path)


def consolidate(
    checkpoint_dir,
    output,
    tag=None,
    dtype: torch.dtype = torch.float32,
    fmt: str | None = None,
    verify: bool = True,
    progress: bool = True,
    max_shard_size: int | str = HF_SHARD_BYTES,
) -> dict:
    """Write the full model of a checkpoint to `output` (safetensors, or torch.save for `fmt='pt'`
    or a .pt/.bin name; for `fmt='hf'` a directory of safetensors files of at most `max_shard_size`
    with their index, as transformers' save_pretrained writes: [Note: Hugging Face's sharded layout]
    in output.py), parameters in `dtype`, keys as the model's `state_dict()` has them (tied
    aliases and buffers included), so `model.load_state_dict(..., strict=True)` takes it.
    Returns a summary: output path, tensors, bytes, seconds, the largest group's bytes.
    A DeepSpeed ZeRO checkpoint is read in its own format (what its zero_to_fp32.py makes of it:
    deepspeed_convert.py); `verify` has no checksums to check there."""
    started = time.monotonic()
    shard_bytes = parse_size(max_shard_size)
    deepspeed_dir = find_deepspeed(checkpoint_dir, tag)
    if deepspeed_dir is not None:
        return consolidate_deepspeed(deepspeed_dir, output, dtype, fmt, shard_bytes)
    path, manifest = open_checkpoint(checkpoint_dir, tag)
    if is_layout(manifest):  # tensor/pipeline parallel: join the parts ([Note: checkpoints across layouts])
        joined = consolidate_layout(path, manifest, output, dtype, format_for(output, fmt), verify, shard_bytes)
        writer = joined["writer"]
        return {
            "output": str(output),
            "checkpoint": str(path),
            "format": writer.format,
            "dtype": dtype_name(dtype),
            "tensors": writer.tensors,
            "bytes": writer.bytes,
            "groups": joined["groups"],
            "parts": joined["parts"],
            "largest_group_bytes": joined["largest_bytes"],
            "seconds": round(time.monotonic() - started, 3),
        }
    if verify:
        problems = check_files(path, manifest)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    groups = manifest["groups"]
    params = [(p["name"], tuple(p["shape"])) for g in groups for p in g["params"]]
    with CheckpointReader(path, manifest) as reader:
        buffers = manifest.get("buffers") or []
        buffer_file = reader.file(BUFFERS) if buffers else None
        buffer_specs = {n: (buffer_file.dtype(n), buffer_file.shape(n)) for n in buffers if buffer_file is not None}
        writer = FullModelWriter(
            output, params, manifest["aliases"], buffer_specs, dtype, format_for(output, fmt), shard_bytes
        )
        try:
            _write_groups(reader, groups, writer, progress)
            for name in buffers:
                assert buffer_file is not None  # opened: there are buffers
                writer.add_buffer(name, buffer_file.read(name).view(buffer_file.shape(name)))
            writer.close()
        except BaseException:
            writer.abort()
            raise
    summary = {
        "output": str(output),
        "checkpoint": str(path),
        "format": writer.format,
        "dtype": dtype_name(dtype),
        "tensors": writer.tensors,
        "bytes": writer.bytes,
        "groups": len(groups),
        "largest_group_bytes": max(4 * g["numel"] for g in groups),
        "seconds": round(time.monotonic() - started, 3),
    }
    log.debug(
        "zeroshard: consolidated %s into %s (%d tensors, %.1f MB)", path, output, writer.tensors, writer.bytes / 1e6
    )
    return summary


def _write_groups(reader: CheckpointReader, groups: list[dict], writer: FullModelWriter, progress: bool) -> None:
    total = sum(4 * g["numel"] for g in groups)
    # disable=None: a bar on a terminal only, not in logs
    with tqdm(total=total, desc="consolidating", unit="B", unit_scale=True, disable=None if progress else True) as bar:
        for index, group in enumerate(groups):
            bar.set_postfix_str(group["unit"])
            _write_group(reader, index, group, writer)
            bar.update(4 * group["numel"])


def _write_group(reader: CheckpointReader, index: int, group: dict, writer: FullModelWriter) -> None:
    """One group; its buffer (and every view of it) is gone when this returns, before the next
    group's is allocated: peak memory is one group."""
    full = torch.empty(group["numel"], dtype=torch.float32)  # 1-D, the group without padding
    reader.read_group(index, "master", 0, group["numel"], full)
    for param in group["params"]:
        start = param["offset"]
        writer.add_param(param["name"], full[start : start + param["numel"]].view(param["shape"]))
