"""Typed, documented sections of a DeepSpeed-style JSON config.

Every attribute is named exactly as the DeepSpeed JSON key it comes from and defaults to DeepSpeed's
default (``deepspeed/runtime/zero/config.py``, ``zero/offload_config.py``, ``fp16`` / ``aio`` constants,
``lr_schedules.py``). Parsing (unknown keys, ``"auto"``, warnings, error messages) lives in
``zeroshard.config``; this module only describes what a valid section is.

The shared base and number types are in ``base``, the offload and ``aio`` sections in
``offload``; both are re-exported here.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import AliasChoices, Field, field_validator, model_validator

from zeroshard.config.base import (
    Fraction,
    LrValue,
    NonNegFloat,
    NonNegInt,
    OpenFraction,
    PosFloat,
    PosInt,
    Section,
    canonical_name,
)
from zeroshard.config.offload import (  # noqa: F401
    AioConfig,
    OffloadDevice,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    _check_nvme_path,
)

# --- optimizer -----------------------------------------------------------------------------------


class AdamParams(Section):
    """``optimizer.params`` for type Adam / AdamW (DeepSpeed FusedAdam defaults)."""

    section_path: ClassVar[str] = "optimizer.params"
    auto_keys: ClassVar[frozenset[str]] = frozenset({"lr", "betas", "eps", "weight_decay"})

    lr: NonNegFloat = 1e-3
    """Learning rate (the starting value; a scheduler may overwrite it)."""
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates."""
    eps: NonNegFloat = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: NonNegFloat = 0.0
    """FusedAdam's default 0.0. With ``torch_adam: true`` and the key absent, torch's default applies
    (0.01 for AdamW math), as in DeepSpeed."""
    adam_w_mode: bool = True
    """Decoupled weight decay (AdamW math). DeepSpeed's "Adam" is AdamW unless this is false; type
    "AdamW" is always AdamW."""
    torch_adam: bool = False
    """DeepSpeed: use torch.optim.Adam/AdamW instead of FusedAdam. zeroshard always uses torch's."""
    amsgrad: bool = False
    """Use the AMSGrad variant (maximum of past second moments)."""


class SGDParams(Section):
    """``optimizer.params`` for type SGD (torch.optim.SGD defaults, as DeepSpeed passes them through)."""

    section_path: ClassVar[str] = "optimizer.params"
    auto_keys: ClassVar[frozenset[str]] = frozenset({"lr", "weight_decay"})

    lr: NonNegFloat = 1e-3
    """Learning rate."""
    momentum: NonNegFloat = 0.0
    """Momentum factor."""
    dampening: NonNegFloat = 0.0
    """Dampening for momentum."""
    weight_decay: NonNegFloat = 0.0
    """L2 penalty added to the gradient."""
    nesterov: bool = False
    """Nesterov momentum; needs momentum > 0 and dampening = 0."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "nesterov=true needs momentum > 0 and dampening = 0 "
                f"(got momentum={self.momentum}, dampening={self.dampening})"
            )
        return self


class MuonParams(Section):
    """``optimizer.params`` for type Muon: torch's Muon for the hidden matrices (2-D parameters whose
    name has neither "embed" nor "lm_head", DeepSpeed's split) and AdamW for every other parameter.
    A key left out takes DeepSpeed's MuonWithAuxAdam default."""

    section_path: ClassVar[str] = "optimizer.params"
    auto_keys: ClassVar[frozenset[str]] = frozenset({"lr", "betas", "eps", "weight_decay"})

    lr: NonNegFloat | None = None
    """Learning rate of both parts unless ``muon_lr`` / ``adam_lr`` set theirs (Muon 0.02, AdamW 3e-4)."""
    muon_lr: NonNegFloat | None = None
    """Muon's learning rate; overrides ``lr`` for the matrices."""
    adam_lr: NonNegFloat | None = None
    """AdamW's learning rate; overrides ``lr`` for the other parameters."""
    momentum: NonNegFloat = 0.95
    """Muon's momentum."""
    weight_decay: NonNegFloat = 0.0
    """Decoupled weight decay of both parts."""
    betas: tuple[Fraction, Fraction] = (0.9, 0.95)
    """AdamW's moment decay rates."""
    eps: NonNegFloat = 1e-10
    """AdamW's epsilon."""
    ns_method: str = "gram"
    """DeepSpeed's Newton-Schulz variant; torch's Muon runs the quintic iteration, so it is reported as
    not acted on."""
    per_head_muon: bool = False
    """DeepSpeed: orthogonalise each attention head's block of a fused projection apart. zeroshard
    updates each matrix whole (torch's Muon), so it is reported as not acted on."""
    adam_w_mode: bool = True
    """The other parameters' Adam with decoupled weight decay (AdamW), the only mode here."""

    @model_validator(mode="after")
    def _adamw_only(self) -> MuonParams:
        if not self.adam_w_mode:
            raise ValueError(
                "adam_w_mode=false: zeroshard's Muon steps the parameters Muon does not take with AdamW "
                "(decoupled weight decay); leave adam_w_mode out or true"
            )
        return self


