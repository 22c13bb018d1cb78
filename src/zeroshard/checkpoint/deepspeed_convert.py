"""DeepSpeed checkpoints without a process group: one full state dict (what DeepSpeed's
zero_to_fp32.py makes), or a zeroshard checkpoint (`zeroshard convert`).

Both stream parameter by parameter: each parameter's fp32 elements are read from the memory-mapped
rank files ([Note: DeepSpeed's checkpoint layout] in deepspeed.py) into one buffer of that
parameter's size, written, and dropped; peak memory is the largest parameter plus the pages of the
rank file being read, not the model.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from pathlib import Path

import torch

from zeroshard.checkpoint.deepspeed import FP32, DeepSpeedCheckpoint
from zeroshard.checkpoint.files import CheckpointError, SafetensorsWriter, dtype_name, write_atomic, write_safetensors
from zeroshard.checkpoint.manifest import (
    BUFFERS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    OBJECTS,
    check_tag,
    manifest_text,
    master_key,
    rank_file,
    state_key,
)
from zeroshard.checkpoint.output import HF_SHARD_BYTES, FullModelWriter, format_for
from zeroshard.checkpoint.save import publish


def _full_param(checkpoint: DeepSpeedCheckpoint, name: str, key: str = FP32) -> torch.Tensor:
    place = checkpoint.index[name]
    out = torch.empty(place.numel, dtype=torch.float32)  # 1-D, one parameter
    checkpoint.read(name, key, 0, place.numel, out)
    return out


def _params(checkpoint: DeepSpeedCheckpoint) -> list[tuple[str, tuple[int, ...]]]:
    return [(p.name, tuple(p.shape)) for p in checkpoint.places] + [
        (n, tuple(s)) for n, s in checkpoint.frozen().items()
    ]


def consolidate_deepspeed(
    path: Path,
    output,
    dtype: torch.dtype = torch.float32,
    fmt: str | None = None,
    max_shard_bytes: int = HF_SHARD_BYTES,
) -> dict:
    """The full model of a DeepSpeed checkpoint as one file: the fp32 masters (frozen parameters as
    DeepSpeed saved them), buffers in fp32 like zero_to_fp32, tied aliases; in `dtype`."""
    started = time.monotonic()
    checkpoint = DeepSpeedCheckpoint(path)
    buffers = {n: (v.float() if v.is_floating_point() else v) for n, v in checkpoint.buffers().items()}
    buffer_specs = {n: (v.dtype if not v.is_floating_point() else dtype, tuple(v.shape)) for n, v in buffers.items()}
    writer = FullModelWriter(
        output, _params(checkpoint), checkpoint.aliases(), buffer_specs, dtype, format_for(output, fmt), max_shard_bytes
    )
    try:
        for place in checkpoint.places:
            writer.add_param(place.name, _full_param(checkpoint, place.name).view(place.shape))
        for name in checkpoint.frozen():
            writer.add_param(name, checkpoint.frozen_param(name).float())
        for name, value in buffers.items():
            writer.add_buffer(name, value.to(dtype) if value.is_floating_point() else value)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return {
        "output": str(output),
        "checkpoint": str(path),
        "format": writer.format,
        "dtype": dtype_name(dtype),
        "tensors": writer.tensors,
        "bytes": writer.bytes,
        "source": "deepspeed",
        "deepspeed_world_size": checkpoint.world_size,
        "deepspeed_stage": checkpoint.stage,
        "largest_param_bytes": 4 * max(p.numel for p in checkpoint.places),
        "seconds": round(time.monotonic() - started, 3),
    }


def convert_deepspeed(path: Path, save_dir, tag: str | None = None) -> dict:
    """Write the DeepSpeed checkpoint at `path` as a zeroshard checkpoint `save_dir/<tag>` (default:
    `global_step<N>`) and point `save_dir/latest` at it. It is laid out as if saved by one rank, one
    flat group per parameter ([Note: checkpoint layout] in checkpoint/__init__.py); zeroshard's
    loader re-slices it for any world size and stage."""
    started = time.monotonic()
    checkpoint = DeepSpeedCheckpoint(path)
    counters = checkpoint.counters()
    tag = check_tag(str(tag) if tag is not None else f"global_step{counters['global_steps']}")
    save_dir = Path(save_dir)
    if save_dir.resolve() == Path(path).resolve().parent:
        raise CheckpointError(f"{save_dir}: is the DeepSpeed checkpoint's own directory; convert into another one")
    save_dir.mkdir(parents=True, exist_ok=True)
    nonce = uuid.uuid4().hex[:12]
    staging = save_dir / f".tmp-{tag}-{nonce}"
    staging.mkdir()
    kinds = checkpoint.optimizer_state_kinds()
    elementwise = [k for k, kind in kinds.items() if kind == "elementwise"]
    groups, specs = _describe(checkpoint, kinds)
    files = {rank_file(0): _write_tensors(checkpoint, staging / rank_file(0), groups, specs, elementwise)}
    files[OBJECTS] = write_atomic(staging / OBJECTS, _objects(checkpoint, groups))
    buffers = checkpoint.buffers()
    if buffers:
        files[BUFFERS] = write_safetensors(staging / BUFFERS, {k: v.contiguous() for k, v in buffers.items()})
    manifest = _manifest(checkpoint, tag, groups, files, list(buffers))
    write_atomic(staging / MANIFEST, manifest_text(manifest).encode())
    publish(staging, save_dir, tag, nonce, save_latest=True)
    return {
        "output": str(save_dir / tag),
        "checkpoint": str(path),
        "parameters": len(groups),
        "deepspeed_world_size": checkpoint.world_size,
        "deepspeed_stage": checkpoint.stage,
        "global_steps": counters["global_steps"],
        "seconds": round(time.monotonic() - started, 3),
    }


def _describe(checkpoint: DeepSpeedCheckpoint, kinds: dict) -> tuple[list[dict], list]:
    """One manifest group per parameter, and the safetensors specs of the rank file."""
    groups, specs = [], []
    dtype = dtype_name(checkpoint.param_dtype())
    trainable = [(p.name, p.shape, p.group) for p in checkpoint.places]
    frozen = [(n, s, None) for n, s in checkpoint.frozen().items()]
    for index, (name, shape, group) in enumerate(trainable + frozen):
        numel = shape.numel()
        state = [[k, kind] for k, kind in kinds.items()] if group is not None else []
        groups.append(
            {
                "unit": "<root>",
                "optimizer_group": group,
                "numel": numel,
                "shard_numel": numel,
                "params": [{"name": name, "shape": list(shape), "dtype": dtype, "offset": 0, "numel": numel}],
                "state": state,
            }
        )
        specs.append((master_key(index), torch.float32, (numel,)))
        specs += [(state_key(index, k), torch.float32, (numel,)) for k, kind in state if kind == "elementwise"]
    return groups, specs


def _write_tensors(checkpoint, file: Path, groups: list[dict], specs: list, elementwise: list[str]) -> dict:
    writer = SafetensorsWriter(file, specs, {"format": FORMAT, "rank": "0", "world_size": "1"})
    try:
        for index, group in enumerate(groups):
            name = group["params"][0]["name"]
            if group["optimizer_group"] is None:
                writer.write(master_key(index), checkpoint.frozen_param(name).reshape(-1).float())
                continue
            writer.write(master_key(index), _full_param(checkpoint, name))
            for key in elementwise:
                writer.write(state_key(index, key), _full_param(checkpoint, name, key))
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _objects(checkpoint: DeepSpeedCheckpoint, groups: list[dict]) -> bytes:
    scalars = {}
    for index, group in enumerate(groups):
        if group["optimizer_group"] is not None:
            scalars[index] = {k: (v, False) for k, v in checkpoint.optimizer_scalars(group["optimizer_group"]).items()}
        else:
            scalars[index] = {}
    objects = {
        "client_state": checkpoint.client_state(),
        "optimizer": {"param_groups": checkpoint.hyper_parameters(), "scalars": scalars},
        "lr_scheduler": checkpoint.model_states.get("lr_scheduler"),
        "loss_scaler": checkpoint.loss_scaler_state(),
    }
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    return buffer.getvalue()


def _optimizer_name(checkpoint: DeepSpeedCheckpoint) -> str:
    """The torch optimizer class zeroshard builds from the DeepSpeed config's `optimizer` section."""
    section = (checkpoint.model_states.get("ds_config") or {}).get("optimizer") or {}
    kind = str(section.get("type", "")).lower()
    params = section.get("params") or {}
    if kind in ("adam", "adamw", "fusedadam", "cpuadam"):
        return "Adam" if kind == "adam" and params.get("adam_w_mode") is False else "AdamW"
    hyper = checkpoint.hyper_parameters()
    if hyper and hyper[0].get("decoupled_weight_decay"):
        return "AdamW"
    return section.get("type") or "unknown (a client optimizer)"


def _manifest(checkpoint: DeepSpeedCheckpoint, tag: str, groups: list[dict], files: dict, buffers: list[str]) -> dict:
    from zeroshard.version import __version__

    counters = checkpoint.counters()
    config = checkpoint.model_states.get("ds_config")
    gas = int((config or {}).get("gradient_accumulation_steps") or 1)
    scheduler = checkpoint.model_states.get("lr_scheduler")
    try:
        config = json.loads(json.dumps(config))
    except (TypeError, ValueError):
        config = None
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "tag": tag,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": 1,
        "stage": checkpoint.stage,
        "param_dtype": dtype_name(checkpoint.param_dtype()),
        "global_steps": counters["global_steps"],
        "micro_steps": counters["global_steps"] * gas,
        "skipped_steps": counters["skipped_steps"],
        "gradient_accumulation_steps": gas,
        "mid_accumulation": False,
        "optimizer": _optimizer_name(checkpoint),
        "lr_scheduler": scheduler,
        "loss_scaler": checkpoint.loss_scaler_state(),
        "aliases": checkpoint.aliases(),
        "buffers": buffers,
        "groups": groups,
        "files": files,
        "config": config,  # DeepSpeed's config: its origin
    }
