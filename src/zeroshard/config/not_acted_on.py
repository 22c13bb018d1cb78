"""[Note: keys accepted but not acted on] — the one table of them.

A DeepSpeed config key that zeroshard accepts but that changes nothing here is reported once, by
name, with a `ConfigKeyNotActedOnWarning` (DESIGN.md: nothing is silently ignored). Every such key is
in `TABLE` and nowhere else; the parser reads it, and `tests/test_config_table.py` walks the schema
to prove that every field is either read by the code or listed here.

A rule is either
  * unparsed — a DeepSpeed key we do not validate at all (monitoring, autotuning, ...): any value is
    accepted and reported when present; or
  * parsed — a field of our schema, validated, reported when the user set it and `when(config)`
    holds (a condition on the parsed config: `sub_group_size` only matters with offload).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    why: str
    parsed: bool = True  # a validated field of the schema; False = accepted without validation
    when: Callable[[Any], bool] | None = None  # parsed rules: report only when this holds


def _unparsed(why: str, *keys: str) -> dict[str, Rule]:
    return {key: Rule(why, parsed=False) for key in keys}


def _parsed(why: str, *keys: str, when=None) -> dict[str, Rule]:
    return {key: Rule(why, when=when) for key in keys}


def _no_optimizer_offload(cfg) -> bool:
    opt = cfg.zero_optimization.offload_optimizer
    return opt is None or opt.device == "none"


def _optimizer_offload(cfg) -> bool:
    return not _no_optimizer_offload(cfg)


def _param_offload(cfg) -> bool:
    par = cfg.zero_optimization.offload_param
    return par is not None and par.device != "none"


TABLE: dict[str, Rule] = {
    **_unparsed(
        "monitoring, profiling and launch features of DeepSpeed's runtime; zeroshard logs through "
        "python logging and has no launcher",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "flops_profiler",
        "memory_breakdown",
        "monitor_config",
        "autotuning",
        "nebula",
        "elasticity",
        "use_node_local_storage",
    ),
    **_unparsed(
        "DeepSpeed training features outside ZeRO (compression, curriculum, sparse attention, pipeline engine, ...)",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "sparse_gradients",
        "amp",
        "data_efficiency",
        "compression_training",
        "checkpoint",
        "data_types",
        "seed",
        "disable_allgather",
        "sparse_attention",
        "pipeline",
        "quantize_training",
        "eigenvalue",
        "progressive_layer_drop",
        "curriculum_learning",
        "dataloader_drop_last",
        "load_universal_checkpoint",
        "hybrid_engine",
        "graph_harvesting",
        "train_epochs",
        "compile",
    ),
    **_unparsed(
        "DeepSpeed's fused-kernel switch; config-built Adam uses torch's fused kernel anyway", "optimizer.legacy_fusion"
    ),
    **_parsed(
        "DeepSpeed's Newton-Schulz variant for Muon; zeroshard builds torch.optim.Muon, which runs the quintic "
        "iteration of Keller Jordan's Muon",
        "optimizer.params.ns_method",
    ),
    **_parsed(
        "DeepSpeed's per-head Muon for fused attention projections; zeroshard's Muon (torch.optim.Muon) "
        "orthogonalises each matrix whole",
        "optimizer.params.per_head_muon",
    ),
    **_unparsed(
        "DeepSpeed's fp16 master-weight layout; masters are always fp32 shards here",
        "fp16.fp16_master_weights_and_grads",
    ),
    **_unparsed(
        "DeepSpeed's bf16 optimizer switches; overflow is never checked in bf16 here",
        "bf16.immediate_grad_update",
        "bf16.check_grad_overflow",
    ),
    **_unparsed(
        "DeepSpeed runtime switches with no counterpart (elastic checkpoints; ZeRO++'s int8 storage of "
        "frozen weights and LoCo error feedback; MiCS's two-hop gather, here one all-gather in the shard "
        "group; module-granularity tuning)",
        *(
            f"zero_optimization.{key}"
            for key in (
                "elastic_checkpoint",
                "ignore_unused_parameters",
                "legacy_stage1",
                "load_from_fp32_weights",
                "zero_quantized_nontrainable_weights",
                "zeropp_loco_param",
                "mics_hierarchical_params_gather",
                "use_multi_rank_bucket_allreduce",
                "memory_efficient_linear",
                "stage3_module_granularity_threshold",
                "stage3_model_persistence_threshold",
                "stage3_use_all_reduce_for_fetch_params",
                "pipeline_loading_checkpoint",
                "override_module_apply",
                "log_trace_cache_warnings",
            )
        ),
    ),
    **_unparsed(
        "DeepSpeed 0.19 runtime switches with no counterpart (the gradient norm is always computed: the "
        "collective fingerprint rides on its all-reduce; ZenFlow and SuperOffload are DeepSpeed's own "
        "offload schedulers; Muon's momentum placement, sanity checks, parameter alignment and sequential "
        "all-gathers are DeepSpeed engine internals)",
        *(
            f"zero_optimization.{key}"
            for key in (
                "compute_grad_norm",
                "enable_sanity_checks",
                "parameter_alignment",
                "stage3_allgather_sequential",
                "save_muon_momentum_buffer_in_memory",
                "zenflow",
                "offload_optimizer.super_offload",
                "offload_optimizer.cpuadam_cores_perc",
            )
        ),
    ),
    **_unparsed(
        "pipelined swap of DeepSpeed's NVMe engine; the NVMe store overlaps reads and writes itself",
        "zero_optimization.offload_optimizer.pipeline_read",
        "zero_optimization.offload_optimizer.pipeline_write",
    ),
    **_unparsed("GPUDirect storage is not used", "aio.use_gds"),
    # -- parsed fields ---------------------------------------------------------------------------------
    **_parsed(
        "gradients are pre-divided by the world size before the reduction, as DDP does",
        "prescale_gradients",
        "gradient_predivide_factor",
    ),
    # Units are the communication granularity (one collective per flat group), so bucket sizes and
    # DeepSpeed's buffer-layout switches have nothing to act on.
    **_parsed(
        "a unit (a block's flat groups) is the bucket of every collective",
        *(
            f"zero_optimization.{key}"
            for key in (
                "reduce_bucket_size",
                "allgather_bucket_size",
                "contiguous_gradients",
                "reduce_scatter",
                "allgather_partitions",
                "round_robin_gradients",
            )
        ),
    ),
    **_parsed(
        "optimizer states follow the master weights' dtype (torch's optimizers make them like the tensor "
        "they step): bf16 with bf16.bf16_master_weights_and_grads in bf16 training, fp32 otherwise",
        "bf16.bf16_optimizer_states",
        when=lambda cfg: (
            cfg.bf16.bf16_optimizer_states != (cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads)
        ),
    ),
    **_parsed(
        "bf16 master weights act in bf16 training only (bf16.enabled)",
        "bf16.bf16_master_weights_and_grads",
        when=lambda cfg: cfg.bf16.bf16_master_weights_and_grads and not cfg.bf16.enabled,
    ),
    **_parsed(
        "autocast covers every op torch autocasts; gradients are reduced in the reduce dtype",
        "torch_autocast.lower_precision_safe_modules",
    ),
    **_parsed(
        "offload_param acts only at stage 3; DeepSpeed ignores it below, and so does zeroshard",
        "zero_optimization.offload_param",
        when=lambda cfg: _param_offload(cfg) and cfg.zero_optimization.stage < 3,
    ),
    **_parsed(
        "offload_optimizer acts only at stages 1-3; DeepSpeed ignores it at stage 0, and so does zeroshard",
        "zero_optimization.offload_optimizer",
        when=lambda cfg: _optimizer_offload(cfg) and cfg.zero_optimization.stage == 0,
    ),
    **_parsed(
        "ZeRO++ (hpZ, qwZ, qgZ) and MiCS act at stage 3 only; DeepSpeed ignores them below, and so does zeroshard",
        *(
            f"zero_optimization.{key}"
            for key in (
                "zero_hpz_partition_size",
                "zero_quantized_weights",
                "zero_quantized_gradients",
                "mics_shard_size",
            )
        ),
        when=lambda cfg: cfg.zero_optimization.stage < 3,
    ),
    **_parsed(
        "only the streamed (offloaded) optimizer step cuts shards into sub-groups",
        "zero_optimization.sub_group_size",
        when=_no_optimizer_offload,
    ),
    # The stores size themselves (offload/store.py): DeepSpeed's swap-buffer pools have no equivalent,
    # and everything the user chose to offload is offloaded (no partial ratio).
    **_parsed(
        "the offload stores size themselves; everything chosen is offloaded",
        *(f"zero_optimization.offload_optimizer.{key}" for key in ("buffer_count", "ratio", "fast_init")),
        when=_optimizer_offload,
    ),
    **_parsed(
        "the offload stores size themselves; everything chosen is offloaded",
        *(f"zero_optimization.offload_param.{key}" for key in ("buffer_count", "buffer_size")),
        when=_param_offload,
    ),
    # Acted on with NVMe offload (offload/split.py): the first max_in_cpu elements stay in CPU memory.
    **_parsed(
        "max_in_cpu acts with device 'nvme'; with device 'cpu' every parameter shard is in CPU memory",
        "zero_optimization.offload_param.max_in_cpu",
        when=lambda cfg: _param_offload(cfg) and cfg.zero_optimization.offload_param.device == "cpu",
    ),
    # [Note: aligned direct I/O] in offload/blockio.py: the store's own aligned requests have a
    # measured size and depth (4 MiB, eight in flight) and the mapping's I/O is the kernel's, so
    # DeepSpeed's libaio request knobs have nothing to set. `aio.thread_count` is acted on
    # (threads of the write-back pool).
    **_parsed(
        "the NVMe store sizes its own aligned requests (4 MiB, eight in flight) and the kernel the mapping's",
        *(f"aio.{key}" for key in ("block_size", "queue_depth", "single_submit", "overlap_events")),
    ),
}


def unparsed_keys(section_path: str) -> frozenset[str]:
    """Keys of the section at `section_path` that are accepted without validation."""
    prefix = f"{section_path}." if section_path else ""
    return frozenset(
        path[len(prefix) :]
        for path, rule in TABLE.items()
        if not rule.parsed and path.startswith(prefix) and "." not in path[len(prefix) :]
    )


def set_keys(cfg) -> list[str]:
    """Dotted paths of every field the user set, sections included, in schema order."""
    out = []

    def walk(section, path: str) -> None:
        for name in type(section).model_fields:
            if name not in section.model_fields_set:
                continue
            value = getattr(section, name)
            key = f"{path}.{name}" if path else name
            out.append(key)
            if hasattr(value, "model_fields_set"):
                walk(value, key)

    walk(cfg, "")
    return out


def reported_keys(cfg) -> list[str]:
    """The parsed keys of `cfg` that zeroshard does not act on, given the rest of the config."""
    return [
        key
        for key in set_keys(cfg)
        if (rule := TABLE.get(key)) is not None and rule.parsed and (rule.when is None or rule.when(cfg))
    ]
