"""`zeroshard.inference.shard`: ZeRO-Inference applied to a model, with no config and no engine.

As `zeroshard.shard` is for training, one call turns a plain model into its inference form, built on
the core's `Sharded` with no optimizer: the weights live as this rank's stage-3 shards, the only
copy of them (no gradient buffers, no optimizer state, no separate master), in host memory or NVMe
files (`zeroshard.CPUOffload(params=True)`, `zeroshard.NVMeOffload(path)`), optionally quantized group-wise to 8 or 4 bits (`QuantSpec`); each forward
gathers one unit at a time and prefetches the next in the order recorded on the first pass ([Note:
inference prefetch] in core/lifecycle.py). Generation reads every weight once per generated token
for the whole batch, so tokens/s grows with the batch size until compute, not the disk, is the
bottleneck.

    model = zeroshard.inference.shard(model, offload=zeroshard.NVMeOffload("/local_nvme"), quantize=QuantSpec(4))
    tokens = model.generate(input_ids, max_new_tokens=32)

On N ranks the weights are partitioned N ways and each rank generates its own batch; every forward
is a collective, so every rank must run the same number of them (`generate` turns on transformers'
`synced_gpus` for that, as DeepSpeed ZeRO-3 does). To build a model larger than memory without ever
materialising it: `from_pretrained` (pretrained.py). DeepSpeed's config reaches this same call
through `zeroshard.initialize(model=..., config=...)` without an optimizer (compat/inference.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.core.comm import Communicator
from zeroshard.core.placement import Placement, place
from zeroshard.core.policy import (
    CommunicationPolicy,
    GatheringPolicy,
    OffloadPolicy,
    PrecisionPolicy,
    stage_policy,
)
from zeroshard.core.sharded import Sharded
from zeroshard.core.unit import UnitState
from zeroshard.inference import generate as generation
from zeroshard.inference.packed import PackedMatmuls
from zeroshard.inference.quantization import QuantSpec
from zeroshard.inference.speculative_in_step import generate_in_step
from zeroshard.inference.store import QuantizedStore
from zeroshard.offload import CPUStore

log = logging.getLogger(__name__)


def shard(
    model: nn.Module,
    *,
    offload: OffloadPolicy | None = None,
    quantize: QuantSpec | None = None,
    packed_matmul: bool = False,
    stage: int = 3,
    precision: PrecisionPolicy | None = None,
    gathering: GatheringPolicy | None = None,
    communication: CommunicationPolicy | None = None,
    group=None,
    generate_gather: str = "units",
) -> InferenceModel:
    """`model` for forward passes and generation under ZeRO, its weights sharded over `group`'s
    ranks (default: the whole world) at `stage` 3, or replicated at stage 0.

    `offload`: where the shards live between uses, the offload policies of `zeroshard.shard`:
    `zeroshard.CPUOffload(params=True)` (host memory), `zeroshard.NVMeOffload(path)` (files, reads
    "direct" by default; `max_in_cpu` keeps the first shards in memory) or a `Placement`; None: in
    compute memory.
    `quantize`: every parameter of two or more dimensions kept group-wise quantized in the store
    ([Note: quantized weight store] in inference/store.py; host memory unless `offload` says
    otherwise), dequantized into its unit's buffer on use; needs stage 3. `packed_matmul`: with
    4-bit `quantize` on one rank, Linear layers multiply by their weights as stored ([Note: packed
    matmuls] in inference/packed.py). `precision`, `gathering`, `communication`: the core's policies, as for
    `zeroshard.shard`. `generate_gather`: how `generate` gathers at stage 3, "units" (each unit for
    each forward) or "whole" (the whole model once for the call).
    Rank 0's parameter values are broadcast first, as `zeroshard.shard` does; a model built on the
    meta device gets its values from `InferenceModel.load_weights` ([Note: deferred values] in
    core/group.py). Collective."""
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta:
        raise ValueError(
            f"buffers {meta[:3]} are on the meta device (no values): build the model with "
            "zeroshard.inference.from_pretrained, or give its buffers values first"
        )
    if stage not in (0, 3):
        raise ValueError(
            f"shard(stage={stage!r}): inference replicates the weights (stage 0) or shards them (stage 3); "
            "stages 1 and 2 partition optimizer state, which inference has none of"
        )
    if generate_gather not in generation.GATHER:
        raise ValueError(
            f"shard(generate_gather={generate_gather!r}): allowed {', '.join(map(repr, generation.GATHER))}"
        )
    # Checked before the Communicator, whose process group a refusal would leave behind.
    _check_quantized(quantize, packed_matmul, stage, dist.get_world_size(group) if dist.is_initialized() else 1)
    if offload is not None and not isinstance(offload, OffloadPolicy):
        raise TypeError(
            f"shard(offload={offload!r}): zeroshard.CPUOffload(params=True), zeroshard.NVMeOffload(path), "
            "a zeroshard.Placement of stores, or None (the weights stay in compute memory)"
        )
    communication = communication or CommunicationPolicy()
    communicator = Communicator(communication.timeout_s, communication.check_collectives, group=group)
    placement = place(offload, model, communicator.rank, communicator.world_size, None, stage == 3)
    if offload is not None and placement.param_store is None:
        placement.destroy()
        communicator.destroy()
        raise ValueError(
            f"shard(offload={offload!r}) places optimizer states, and inference has none: "
            "CPUOffload(params=True) keeps the weights in host memory"
        )
    gathering = gathering or GatheringPolicy()
    if quantize is not None:  # every matrix is quantized, so every parameter lives in the (quantized) store
        placement.param_store = QuantizedStore(placement.param_store or CPUStore(), quantize, kernel=packed_matmul)
        gathering = dataclasses.replace(gathering, persistence_threshold=0)
    sharded = Sharded(
        model,
        None,
        communicator,
        stage_policy(stage),
        precision or PrecisionPolicy(),
        placement,
        gathering=gathering,
        communication=communication,
        whole_parameters=quantize is not None,
    )
    packed = PackedMatmuls(model, sharded._groups, placement.param_store) if packed_matmul else None
    log.info(
        "zeroshard inference: stage %d, %d ranks, %d units, %.3fM parameters, weights in %s",
        stage,
        communicator.world_size,
        len(sharded._units),
        sharded.num_parameters() / 1e6,
        getattr(placement.param_store, "kind", "compute memory"),
    )
    return InferenceModel(sharded, packed, generate_gather)


def _check_quantized(quantize: QuantSpec | None, packed_matmul: bool, stage: int, world_size: int) -> None:
    if packed_matmul and (quantize is None or quantize.num_bits != 4):
        raise ValueError(
            "shard(packed_matmul=True) multiplies by 4-bit weights as stored: it needs shard(quantize=...) "
            f"with num_bits 4 (got {'none' if quantize is None else f'num_bits {quantize.num_bits}'})"
        )
    if packed_matmul and world_size > 1:
        raise ValueError(
            f"shard(packed_matmul=True) works on one rank (this model has {world_size}): at N ranks the "
            "weights of the other ranks arrive as fp32 over the all-gather; leave it off"
        )
    if quantize is not None and stage != 3:
        raise ValueError(
            "shard(quantize=...) keeps quantized parameter shards in the stage-3 parameter store: it "
            f"needs shard(stage=3) (got stage {stage})"
        )


class InferenceModel:
    """A model under ZeRO for forward passes and generation only; build it with `shard()` or
    `from_pretrained()`.

    The model is put in eval mode (no dropout). `model(...)` runs it without autograd; `generate`
    is the model's own (transformers') `generate`, safe on several stage-3 ranks. `sharded` is the
    core object underneath (its units, flat groups, stores, communicator and reports)."""

    def __init__(self, sharded: Sharded, packed: PackedMatmuls | None = None, generate_gather: str = "units"):
        self.sharded = sharded
        self.packed = packed  # the layers that multiply packed, with packed_matmul
        self.generate_gather = generate_gather
        sharded.module.eval()
        self._freeze(True)

    # -- the core's parts -----------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.sharded.module

    @property
    def units(self) -> list:
        return self.sharded._units

    @property
    def groups(self) -> list:
        return self.sharded._groups

    @property
    def placement(self) -> Placement:
        return self.sharded._placement

    @property
    def rank(self) -> int:
        return self.sharded.comm.rank

    @property
    def world_size(self) -> int:
        return self.sharded.comm.world_size

    # -- frozen weights -------------------------------------------------------------------------------
    # [Note: frozen inference weights]
    # Nothing writes the weights between loads, so the NVMe store reads them for each use into
    # read-only buffers and drops them after it with no write-back ([Note: where a swap file's
    # tensor lies] in offload/swapfile.py). This object's own writers (loading weights, a
    # checkpoint, gathered_parameters with a modifier) unfreeze them for the duration.
    def _freeze(self, frozen: bool) -> None:
        for group in self.sharded._groups:
            if group.master_store is not None:
                group.master_store.freeze([group.master], frozen)

    @contextlib.contextmanager
    def _writable(self):
        self._freeze(False)
        try:
            yield
        finally:
            self._freeze(True)

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            return self.sharded(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """`module.generate(*args, **kwargs)` under `torch.no_grad()` (inference/generate.py). With an
        `assistant_model` (speculative decoding; a `resident_draft` is one) on several stage-3 ranks,
        the ranks keep in step themselves ([Note: speculative decoding on several ranks] in
        inference/speculative_in_step.py). Nothing stays gathered afterwards, even on error."""
        if isinstance(kwargs.get("assistant_model"), InferenceModel):
            kwargs["assistant_model"] = kwargs["assistant_model"].module
        if kwargs.get("assistant_model") is None or not (self.sharded.policy.shard_parameters and self.world_size > 1):
            return generation.generate(self.sharded, *args, gather=self.generate_gather, **kwargs)
        try:
            with torch.no_grad():
                return generate_in_step(self.sharded, *args, **kwargs)
        finally:
            self.reshard()

    def reshard(self) -> None:
        """Free every gathered unit (a forward that raised never reached the hook that frees its unit)."""
        for unit in self.sharded._units:
            unit.reshard()

    def gathered_units(self) -> list[str]:
        """Names of resharding units that are not sharded now (empty between forwards)."""
        return [u.name for u in self.sharded._units if u.reshards and u.state is not UnitState.SHARDED]

    # -- weights --------------------------------------------------------------------------------------
    def load_weights(self, source, strict: bool = True) -> None:
        """Full weights into the shards, each rank reading only its own element ranges: a safetensors
        file, a directory of them (a sharded Hugging Face checkpoint), a state dict. Collective."""
        from zeroshard.checkpoint.contract import CheckpointableSharded
        from zeroshard.checkpoint.weights import load_full_weights

        with self._writable():
            load_full_weights(CheckpointableSharded(self.sharded), source, strict=strict)

    def load_checkpoint(self, load_dir, tag=None, *, strict: bool = True, verify: bool = True) -> str:
        """The module weights of a training checkpoint (zeroshard's or DeepSpeed's, any world size
        and stage) into the store, group by group, never the whole model in memory
        (checkpoint/module_weights.py). `tag`: default the one `latest` names, or `load_dir` itself
        when it is one checkpoint. Returns the checkpoint directory read. Collective."""
        from zeroshard.checkpoint.contract import CheckpointableSharded
        from zeroshard.checkpoint.module_weights import load_module_weights

        with self._writable():
            return load_module_weights(CheckpointableSharded(self.sharded), load_dir, tag, strict=strict, verify=verify)

    def refresh_parameters(self) -> None:
        self.sharded.refresh_parameters()

    @contextlib.contextmanager
    def gathered_parameters(self, params, modifier_rank: int | None = None):
        """`Sharded.gathered_parameters`, the weights writable for the duration."""
        with self._writable(), self.sharded.gathered_parameters(params, modifier_rank) as value:
            yield value

    # -- reports --------------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return self.sharded.num_parameters()

    def memory_report(self) -> dict[str, int]:
        """Bytes of model states this rank holds (counted from its tensors), by kind."""
        return self.sharded.memory_report()

    def comm_report(self) -> dict:
        return self.sharded.comm_report()

    def destroy(self) -> None:
        """Give every packed layer its own class back, and free the stores."""
        if self.packed is not None:
            self.packed.detach()
        self.sharded.destroy()
