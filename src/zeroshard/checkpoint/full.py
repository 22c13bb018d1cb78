"""Full (unsharded) weights from a live engine: a state dict on rank 0, or a file, gathered one
flat group at a time so that no rank holds more than one group's full buffer beyond the result."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from zeroshard.checkpoint.common import agree, attempt, compute_dtype, partition_of
from zeroshard.checkpoint.manifest import model_aliases, persistent_buffers, state_dict_order
from zeroshard.checkpoint.output import HF_SHARD_BYTES, FullModelWriter, format_for, parse_size

log = logging.getLogger(__name__)


def gathered(engine, group, local: torch.Tensor, what: str) -> torch.Tensor:
    """The whole 1-D buffer (numel = padded_numel) of a tensor laid out like `group.master` (the master
    itself, or an elementwise optimizer state); `local` itself at stage 0, where it is whole already.
    Collective over the group the layout is sliced over: under MiCS one partition group holds every
    shard. Allocated next to `local`: host memory under CPU offload, which NCCL cannot move; the
    communicator stages it through its device ([Note: staging host tensors] in core/staging.py)."""
    if not group.sharded_master:
        return local
    full = torch.empty(group.layout.padded_numel, dtype=local.dtype, device=local.device)
    partition_of(engine).all_gather(full, local.contiguous(), what, counts=group.layout.counts)
    return full


def for_each_gathered_group(engine, visit: Callable[[object, torch.Tensor], None]) -> None:
    """visit(group, full fp32 master buffer (1-D, numel = padded_numel)) for each group in engine
    order. Collective: every rank runs it. Each buffer is dropped before the next is gathered, so
    `visit` must not keep views of it."""
    for group in engine.groups:
        full = gathered(engine, group, group.master, f"gather of master weights ({group.names[0]}...)")
        visit(group, full)
        del full


def full_state_dict(engine, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict, unsharded, on rank 0 (CPU tensors, keys as `module.state_dict()`:
    tied aliases and buffers included); {} on the other ranks. Collective.

    Parameters come from the fp32 master weights, converted to `dtype` (default: the dtype the
    engine computes in, so the values equal the module's own parameters).
    """
    dtype = dtype or compute_dtype(engine)
    module = engine.module
    keep = engine.comm.rank == 0
    aliases_of: dict[str, list[str]] = {}
    for alias, name in model_aliases(module).items():
        aliases_of.setdefault(name, []).append(alias)
    out: dict[str, torch.Tensor] = {}

    def collect(group, full: torch.Tensor) -> None:
        for slot, view in zip(group.layout.slots, group.layout.views(full)):
            out[slot.name] = view.to("cpu", dtype, copy=True)
            for alias in aliases_of.get(slot.name, []):
                out[alias] = out[slot.name]

    for_each_gathered_group(engine, collect if keep else lambda group, full: None)
    if not keep:
        return {}
    for name, value in persistent_buffers(module).items():
        out[name] = value.detach().to("cpu", copy=True)
    order = state_dict_order(module)
    return {name: out[name] for name in order if name in out}


def save_16bit_model(engine, save_dir, save_filename: str = "model.safetensors") -> str | bool:
    """Rank 0 writes the full model in the engine's compute dtype (bf16/fp16 with mixed precision,
    else fp32) to `save_dir/save_filename`: safetensors, streamed group by group, or torch.save for a
    .pt/.bin name. Collective; returns the file's path on every rank.

    At stage 3 the full weights exist nowhere until gathered, and DeepSpeed gathers them for this
    call only with `zero_optimization.stage3_gather_16bit_weights_on_model_save: true`; without
    it, DeepSpeed writes nothing, logs that it did not save, and returns False. So does this.
    """
    path = Path(save_dir) / save_filename
    if engine.policy.shard_parameters and not _gather_on_save(engine):
        log.warning(
            "zeroshard: did not save the model %s because zero_optimization."
            "stage3_gather_16bit_weights_on_model_save is false (DeepSpeed's behaviour at stage 3); "
            "set it to true, or save a checkpoint and consolidate it",
            path,
        )
        return False
    return _save_full(engine, path, None, compute_dtype(engine), HF_SHARD_BYTES)


def save_hf_model(engine, save_dir, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> str:
    """Rank 0 writes the full model to the directory `save_dir` as transformers' `save_pretrained`
    does: safetensors files of at most `max_shard_size` and their index ([Note: Hugging Face's
    sharded layout] in output.py), and the module's `config.json` when it has a transformers config,
    so that `from_pretrained(save_dir)` loads it. Parameters in `dtype` (default: the compute dtype).
    At every stage, also 3: the groups are gathered one at a time and streamed into the files, so
    the whole model is never in one rank's memory. Collective; returns `save_dir` on every rank."""
    shard_bytes = parse_size(max_shard_size)
    path = Path(save_dir)
    _save_full(engine, path, "hf", dtype or compute_dtype(engine), shard_bytes)
    config = getattr(engine.module, "config", None)
    error = None
    if engine.comm.rank == 0 and hasattr(config, "save_pretrained"):
        _, error = attempt(config.save_pretrained, str(path))  # type: ignore[union-attr]
    agree(engine.comm, error, f"saving the model's config to {path}")
    return str(path)


def _save_full(engine, path: Path, fmt: str | None, dtype: torch.dtype, shard_bytes: int) -> str:
    """Rank 0 streams every gathered group into a FullModelWriter (collective)."""
    what = f"saving the model to {path}"
    writer, error = (
        attempt(_open_writer, engine, path, fmt, dtype, shard_bytes) if engine.comm.rank == 0 else (None, None)
    )
    agree(engine.comm, error, what)
    failed = [error]

    def write(group, full: torch.Tensor) -> None:
        if writer is not None and failed[0] is None:  # after a failure rank 0 still joins the gathers
            failed[0] = attempt(_write_group, writer, group, full)[1]

    for_each_gathered_group(engine, write)
    error = failed[0]
    if writer is not None:
        if error is None:
            _, error = attempt(_finish, writer, engine.module)
        if error is not None:
            writer.abort()
    agree(engine.comm, error, what)
    return str(path)


def _gather_on_save(engine) -> bool:
    return bool(engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)


def _open_writer(engine, path: Path, fmt: str | None, dtype: torch.dtype, shard_bytes: int) -> FullModelWriter:
    params = [(s.name, tuple(s.shape)) for g in engine.groups for s in g.layout.slots]
    buffers = {n: (b.dtype, tuple(b.shape)) for n, b in persistent_buffers(engine.module).items()}
    return FullModelWriter(
        path, params, model_aliases(engine.module), buffers, dtype, format_for(path, fmt), shard_bytes
    )


def _write_group(writer: FullModelWriter, group, full: torch.Tensor) -> None:
    for slot, view in zip(group.layout.slots, group.layout.views(full)):
        writer.add_param(slot.name, view)


def _finish(writer: FullModelWriter, module) -> None:
    for name, value in persistent_buffers(module).items():
        writer.add_buffer(name, value)
    writer.close()