OPTIMIZER_TYPES: dict[str, type[Section]] = {
    "Adam": AdamParams,
    "AdamW": AdamParams,
    "SGD": SGDParams,
    "Muon": MuonParams,
}


class OptimizerConfig(Section):
    """The ``optimizer`` section: which torch optimizer the engine builds, and its hyperparameters."""

    section_path: ClassVar[str] = "optimizer"
    params_by_type: ClassVar[dict[str, type[Section]]] = OPTIMIZER_TYPES

    type: str
    """One of Adam, AdamW, SGD, Muon (case-insensitive in the JSON; stored canonically)."""
    params: AdamParams | SGDParams | MuonParams
    """Hyperparameters; which keys are valid depends on ``type``."""

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> str:
        return canonical_name(value, tuple(OPTIMIZER_TYPES), "optimizer type")


# --- scheduler -----------------------------------------------------------------------------------

WarmupType = Literal["log", "linear"]
_SCHEDULER_AUTO = frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"})


class WarmupLRParams(Section):
    """``scheduler.params`` for WarmupLR: warm up from min to max lr, then hold max."""

    section_path: ClassVar[str] = "scheduler.params"
    auto_keys: ClassVar[frozenset[str]] = _SCHEDULER_AUTO

    warmup_min_lr: LrValue = 0.0
    """Starting lr (one value, or one per param group)."""
    warmup_max_lr: LrValue | None = None
    """Lr reached after warmup; None = the optimizer's lr of param group 0 (DeepSpeed's WarmupLR)."""
    warmup_num_steps: NonNegInt = 1000
    """Steps of warmup; values below 2 are treated as 2 (DeepSpeed)."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup curve."""
    last_batch_iteration: Annotated[int, Field(ge=-1)] = -1
    """Index of the last step taken; -1 starts from the beginning."""


class WarmupDecayLRParams(WarmupLRParams):
    """``scheduler.params`` for WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: PosInt
    """Total number of training steps (required)."""
    warmup_max_lr: LrValue = 0.001
    """Lr reached after warmup (DeepSpeed's WarmupDecayLR default 0.001, not the optimizer's lr)."""


class WarmupCosineLRParams(Section):
    """``scheduler.params`` for WarmupCosineLR: ratios of the optimizer's lr, warmup then cosine."""

    section_path: ClassVar[str] = "scheduler.params"
    auto_keys: ClassVar[frozenset[str]] = _SCHEDULER_AUTO

    total_num_steps: PosInt
    """Total number of training steps (required)."""
    warmup_min_ratio: NonNegFloat = 0.0
    """Starting lr as a fraction of the optimizer's lr."""
    warmup_num_steps: NonNegInt = 1000
    """Steps of warmup; values below 2 are treated as 2 (DeepSpeed)."""
    cos_min_ratio: NonNegFloat = 0.0001
    """Final lr as a fraction of the optimizer's lr."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup curve."""
    last_batch_iteration: Annotated[int, Field(ge=-1)] = -1
    """Index of the last step taken; -1 starts from the beginning."""


