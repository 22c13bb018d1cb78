"""Ulysses sequence parallelism for transformers models, with DeepSpeed's names (ALST,
`deepspeed.runtime.sequence_parallel.ulysses_sp`): `UlyssesSPAttentionHF.register_with_transformers`
and `UlyssesSPDataLoaderAdapter`; zeroshard's own entry point is `attach(model, sequence)`. The
arithmetic is core/sequence.py's ([Note: Ulysses sequence parallelism]).

[Note: Ulysses attention in transformers]
transformers calls a model's attention through its registry (`AttentionInterface`), by the name in
`config._attn_implementation`. The name a model already uses ("sdpa", a flash-attention kernel) is
registered once more, with a function that looks the calling attention module up: a module of a
model attached to an sp group runs Ulysses attention over that group, any other the function that
was registered before. DeepSpeed's `register_with_transformers` with a model *name* (the model is
built after it) attaches every model of the process, as DeepSpeed's does. Nothing in the model's
code is replaced. "eager" is refused: transformers builds its (S, S) mask, which sequence
parallelism exists to avoid (DeepSpeed refuses it too); the mask of other implementations is not
used, attention is causal over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zeroshard.compat.tiled import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from zeroshard.core.sequence import SequenceParallel, shard_batch

__all__ = [
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "attach",
    "detach",
    "sequence_tiled_compute",
    "shard_batch",
]

_ATTACHED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> SequenceParallel
_EVERY_MODEL: list[SequenceParallel] = []  # DeepSpeed's registration by name: every model's attention
_ORIGINALS: dict[str, Callable] = {}  # implementation name -> the function registered before ours
_REFUSED = ("eager", "paged|eager")


def attach(model: nn.Module, sequence: SequenceParallel) -> None:
    """Run `model`'s attention (a transformers model) with Ulysses sequence parallelism over
    `sequence` (`Sharded.sequence_parallel`). The model then takes a shard of each sequence
    (core/sequence.py `shard_batch`). [Note: Ulysses attention in transformers]"""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no transformers config: attach() wires transformers' attention")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(text, "_attn_implementation", None) or "sdpa"
    _check_model(text, implementation, sequence)
    _install(implementation)
    for module in model.modules():
        _ATTACHED[module] = sequence


def detach(model: nn.Module) -> None:
    """`model`'s attention runs as before `attach`."""
    for module in model.modules():
        _ATTACHED.pop(module, None)


def _check_model(text_config, implementation: str, sequence: SequenceParallel | None) -> None:
    if implementation in _REFUSED:
        raise ValueError(
            f"attn_implementation {implementation!r} builds a (sequence x sequence) attention mask, which "
            "sequence parallelism exists to avoid: load the model with attn_implementation='sdpa' (or a "
            "flash-attention kernel)"
        )
    if sequence is None:
        return
    heads = text_config.num_attention_heads
    sequence.check_heads(heads, getattr(text_config, "num_key_value_heads", None) or heads)


def _install(implementation: str) -> None:
    """Register the dispatching function under `implementation`, once per process."""
    if implementation in _ORIGINALS:
        return
    from transformers import AttentionInterface

    registry = AttentionInterface()
    if implementation not in registry.valid_keys():
        raise ValueError(
            f"{implementation!r} is not an attention implementation; transformers knows {registry.valid_keys()}"
        )
    original = registry[implementation]
    _ORIGINALS[implementation] = original

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        sequence = _ATTACHED.get(module) or (_EVERY_MODEL[0] if _EVERY_MODEL else None)
        if sequence is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        window, length = kwargs.get("sliding_window"), query.shape[2] * sequence.size
        if window is not None and window < length:
            raise ValueError(
                f"{type(module).__name__}: sliding-window attention (window {window}) over a sequence of {length} "
                "tokens is not supported under sequence parallelism (its attention is causal over the whole sequence)"
            )
        dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
        return sequence.attention(query, key, value, scaling=kwargs.get("scaling"), dropout=dropout), None

    AttentionInterface.register(implementation, attention)


def attach_model(model: nn.Module, sequence: SequenceParallel) -> None:
    """An engine's model under sequence parallelism: a transformers model is attached (unless its
    attention runs Ulysses already: `register_with_transformers` by name); any other model's
    attention cannot be found, so it is refused rather than left attending within its shard."""
    if getattr(model, "config", None) is not None:
        if not (_EVERY_MODEL and _EVERY_MODEL[0].size == sequence.size):
            attach(model, sequence)
        return
    raise ValueError(
        f"sequence parallelism over {sequence.size} ranks: zeroshard wires the attention of transformers "
        f"models, and {type(model).__name__} is not one; call Sharded.sequence_parallel.attention(q, k, v) "
        "in its attention and shard it with zeroshard.shard(model, mesh=DeviceMesh(..., ('dp', 'sp')))"
    )


