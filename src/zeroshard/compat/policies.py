"""A parsed DeepSpeed config as the core's policies: the one place where config keys become the
core's own terms, and the core's errors about those policies go back to naming the keys."""

from __future__ import annotations

import contextlib
import re

import torch

from zeroshard.config.schema import ZeroConfig
from zeroshard.core.policy import CommunicationPolicy, GatheringPolicy, PrecisionPolicy
from zeroshard.core.precision import DynamicLossScaler

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# The core's names of policy fields, as the config spells them (in_config_terms).
CONFIG_NAMES = {
    "CommunicationPolicy.shard_size": "zero_optimization.mics_shard_size",
    "CommunicationPolicy.secondary_size": "zero_optimization.zero_hpz_partition_size",
    "CommunicationPolicy.quantize_weights": "zero_optimization.zero_quantized_weights",
    "CommunicationPolicy.quantize_gradients": "zero_optimization.zero_quantized_gradients",
    "GatheringPolicy.wrap": "zeroshard.wrap_modules",
    "GatheringPolicy.persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "GatheringPolicy.prefetch_numel": "zero_optimization.stage3_prefetch_bucket_size",
    "GatheringPolicy.max_live_numel": "zero_optimization.stage3_max_live_parameters",
    "GatheringPolicy.reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    'on_failed_update="copy"': 'zeroshard.transactional_step: "copy"',
    "CommunicationPolicy(check_collectives=True)": "zeroshard.check_collectives: true",
    # zeroshard.inference.shard's arguments (compat/inference.py)
    "shard(packed_matmul=True)": "zeroshard.packed_matmul: true",
    "shard(quantize=...)": "weight_quantization.quantized_initialization",
    "shard(stage=3)": "zero_optimization.stage 3",
}
_NAMES = re.compile("|".join(re.escape(name) for name in sorted(CONFIG_NAMES, key=len, reverse=True)))


def precision_policy(config) -> PrecisionPolicy:
    param = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else torch.float32
    reduce = DTYPES[config.communication_data_type] if config.communication_data_type else param
    master = torch.bfloat16 if config.bf16.enabled and config.bf16.bf16_master_weights_and_grads else torch.float32
    return PrecisionPolicy(param, reduce, master)


def loss_scaler(config) -> DynamicLossScaler | None:
    """The `fp16` section's loss scaler; None without fp16."""
    fp16 = config.fp16
    if not fp16.enabled:
        return None
    dynamic = fp16.loss_scale == 0
    return DynamicLossScaler(
        initial_scale=2.0**fp16.initial_scale_power if dynamic else fp16.loss_scale,
        window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        dynamic=dynamic,
    )


def gather_policy(zero: ZeroConfig, extras) -> GatheringPolicy:
    live = zero.stage3_max_live_parameters
    return GatheringPolicy(
        wrap=tuple(extras.wrap_modules) if extras.wrap_modules else None,
        persistence_threshold=int(zero.stage3_param_persistence_threshold),
        prefetch_numel=int(zero.stage3_prefetch_bucket_size),
        max_live_numel=None if live is None else int(live),
        reuse_distance=int(zero.stage3_max_reuse_distance),
    )


def communication_policy(zero: ZeroConfig, extras) -> CommunicationPolicy:
    """Timeouts, overlap and the debug check; ZeRO++ and MiCS at stage 3 (below it they are reported
    as not acted on, as DeepSpeed ignores them). hpZ sizes 0 and 1 mean off, as in DeepSpeed."""
    common = {
        "timeout_s": extras.comm_timeout_s,
        "check_collectives": extras.check_collectives,
        "overlap_comm": bool(zero.overlap_comm),
        "overlap_param_gather": extras.overlap_param_gather,
    }
    if zero.stage < 3:
        return CommunicationPolicy(**common)
    return CommunicationPolicy(
        **common,
        shard_size=zero.mics_shard_size if zero.mics_shard_size > 0 else None,
        secondary_size=zero.zero_hpz_partition_size if zero.zero_hpz_partition_size > 1 else None,
        quantize_weights=zero.zero_quantized_weights,
        quantize_gradients=zero.zero_quantized_gradients,
    )


def in_config_terms(error: BaseException) -> str:
    """`error`'s message with the core's policy names replaced by the config keys they come from."""
    return _NAMES.sub(lambda match: CONFIG_NAMES[match.group(0)], str(error))


@contextlib.contextmanager
def config_terms():
    """A ValueError the core raises about a policy is raised again naming the config's keys."""
    try:
        yield
    except ValueError as error:
        renamed = in_config_terms(error)
        if renamed == str(error):
            raise
        raise ValueError(renamed) from error
