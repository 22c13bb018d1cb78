"""ZeRO-Inference: generate with a model larger than memory (DeepSpeed's ZeRO-Inference surface).

`zeroshard.initialize(model=model, config=...)` with no optimizer returns an `InferenceEngine`: stage-3
parameter offload with nothing to train. The weights live in the CPU or NVMe store
(`zero_optimization.offload_param`) as this rank's shards, which are the only copy of them (no
gradient buffers, no optimizer state, no separate master); each forward gathers one unit at a time
and prefetches the next in the order recorded on the first pass ([Note: inference prefetch] in
core/lifecycle.py). Generation reads every weight once per generated token for the whole batch, so
tokens/s grows with the batch size until compute, not the disk, is the bottleneck.

    engine, *_ = zeroshard.initialize(model=model, config={"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})
    tokens = engine.module.generate(input_ids, max_new_tokens=32)   # or engine.generate(...)

On N ranks the weights are partitioned N ways and each rank generates its own batch; every forward
is a collective, so every rank must run the same number of them (`engine.generate` turns on
transformers' `synced_gpus` for that, as DeepSpeed ZeRO-3 does). To build a model larger than memory
without ever materialising it, see `zeroshard.compat.pretrained.from_pretrained`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from torch import nn

from zeroshard.compat import policies
from zeroshard.compat.engine_base import EngineBase
from zeroshard.compat.throughput import ThroughputTimer
from zeroshard.core.comm import Communicator
from zeroshard.core.policy import stage_policy
from zeroshard.core.sharded import Sharded
from zeroshard.core.unit import UnitState
from zeroshard.inference.packed import PackedMatmuls
from zeroshard.inference.quantization import QuantSpec
from zeroshard.inference.speculative_in_step import generate_in_step
from zeroshard.inference.store import QuantizedStore
from zeroshard.offload import CPUStore, build_placement

log = logging.getLogger(__name__)

_NOT_TRAINED = (
    "this engine was built by initialize() without an optimizer, for inference "
    "(ZeRO-Inference): pass optimizer=... or add an 'optimizer' section to the config to train"
)


class InferenceEngine(EngineBase):
    """A model under ZeRO for forward passes only; build it with `zeroshard.initialize` and no optimizer.

    The model is put in eval mode (no dropout), as inference wants; `engine.train()` undoes that.
    `engine(...)` runs the model without autograd. `engine.module` is the model, whose `generate` works
    as usual on one rank; on several ranks use `engine.generate` (or pass `synced_gpus=True`).
    DeepSpeed's accessors (`device`, `zero_optimization_stage()`, `get_lr()`, ...) answer as on
    DeepSpeed's engine built without an optimizer (compat/engine_base.py).
    """

    def __init__(self, model: nn.Module, config, group=None):
        """`group`: the process group the weights are sharded over (default: the whole world); a
        resident draft uses its own rank alone (compat/speculative.py)."""
        meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
        if meta:
            raise ValueError(
                f"buffers {meta[:3]} are on the meta device (no values): build the model with "
                "zeroshard.compat.pretrained.from_pretrained, or give its buffers values first"
            )
        super().__init__(model, config)
        zero = config.zero_optimization
        extras = config.zeroshard
        if zero.offload_optimizer is not None and zero.offload_optimizer.device != "none":
            log.warning(
                "zero_optimization.offload_optimizer is not acted on: initialize() got no optimizer "
                "(inference), so there are no optimizer states to offload"
            )
        # qwZ and MiCS act on the gathers; hpZ and qgZ need a backward
        comm_policy = policies.comm_policy(zero, extras)
        comm = Communicator(comm_policy.timeout_s, comm_policy.check_collectives, group=group)
        numel = sum(p.numel() for p in model.parameters())
        placement = build_placement(
            zero, config.aio, None, numel, comm.rank, comm.world_size, nvme_io=extras.nvme_io or "direct"
        )
        quantized = quantized_store(config, placement, comm.world_size)
        gathering = policies.gather_policy(zero, extras)
        if quantized:  # every matrix is quantized, so every parameter lives in the (quantized) store
            gathering = dataclasses.replace(gathering, persistence_threshold=0)
        with policies.config_terms():
            self.sharded = Sharded(
                model,
                None,
                comm,
                stage_policy(zero.stage),
                policies.precision_policy(config),
                placement,
                gathering=gathering,
                comm_policy=comm_policy,
                whole_parameters=quantized,
            )
        self._packed = (
            PackedMatmuls(model, self.sharded.groups, placement.param_store) if extras.packed_matmul else None
        )
        model.eval()
        self._freeze(True)
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        log.info(
            "zeroshard inference engine: stage %d, %d ranks, %d units, %.3fM parameters, weights in %s",
            zero.stage,
            comm.world_size,
            len(self.units),
            self.num_parameters() / 1e6,
            getattr(placement.param_store, "kind", "compute memory"),
        )

    # -- the core's parts, read-only (EngineBase has the rest; its optimizer is None): no scheduler ---
    lr_scheduler = property(lambda self: None)

    # -- frozen weights -------------------------------------------------------------------------------
    # [Note: frozen inference weights]
    # Nothing writes the weights between loads, so the NVMe store reads them for each use into
    # read-only buffers and drops them after it with no write-back ([Note: where a swap file's
    # tensor lies] in offload/swapfile.py). The engine's own writers (loading weights, a checkpoint,
    # GatheredParameters with a modifier) unfreeze them for the duration.
    def _freeze(self, frozen: bool) -> None:
        for group in self.sharded.groups:
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
    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return self.sharded(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """As `EngineBase.generate`; with an `assistant_model` (speculative decoding, which may be a
        `resident_draft` engine) on several stage-3 ranks, the ranks keep in step themselves ([Note:
        speculative decoding on several ranks] in inference/speculative_in_step.py). Nothing stays gathered
        afterwards, even on error."""
        if isinstance(kwargs.get("assistant_model"), InferenceEngine):  # a resident draft (compat/speculative.py)
            kwargs["assistant_model"] = kwargs["assistant_model"].module
        if kwargs.get("assistant_model") is None or not (self.policy.shard_parameters and self.world_size > 1):
            return super().generate(*args, **kwargs)
        try:
            with torch.no_grad():
                return generate_in_step(self.sharded, *args, **kwargs)
        finally:
            self.reshard()

    def reshard(self) -> None:
        """Free every gathered unit (a forward that raised never reached the hook that frees its unit)."""
        for unit in self.units:
            unit.reshard()

    def backward(self, *args, **kwargs):
        raise RuntimeError(f"engine.backward(): {_NOT_TRAINED}")

    def step(self, *args, **kwargs):
        raise RuntimeError(f"engine.step(): {_NOT_TRAINED}")

    # -- weights --------------------------------------------------------------------------------------
    def load_weights(self, source, strict: bool = True) -> None:
        """Full weights into the shards, each rank reading only its own element ranges: a safetensors
        file, a directory of them (a sharded Hugging Face checkpoint), a state dict. Collective."""
        from zeroshard.checkpoint.weights import load_full_weights

        with self._writable():
            load_full_weights(self, source, strict=strict)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, verify: bool = True, **ignored):
        """The module weights of a training checkpoint (zeroshard's or DeepSpeed's, any world size
        and stage) into the store, group by group, never the whole model in memory
        (checkpoint/module_weights.py). `tag`: default the one `latest` names, or `load_dir` itself
        when it is one checkpoint. DeepSpeed's training-state arguments (`load_optimizer_states`,
        `load_lr_scheduler_states`, `load_module_only`) are accepted and mean nothing here: an
        inference engine has no optimizer, scheduler or step counters. Returns `(checkpoint
        directory, {})`, as DeepSpeed's `load_checkpoint` returns `(path, client_state)`. Collective."""
        from zeroshard.checkpoint.module_weights import load_module_weights

        unknown = sorted(set(ignored) - {"load_optimizer_states", "load_lr_scheduler_states", "load_module_only"})
        if unknown:
            raise TypeError(f"load_checkpoint() got unexpected keyword argument(s) {unknown}")
        with self._writable():
            return load_module_weights(self, load_dir, tag, strict=load_module_strict, verify=verify), {}

    def refresh_parameters(self) -> None:
        self.sharded.refresh_parameters()

    @contextlib.contextmanager
    def gathered_parameters(self, params, modifier_rank: int | None = None):
        with self._writable(), self.sharded.gathered_parameters(params, modifier_rank) as value:
            yield value

    # -- reports --------------------------------------------------------------------------------------
    def gathered_units(self) -> list[str]:
        """Names of resharding units that are not sharded now (empty between forwards)."""
        return [u.name for u in self.units if u.reshards and u.state is not UnitState.SHARDED]

    def destroy(self) -> None:
        if self._packed is not None:
            self._packed.detach()
        self.sharded.destroy()