MomValue = Fraction | list[Fraction]


class OneCycleParams(Section):
    """``scheduler.params`` for OneCycle: lr up from min to max and back over one cycle, momentum the
    other way, then an optional decay."""

    section_path: ClassVar[str] = "scheduler.params"

    cycle_min_lr: LrValue
    """Lr at the start and end of the cycle (one value, or one per param group; required)."""
    cycle_max_lr: LrValue
    """Lr at the top of the cycle (one value, or one per param group; required)."""
    decay_lr_rate: NonNegFloat = 0.0
    """After the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size); 0 holds it."""
    cycle_first_step_size: PosInt = 2000
    """Steps of the rising half of the cycle."""
    cycle_second_step_size: NonNegInt | None = None
    """Steps of the falling half of the cycle; None = cycle_first_step_size."""
    cycle_first_stair_count: NonNegInt = 0
    """Flat stairs in the rising half; 0 = change every step."""
    cycle_second_stair_count: NonNegInt | None = None
    """Flat stairs in the falling half; None = cycle_first_stair_count."""
    decay_step_size: NonNegInt = 0
    """Steps per unit of decay after the cycle; 0 = no decay."""
    cycle_momentum: bool = True
    """Cycle ``betas[0]`` inversely to the lr (optimizers with ``betas`` only; others warn and keep
    their momentum, as in DeepSpeed)."""
    cycle_min_mom: MomValue = 0.8
    """Momentum at the top of the cycle (one value, or one per param group)."""
    cycle_max_mom: MomValue = 0.9
    """Momentum at the start and end of the cycle (one value, or one per param group)."""
    decay_mom_rate: NonNegFloat = 0.0
    """After the cycle, momentum = cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size)."""
    last_batch_iteration: Annotated[int, Field(ge=-1)] = -1
    """Index of the last step taken; -1 starts from the beginning."""


class LRRangeTestParams(Section):
    """``scheduler.params`` for LRRangeTest: lr = min_lr * (1 + step_rate * steps / step_size), rising
    without bound, to find the largest lr that trains."""

    section_path: ClassVar[str] = "scheduler.params"

    lr_range_test_min_lr: LrValue = 1e-3
    """Starting lr (one value, or one per param group)."""
    lr_range_test_step_size: PosInt = 2000
    """Steps per unit of increase."""
    lr_range_test_step_rate: NonNegFloat = 1.0
    """Increase of the lr, as a multiple of lr_range_test_min_lr, per lr_range_test_step_size steps."""
    lr_range_test_staircase: bool = False
    """Increase in steps of lr_range_test_step_size instead of continuously."""
    last_batch_iteration: Annotated[int, Field(ge=-1)] = -1
    """Index of the last step taken; -1 starts from the beginning."""


SCHEDULER_TYPES: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}


class SchedulerConfig(Section):
    """The ``scheduler`` section: a DeepSpeed lr schedule stepped once per optimizer step."""

    section_path: ClassVar[str] = "scheduler"
    params_by_type: ClassVar[dict[str, type[Section]]] = SCHEDULER_TYPES

    type: str
    """One of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest (case-insensitive; stored
    canonically)."""
    params: WarmupDecayLRParams | WarmupLRParams | WarmupCosineLRParams | OneCycleParams | LRRangeTestParams
    """Schedule parameters; which keys are valid depends on ``type``."""

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> str:
        return canonical_name(value, tuple(SCHEDULER_TYPES), "scheduler type")


# --- precision -----------------------------------------------------------------------------------