def sequence_mesh(size: int):
    """The (dp, sp) DeviceMesh of the world, sp groups of `size` consecutive ranks (DeepSpeed's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"sequence_parallel_size {size} does not divide the {world} ranks")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (world // size, size), mesh_dim_names=("dp", "sp"))


class SequenceParallelGroups:
    """The `mpu` of DeepSpeed's ALST, over a (dp, sp) DeviceMesh: `initialize(mpu=...)` makes ZeRO
    partition over the sequence-data-parallel group (every rank of the mesh); the model-parallel
    calls answer for the sequence-parallel group, as DeepSpeed's do."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._whole = mesh[("dp", "sp")]._flatten("dp_sp")  # DeviceMesh._flatten: as core/mesh.py

    def get_sequence_parallel_group(self):
        return self.mesh.get_group("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh["sp"].size()

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.get_local_rank("sp")

    def get_sequence_data_parallel_group(self):
        return self._whole.get_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._whole.size()

    def get_sequence_data_parallel_rank(self) -> int:
        return self._whole.get_local_rank()

    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


class UlyssesSPAttentionHF:
    """DeepSpeed's entry point ([Note: Ulysses attention in transformers])."""

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int | None = None,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ):
        """Ulysses attention over groups of `sequence_parallel_size` consecutive ranks, for the model
        `model_name_or_path` (a model: its attention only; a name or path: every model of the process,
        as DeepSpeed does). Returns the `mpu` to pass to `initialize(mpu=...)`, which makes ZeRO
        partition over dp x sp; None when the size is 1. The sizes DeepSpeed asks for
        (`micro_batch_size`, `seq_length`, ...) are accepted and not needed: shapes are read from
        each batch. `disable_in_eval` is not supported (refused when true)."""
        from zeroshard.core.comm import Communicator

        if sequence_parallel_size == 1:
            return None
        if disable_in_eval:
            raise ValueError("register_with_transformers(disable_in_eval=True) is not supported by zeroshard")
        if core_attn_implementation in _REFUSED:
            _check_model(None, core_attn_implementation, None)
        mesh = sequence_mesh(sequence_parallel_size)
        groups = SequenceParallelGroups(mesh)
        sequence = SequenceParallel(Communicator(group=groups.get_sequence_parallel_group()))
        config = getattr(model_name_or_path, "config", None)
        if config is not None:
            model_implementation = getattr(config.get_text_config(), "_attn_implementation", None)
            if model_implementation not in (None, core_attn_implementation):
                raise ValueError(
                    f"core_attn_implementation {core_attn_implementation!r} but the model's is "
                    f"{model_implementation!r}: set both to the same value"
                )
            attach(model_name_or_path, sequence)
        else:
            from transformers import AutoConfig

            text = AutoConfig.from_pretrained(model_name_or_path).get_text_config()
            _check_model(text, core_attn_implementation, sequence)
            _install(core_attn_implementation)
            _EVERY_MODEL[:] = [sequence]
        return groups


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's batch adapter: every sp rank's own batches, gathered over the sp group, each
    handed out in turn as this rank's shard (core/sequence.py `shard_batch`: padded to a multiple of
    sp, labels shifted over the whole sequence into `shift_labels`, global `position_ids`). So each
    dataloader batch is trained once, by the whole sp group, and the adapter has `len(dl) * sp`
    batches. `pad_token_id` pads sequences whose length sp does not divide (DeepSpeed refuses them)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device, pad_token_id: int = 0):
        from zeroshard.core.comm import Communicator

        self.dl, self.device, self.pad_token_id = dl, torch.device(device), pad_token_id
        self.comm = Communicator(group=sp_group)
        if (self.comm.rank, self.comm.world_size) != (sp_rank, sp_world_size):
            raise ValueError(
                f"sp_rank={sp_rank}, sp_world_size={sp_world_size}, but this rank is rank "
                f"{self.comm.rank} of the {self.comm.world_size} ranks of sp_group"
            )
        self._iterator: Iterator | None = None
        self._pending: list = []

    def __len__(self) -> int:
        return len(self.dl) * self.comm.world_size

    def __iter__(self):
        self._iterator, self._pending = iter(self.dl), []
        return self

    def __next__(self) -> dict:
        if self._iterator is None:
            self._iterator = iter(self.dl)
        if not self._pending:
            batch = next(self._iterator)  # StopIteration ends the epoch on every rank alike
            cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            self._pending = self.comm.all_gather_objects(cpu, "the sp ranks' batches")
        batch = self._pending.pop(0)
        part = shard_batch(batch, self.comm.rank, self.comm.world_size, pad_token_id=self.pad_token_id)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in part.items()}