def quantized_store(config, placement, world_size: int) -> bool:
    """With `weight_quantization.quantized_initialization`, the parameter store becomes a
    QuantizedStore over the configured one (host memory when none is): [Note: quantized weight
    store] in inference/store.py; with `zeroshard.packed_matmul`, one that lays 4-bit Linear
    weights out for torch's int4 kernel ([Note: packed matmuls] in inference/packed.py).
    Returns whether it did."""
    section = config.weight_quantization.quantized_initialization
    packed = config.zeroshard.packed_matmul
    if packed and (section is None or section.num_bits != 4):
        raise ValueError(
            "zeroshard.packed_matmul: true multiplies by 4-bit weights as stored: it needs "
            "weight_quantization.quantized_initialization with num_bits 4 (got "
            f"{'no such section' if section is None else f'num_bits {section.num_bits}'})"
        )
    if packed and world_size > 1:
        raise ValueError(
            f"zeroshard.packed_matmul: true works on one rank (this engine has {world_size}): at N ranks the "
            "weights of the other ranks arrive as fp32 over the all-gather; set it to false"
        )
    if section is None:
        return False
    if config.zero_optimization.stage != 3:
        raise ValueError(
            "weight_quantization.quantized_initialization keeps quantized parameter shards in the "
            f"stage-3 parameter store: set zero_optimization.stage to 3 (got {config.zero_optimization.stage})"
        )
    spec = QuantSpec(section.num_bits, section.group_size, section.group_dim, section.symmetric)
    placement.param_store = QuantizedStore(placement.param_store or CPUStore(), spec, kernel=packed)
    return True