class FP16Config(Section):
    """The ``fp16`` section: fp16 compute with fp32 master weights and a loss scaler."""

    section_path: ClassVar[str] = "fp16"
    auto_keys: ClassVar[frozenset[str]] = frozenset({"enabled"})

    enabled: bool = False
    """Train in fp16, with fp32 master shards; an overflow on any rank skips the step on all ranks."""
    auto_cast: bool = False
    """Cast module inputs to fp16 automatically."""
    loss_scale: NonNegFloat = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: NonNegInt = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: PosInt = 1000
    """Steps without overflow before the dynamic scale is doubled."""
    hysteresis: PosInt = 2
    """Overflows tolerated before the dynamic scale is lowered."""
    consecutive_hysteresis: bool = False
    """Refill hysteresis after each step without overflow."""
    min_loss_scale: PosFloat = 1.0
    """Lower bound of the dynamic loss scale."""

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts (``loss_scale == 0``)."""
        return self.loss_scale == 0


class BF16Config(Section):
    """The ``bf16`` section (alias ``bfloat16``): bf16 compute, with fp32 master weights unless
    ``bf16_master_weights_and_grads``."""

    section_path: ClassVar[str] = "bf16"
    auto_keys: ClassVar[frozenset[str]] = frozenset({"enabled"})

    enabled: bool = False
    """Train in bf16."""
    bf16_master_weights_and_grads: bool = False
    """Keep the master weights in bf16: the bf16 parameters are their own masters and the optimizer gets
    its gradients in bf16 (2 bytes per parameter instead of a 4-byte fp32 copy). An update smaller than
    half a bf16 step of its weight is lost to rounding; torchao's optimizers with
    ``bf16_stochastic_round=True`` round stochastically instead (docs/mixed_precision.md)."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16; needs bf16_master_weights_and_grads. torch's optimizers keep their
    states like the master, so with bf16 masters they are bf16 whether or not this is set (false is
    reported as not acted on)."""

    @model_validator(mode="after")
    def _optimizer_states_need_master(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16_optimizer_states needs bf16_master_weights_and_grads: true (as in DeepSpeed)")
        return self


_AUTOCAST_DTYPES: dict[str, torch.dtype] = {
    **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16"), torch.bfloat16),
    **dict.fromkeys(("torch.float16", "fp16", "float16", "half"), torch.float16),
}


class TorchAutocastConfig(Section):
    """The ``torch_autocast`` section: run the engine's forward under ``torch.autocast``."""

    section_path: ClassVar[str] = "torch_autocast"

    enabled: bool = False
    """Wrap the forward in torch.autocast (parameters, masters and gradients stay in their dtype)."""
    dtype: str | None = None
    """Autocast dtype: bfloat16 / bf16 / torch.bfloat16 or float16 / fp16 / half / torch.float16;
    None = torch's default for the device (bf16 on CPU, fp16 on CUDA)."""
    lower_precision_safe_modules: list[str] | None = None
    """DeepSpeed: module classes whose gradients are reduced in the autocast dtype (accepted, not acted
    on: gradients are reduced in the reduce dtype)."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        if value is not None and value not in _AUTOCAST_DTYPES:
            raise ValueError(f"torch_autocast.dtype {value!r} is not one of {', '.join(_AUTOCAST_DTYPES)}")
        return value

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else _AUTOCAST_DTYPES[self.dtype]


# --- ZeRO ----------------------------------------------------------------------------------------


class ZeroConfig(Section):
    """The ``zero_optimization`` section: what is sharded and how it is communicated."""

    section_path: ClassVar[str] = "zero_optimization"
    auto_keys: ClassVar[frozenset[str]] = frozenset(
        {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"}
    )
    # Deprecated DeepSpeed spellings of the offload sections; the parser rewrites them.
    legacy_offload_keys: ClassVar[frozenset[str]] = frozenset(
        {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"}
    )
    sections: ClassVar[dict[str, type[Section]]] = {
        "offload_optimizer": OffloadOptimizerConfig,
        "offload_param": OffloadParamConfig,
    }

    stage: Literal[0, 1, 2, 3] = 0
    """0 = plain data parallel, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward (and, at stage 3, prefetch the next unit). True at every
    stage, where DeepSpeed's default is true at stage 3 only: off, stages 0-2 wait for each reduction
    inside backward (measured: docs/performance.md), and overlapping adds no memory at stages 0/1 (their full gradient buffers
    live across steps) and one unit's full gradient more at stages 2/3, the one whose reduction is in
    flight ([Note: one reduction in flight], lifecycle.py)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter rather than all-reduce."""
    reduce_bucket_size: NonNegInt = 500_000_000
    """Elements reduced at a time."""
    allgather_partitions: bool = True
    """All-gather updated partitions (rather than a series of broadcasts) after the step."""
    allgather_bucket_size: NonNegInt = 500_000_000
    """Elements all-gathered at a time."""
    round_robin_gradients: bool = False
    """Stage 1/2 with CPU offload: spread gradient copies over ranks."""
    stage3_prefetch_bucket_size: NonNegInt = 1
    """Stage 3: parameter elements gathered ahead of the unit being computed; the next unit is always
    prefetched when above 0, so the default 1 means "the next unit only" (FSDP2's; DeepSpeed's default
    is 5e7). 0: no prefetch. See [Note: bounded gathering] in core/gathered.py."""
    stage3_param_persistence_threshold: NonNegInt = 100_000
    """Stage 3: parameters with fewer elements stay unsharded."""
    stage3_max_live_parameters: NonNegInt | None = None
    """Stage 3: most parameter elements gathered at once (prefetches and reuse stop there; the unit
    being computed is gathered regardless). Unset: no bound beyond the prefetch's (DeepSpeed: 1e9)."""
    stage3_max_reuse_distance: NonNegInt = 1
    """Stage 3: keep a unit gathered from its forward to its backward when the units used in between
    hold fewer than this many elements: 0 frees every unit, the default 1 keeps the root unit,
    whose backward starts where its forward ends, and the unit that ran last in forward, whose backward
    follows the root's (gathered.py; DeepSpeed's default: 1e9)."""
    sub_group_size: NonNegInt = 1_000_000_000
    """Elements per optimizer-step tile (offload streams the step tile by tile)."""
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False,
        validation_alias=AliasChoices(
            "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"
        ),
    )
    """Stage 3: gather full 16-bit weights when saving the model; when false ``save_16bit_model``
    logs and returns False without writing, as in DeepSpeed."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload (stages 1-3)."""
    offload_param: OffloadParamConfig | None = None
    """Parameter offload (stage 3 only)."""
    zero_hpz_partition_size: NonNegInt = 1
    """ZeRO++ hpZ (stage 3): ranks per secondary partition group (one node); the backward gathers
    parameters inside it. 0 or 1 = off (DeepSpeed). Must divide the partition group size."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): all-gather parameters as block-quantized int8."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ (stage 3): reduce-scatter gradients as an all-to-all of block-quantized int8."""
    mics_shard_size: int = -1
    """MiCS (stage 3): partition over groups of this many consecutive ranks, replicate across them;
    -1 = off. Must divide the data-parallel world size."""

    @field_validator("mics_shard_size")
    @classmethod
    def _mics_size(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(
                f"zero_optimization.mics_shard_size={value}: -1 (off) or a rank count >= 1 that "
                "divides the data-parallel world size"
            )
        return value

    @model_validator(mode="after")
    def _offload_fits_stage(self) -> ZeroConfig:
        opt, par = self.offload_optimizer, self.offload_param
        # offload_optimizer at stage 0, offload_param below stage 3: DeepSpeed ignores them; so do we,
        # and not_acted_on.py reports them.
        if opt is not None and opt.ratio < 1.0 and self.stage != 3:
            raise ValueError(f"offload_optimizer.ratio < 1 needs stage 3 (got stage {self.stage})")
        _check_nvme_path(opt, "offload_optimizer")
        _check_nvme_path(par, "offload_param")
        return self


class ActivationCheckpointingConfig(Section):
    """The ``activation_checkpointing`` section (DeepSpeed's checkpointing.configure options)."""

    section_path: ClassVar[str] = "activation_checkpointing"

    partition_activations: bool = False
    """Shard checkpointed activations across data-parallel ranks."""
    cpu_checkpointing: bool = False
    """Keep checkpointed activations in CPU memory (GPU runs): the inputs of `checkpoint()` calls and of a
    transformers model's checkpointed layers."""
    contiguous_memory_optimization: bool = False
    """Copy checkpointed activations into one contiguous buffer."""
    number_checkpoints: PosInt | None = None
    """Number of checkpoints (sizes the contiguous buffer)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at each checkpoint boundary."""
    profile: bool = False
    """Log the time spent in checkpointed forward and recompute."""


class QuantizedInitConfig(Section):
    """``weight_quantization.quantized_initialization``: ZeRO-Inference's weights quantized while
    they are loaded and kept packed in the parameter store ([Note: quantized weight store] in
    inference/store.py). Every parameter of two or more dimensions (the weights of Linear and
    Embedding layers) is quantized group-wise; vectors (norms, biases) stay fp32. Every parameter
    lives in the store then (``stage3_param_persistence_threshold`` is not acted on)."""

    section_path: ClassVar[str] = "weight_quantization.quantized_initialization"

    num_bits: Literal[8, 4] = 8
    """Bits per weight: 8 (one code a byte) or 4 (two a byte)."""
    group_size: PosInt = 64
    """Consecutive elements along ``group_dim`` that share one scale (and minimum)."""
    group_dim: NonNegInt = 1
    """The dimension the groups run along: 1 = the input features of a Linear weight (out, in)."""
    symmetric: bool = False
    """False: each group's codes span its minimum to its maximum (DeepSpeed's and FlexGen's form);
    True: zero-centred codes, a scale and no minimum."""


class WeightQuantizationConfig(Section):
    """``weight_quantization``: ZeRO-Inference's weight quantization (DeepSpeed's section). Only for
    an inference engine (``initialize`` without an optimizer) at stage 3. DeepSpeed's per-layer
    ``post_init_quant`` form is not read (an unknown key): ``quantized_initialization`` covers every
    weight matrix."""

    section_path: ClassVar[str] = "weight_quantization"
    sections: ClassVar[dict[str, type[Section]]] = {"quantized_initialization": QuantizedInitConfig}

    quantized_initialization: QuantizedInitConfig | None = None
    """Quantize the weights as they are loaded (DeepSpeed's quantized initialization)."""


class ZeroShardExtConfig(Section):
    """The ``zeroshard`` section: our extensions, not part of DeepSpeed's schema."""

    section_path: ClassVar[str] = "zeroshard"

    comm_timeout_s: PosFloat = 300.0
    """Seconds a collective may take before the process group reports a hang."""
    check_collectives: bool = False
    """Debugging: before each collective every rank exchanges a small tag naming it, so ranks whose
    code paths diverged (another unit order, a skipped backward) fail at once with every rank's
    description, instead of at comm_timeout_s or by exchanging the wrong tensors of equal size. It
    costs one more small all-gather per collective and, on a GPU, a host sync at each wait. Off,
    diverged ranks still fail together: each step compares a fingerprint of every rank's collectives
    inside the gradient-norm all-reduce it runs anyway ([Note: collective fingerprint] in
    core/consistency.py)."""
    overlap_param_gather: bool = True
    """Stages 1/2: step() only issues the all-gather of updated parameters, and each unit waits for
    its own just before its next forward (Megatron's overlap_param_gather), hiding it behind
    compute. zeroshard's own readers (state_dict, checkpoints, GatheredParameters,
    module.state_dict()) wait first; a script that reads parameter values between step() and the
    next forward (an EMA update) calls engine.wait_parameters() first ([Note: reads before the next
    forward] in core/param_gather.py). False: step() waits for the gathers."""
    transactional_step: Literal["fail_stop", "copy"] = "fail_stop"
    """What a step that raises half-way through its update leaves. "fail_stop": no copy is taken;
    training refuses to go on until a checkpoint is loaded (a step that raises before its update
    changes nothing either way). "copy": masters and optimizer state are copied before the update
    (12 bytes an element with Adam, while the step runs) and put back if it raises, so training can
    go on after zero_grad() ([Note: failed optimizer steps] in core/optim/rollback.py)."""
    wrap_modules: list[str] | None = None
    """Module class names that become sharding units; None = each block of the model's largest
    ``nn.ModuleList``, an untied LM head of at least half a block's size (so its gradient is reduced
    while backward goes on), plus the root."""
    generate_gather: Literal["units", "whole"] = "units"
    """How ``engine.generate()`` gathers a stage-3 model. "units": each unit for each forward and freed
    after it, the least memory, one all-gather per unit per token (``synced_gpus`` then keeps the
    ranks' forwards in step). "whole": the whole model once per ``generate()`` call, freed when it
    returns: no collective per token, and the whole model on every rank meanwhile (TRL's
    ``ds3_gather_for_generation``; ``ZeroShardTrainer`` takes it from there)."""
    nvme_io: Literal["direct", "buffered", "mapped"] | None = None
    """How the NVMe store reads and writes the tensors it is told of ahead of time (the optimizer's
    sub-group stream, ZeRO-Inference's weights): "direct" (aligned O_DIRECT requests into buffers,
    past the page cache; a file system that refuses it falls back to buffered), "buffered" (the
    same requests through the page cache) or "mapped" (the swap files' memory mapping and its
    read-ahead). None: "mapped" for training, "direct" for inference (measured in
    docs/offload_nvme.md and docs/inference.md); offload/blockio.py."""
    activation_checkpointing_units: bool = False
    """Checkpoint the activations of every unit but the root (see zeroshard.checkpointing), without
    editing the model; the ``activation_checkpointing`` section's options apply to them."""
    async_checkpoint: bool = False
    """engine.save_checkpoint() returns once each rank's shards are copied to host memory; a thread
    writes and publishes the files while training goes on (the call's ``async_save`` argument
    overrides this). The next save, load_checkpoint(), wait_checkpoint() and destroy() wait for it
    and raise its error ([Note: asynchronous save] in checkpoint/background.py). Costs a host copy of
    the rank's shards while it writes."""
    snapshot_every_steps: NonNegInt | Literal["auto"] = 0
    """Every this many optimizer steps, engine.step() writes a snapshot of every rank's model states
    into host memory on its own machine and on a buddy machine ([Note: snapshots on a buddy] in
    checkpoint/snapshot.py), from which engine.recover() resumes after a machine is lost, without
    the disk. Costs host memory for a copy of the rank's states and its buddy's, and the time to
    serialise, send and write them at each snapshot step. 0: no snapshots. "auto": as often as
    ``snapshot_overhead`` allows, measured while training ([Note: snapshot pace] in
    checkpoint/pace.py)."""
    snapshot_overhead: OpenFraction = 0.03
    """With ``snapshot_every_steps: "auto"``: the share of training time snapshots may take. The
    engine times its steps with and without a snapshot beside them and snapshots every k steps, the
    smallest k within this share (``engine.snapshot_every`` says which)."""
    snapshot_dir: str | None = None
    """This machine's snapshot directory; None: /dev/shm/zeroshard/<torchelastic run id>, a tmpfs
    whose files outlive the workers torchrun restarts."""
    packed_matmul: bool = False
    """ZeRO-Inference with 4-bit weights (``weight_quantization.quantized_initialization.num_bits``
    4) on one rank: each ``nn.Linear`` whose weight is its own multiplies by it as stored, packed,
    through torch's int4 CPU kernel, and each ``nn.Embedding`` dequantizes only the rows it looks
    up, instead of dequantizing the whole matrix to fp32 first. Activations go through bf16 in those
    matmuls, so tokens are close to, not equal to, the dequantized model's ([Note: packed matmuls]
    in inference/packed.py). A 4-bit resident draft (inference/speculative.py) does this by default."""
