"""ZeRO-Inference under DeepSpeed's config: the engine `initialize` returns without an optimizer.

`zeroshard.initialize(model=model, config=...)` with no optimizer returns an `InferenceEngine`:
DeepSpeed's config keys mapped onto `zeroshard.inference.shard`'s arguments (`inference_options`),
and DeepSpeed's engine accessors (compat/engine_base.py) around what that returns. Everything
inference does is the inference layer's (zeroshard/inference/); this module only maps.

    engine, *_ = zeroshard.initialize(model=model, config={"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})
    tokens = engine.module.generate(input_ids, max_new_tokens=32)   # or engine.generate(...)

`from_pretrained(path, config)` does the same for a Hugging Face checkpoint directory, never
materialising the model (zeroshard.inference.from_pretrained).
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist
from torch import nn

from zeroshard.compat import policies
from zeroshard.compat.comm import init_distributed
from zeroshard.compat.engine_base import EngineBase
from zeroshard.compat.throughput import ThroughputTimer
from zeroshard.config import load_config
from zeroshard.inference import pretrained
from zeroshard.inference.quantization import QuantSpec
from zeroshard.inference.sharded import InferenceModel, shard
from zeroshard.offload import CPUOffload, NVMeOffload, keeps_some_in_cpu

log = logging.getLogger(__name__)

_NOT_TRAINED = (
    "this engine was built by initialize() without an optimizer, for inference "
    "(ZeRO-Inference): pass optimizer=... or add an 'optimizer' section to the config to train"
)
DEFAULT_CONFIG = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}


def inference_options(config) -> dict:
    """The parsed config as `zeroshard.inference.shard`'s keyword arguments. Call it, and `shard`,
    under `policies.config_terms()`, so that an error about an argument names its config key."""
    zero, extras = config.zero_optimization, config.zeroshard
    if zero.offload_optimizer is not None and zero.offload_optimizer.device != "none":
        log.warning(
            "zero_optimization.offload_optimizer is not acted on: initialize() got no optimizer "
            "(inference), so there are no optimizer states to offload"
        )
    section = config.weight_quantization.quantized_initialization
    return {
        # DeepSpeed ignores offload_param below stage 3, as the training engine does (compat/engine.py)
        "offload": _offload(zero.offload_param, config.aio, extras.nvme_io) if zero.stage == 3 else None,
        "quantize": None
        if section is None
        else QuantSpec(section.num_bits, section.group_size, section.group_dim, section.symmetric),
        "packed_matmul": extras.packed_matmul,
        "stage": zero.stage,
        "precision": policies.precision_policy(config),
        "gathering": policies.gather_policy(zero, extras),
        "communication": policies.communication_policy(
            zero, extras
        ),  # qwZ and MiCS act on the gathers; hpZ and qgZ need a backward
        "generate_gather": extras.generate_gather,
    }


def _offload(section, aio, nvme_io: str | None) -> CPUOffload | NVMeOffload | None:
    """`offload_param` as an offload policy of the parameters only; `max_in_cpu` only where it is
    acted on (keeps_some_in_cpu)."""
    if section is None or section.device == "none":
        return None
    if section.device == "cpu":
        return CPUOffload(params=True, pin_memory=section.pin_memory)
    return NVMeOffload(
        section.nvme_path,
        optimizer=False,
        max_in_cpu=section.max_in_cpu if keeps_some_in_cpu(section) else None,
        pin_memory=section.pin_memory,
        io=nvme_io or "direct",
        threads=aio.thread_count if aio is not None else 1,
    )


class InferenceEngine(EngineBase):
    """A model under ZeRO for forward passes only; build it with `zeroshard.initialize` and no optimizer.

    It is `zeroshard.inference.shard`'s `InferenceModel` (`engine.inference`) as DeepSpeed's engine
    shows it: the model in eval mode (`engine.train()` undoes that), `engine(...)` runs it without
    autograd, `engine.module` is the model, whose `generate` works as usual on one rank; on several
    ranks use `engine.generate` (or pass `synced_gpus=True`). DeepSpeed's accessors (`device`,
    `zero_optimization_stage()`, `get_lr()`, ...) answer as on DeepSpeed's engine built without an
    optimizer (compat/engine_base.py).
    """

    def __init__(self, model: nn.Module, config, inference: InferenceModel | None = None):
        """`inference`: `model` already under `zeroshard.inference` with `inference_options(config)`
        (from_pretrained); None: put it there now."""
        super().__init__(model, config)
        if inference is None:
            with policies.config_terms():
                inference = shard(model, **inference_options(config))
        self.inference = inference
        self.sharded = inference.sharded
        self.tput_timer = ThroughputTimer(config.train_batch_size)

    # -- the core's parts, read-only (EngineBase has the rest; its optimizer is None): no scheduler ---
    lr_scheduler = property(lambda self: None)

    # -- inference ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.inference(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """`InferenceModel.generate`: speculative decoding too (an `assistant_model`, which may be an
        inference engine or a `resident_draft`), on several stage-3 ranks as well. Nothing stays
        gathered afterwards, even on error."""
        if isinstance(kwargs.get("assistant_model"), InferenceEngine):
            kwargs["assistant_model"] = kwargs["assistant_model"].inference
        return self.inference.generate(*args, **kwargs)

    def reshard(self) -> None:
        """Free every gathered unit (a forward that raised never reached the hook that frees its unit)."""
        self.inference.reshard()

    def backward(self, *args, **kwargs):
        raise RuntimeError(f"engine.backward(): {_NOT_TRAINED}")

    def step(self, *args, **kwargs):
        raise RuntimeError(f"engine.step(): {_NOT_TRAINED}")

    # -- weights --------------------------------------------------------------------------------------
    def load_weights(self, source, strict: bool = True) -> None:
        """`InferenceModel.load_weights`: full weights into the shards. Collective."""
        self.inference.load_weights(source, strict=strict)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, verify: bool = True, **ignored):
        """`InferenceModel.load_checkpoint`: the module weights of a training checkpoint into the
        store. DeepSpeed's training-state arguments (`load_optimizer_states`,
        `load_lr_scheduler_states`, `load_module_only`) are accepted and mean nothing here: an
        inference engine has no optimizer, scheduler or step counters. Returns `(checkpoint
        directory, {})`, as DeepSpeed's `load_checkpoint` returns `(path, client_state)`. Collective."""
        unknown = sorted(set(ignored) - {"load_optimizer_states", "load_lr_scheduler_states", "load_module_only"})
        if unknown:
            raise TypeError(f"load_checkpoint() got unexpected keyword argument(s) {unknown}")
        return self.inference.load_checkpoint(load_dir, tag, strict=load_module_strict, verify=verify), {}

    def refresh_parameters(self) -> None:
        self.inference.refresh_parameters()

    def gathered_parameters(self, params, modifier_rank: int | None = None):
        return self.inference.gathered_parameters(params, modifier_rank)

    # -- reports --------------------------------------------------------------------------------------
    def gathered_units(self) -> list[str]:
        """Names of resharding units that are not sharded now (empty between forwards)."""
        return self.inference.gathered_units()

    def destroy(self) -> None:
        self.inference.destroy()


def from_pretrained(path, config=None, *, model_class=None, strict: bool = True) -> InferenceEngine:
    """An InferenceEngine over the Hugging Face checkpoint directory `path`, its weights loaded
    straight into the store of `config` (a DeepSpeed config: dict or JSON path; default stage 3,
    weights in CPU memory): `zeroshard.inference.from_pretrained` with the config's options.
    `model_class` defaults to AutoModelForCausalLM. Collective: every rank calls it; each reads only
    its own shards."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        init_distributed()  # from torchrun's environment; nothing when already initialised
    pretrained.init_one_rank()
    cfg = load_config(config if config is not None else DEFAULT_CONFIG, dist.get_world_size())
    if cfg.optimizer is not None or cfg.scheduler is not None:
        raise ValueError(
            "from_pretrained builds an inference engine: remove the config's 'optimizer' and "
            "'scheduler' sections (train with zeroshard.initialize(..., optimizer=...))"
        )
    with policies.config_terms():
        inference = pretrained.from_pretrained(path, model_class=model_class, strict=strict, **inference_options(cfg))
    return InferenceEngine(inference.module, cfg, inference)
