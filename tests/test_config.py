"""The DeepSpeed-compatible config layer: defaults, batch sizes, "auto", files, and every error message."""

import json
import warnings

import pytest
from pydantic import BaseModel, ValidationError

from zeroshard.config import (
    ConfigError,
    ConfigKeyNotActedOnWarning,
    ZeroShardConfig,
    load_config,
    schema,
    warn_not_acted_on,
)


def _error(config, world_size=2) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size)
    return str(info.value)


def _not_acted_on_keys(record) -> list[str]:
    return [str(w.message).split("'")[1] for w in record if w.category is ConfigKeyNotActedOnWarning]


# --- defaults -------------------------------------------------------------------------------------


def test_defaults_are_deepspeeds():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty config warns about nothing
        cfg = load_config(None, world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 1, 1)
    # DeepSpeed 0.19.8 clips at 1.0 by default (GRADIENT_CLIPPING_DEFAULT in runtime/constants.py)
    assert cfg.world_size == 4 and cfg.gradient_clipping == 1.0 and cfg.communication_data_type is None
    assert cfg.optimizer is None and cfg.scheduler is None
    z = cfg.zero_optimization
    # overlap_comm is on at every stage (DeepSpeed: stage 3 only); off costs stages 0-2 a step's 8-17%.
    assert z.stage == 0 and z.overlap_comm is True and z.contiguous_gradients and z.reduce_scatter
    assert z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    # Stage 3's gathering bounds are zeroshard's (the next unit prefetched, only the root kept for backward),
    # not DeepSpeed's 5e7 / 1e9 / 1e9, which gather a small model whole ([Note: bounded gathering]).
    assert z.stage3_prefetch_bucket_size == 1 and z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_max_live_parameters is None and z.stage3_max_reuse_distance == 1
    assert z.sub_group_size == 10**9
    assert z.allgather_partitions and not z.round_robin_gradients
    assert not z.stage3_gather_16bit_weights_on_model_save
    assert z.offload_optimizer is None and z.offload_param is None
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power) == (False, False, 0.0, 16)
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.consecutive_hysteresis) == (1000, 2, False)
    assert fp16.min_loss_scale == 1.0 and fp16.dynamic_loss_scale and not cfg.bf16.enabled
    aio = cfg.aio
    assert (aio.block_size, aio.queue_depth, aio.thread_count) == (1048576, 8, 1)
    assert not aio.single_submit and aio.overlap_events
    ac = cfg.activation_checkpointing
    assert (
        not (
            ac.partition_activations
            or ac.cpu_checkpointing
            or ac.contiguous_memory_optimization
            or ac.synchronize_checkpoint_boundary
            or ac.profile
        )
        and ac.number_checkpoints is None
    )
    assert cfg.zeroshard.comm_timeout_s == 300.0 and not cfg.zeroshard.check_collectives
    assert cfg.zeroshard.wrap_modules is None


def test_offload_defaults():
    z = load_config(
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
        1,
    ).zero_optimization
    opt = z.offload_optimizer
    assert (opt.buffer_count, opt.ratio, opt.pin_memory, opt.fast_init, opt.nvme_path) == (4, 1.0, False, False, None)
    assert (z.offload_param.buffer_count, z.offload_param.buffer_size, z.offload_param.max_in_cpu) == (5, 10**8, 10**9)


@pytest.mark.parametrize(
    "stage, given, expected", [(3, None, True), (2, None, True), (3, False, False), (1, False, False), (0, None, True)]
)
def test_overlap_comm_is_on_unless_turned_off(stage, given, expected):
    zero = {"stage": stage} if given is None else {"stage": stage, "overlap_comm": given}
    assert load_config({"zero_optimization": zero}, 1).zero_optimization.overlap_comm is expected


def test_every_field_is_documented():
    sections = [
        m
        for m in vars(schema).values()
        if isinstance(m, type) and issubclass(m, schema.Section) and m is not schema.Section
    ]
    for model in sections + [ZeroShardConfig]:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_config_is_frozen():
    cfg = load_config({"zero_optimization": {"stage": 2}}, 1)
    with pytest.raises(ValidationError):
        cfg.zero_optimization.stage = 3
    with pytest.raises(ValidationError):
        cfg.gradient_clipping = 1.0


def test_large_sizes_written_as_floats_are_accepted():
    z = load_config({"zero_optimization": {"reduce_bucket_size": 5e8, "sub_group_size": 1e9}}, 1).zero_optimization
    assert z.reduce_bucket_size == 500_000_000 and isinstance(z.reduce_bucket_size, int)
    assert "'zero_optimization.sub_group_size'" in _error({"zero_optimization": {"sub_group_size": 1.5}})


def test_aliases():
    cfg = load_config(
        {
            "bfloat16": {"enabled": True},
            "aio": {"intra_op_parallelism": 4},
            "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True},
        },
        1,
    )
    assert cfg.bf16.enabled and cfg.aio.thread_count == 4
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    assert "'bf16' and 'bfloat16' are the same key" in _error({"bf16": {}, "bfloat16": {}})


def test_types_are_case_insensitive_and_stored_canonically():
    cfg = load_config({"optimizer": {"type": "adamw"}, "scheduler": {"type": "warmuplr"}}, 1)
    assert cfg.optimizer.type == "AdamW" and cfg.scheduler.type == "WarmupLR"
    assert isinstance(cfg.optimizer.params, schema.AdamParams)  # missing params = all defaults


def test_legacy_cpu_offload_flags_are_translated():
    with pytest.warns(FutureWarning, match="cpu_offload"):
        z = load_config(
            {"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}}, 1
        ).zero_optimization
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory


def test_already_loaded_config_passes_through():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2}, 2)
    assert load_config(cfg, 2) is cfg
    assert "world_size=2, not 4" in _error(cfg, world_size=4)


# --- batch sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, world, expected",
    [
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            4,
            (32, 4, 2),
        ),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 6}, 3, (18, 6, 1)),
        ({"gradient_accumulation_steps": 4}, 2, (8, 1, 4)),
        ({}, 3, (3, 1, 1)),
        ({"train_batch_size": 32.0, "train_micro_batch_size_per_gpu": "auto"}, 4, (32, 8, 1)),
    ],
)
def test_batch_size_resolution(given, world, expected):
    cfg = load_config(given, world)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected and all(type(v) is int for v in got)


def test_inconsistent_batch_sizes_name_all_numbers_and_world_size():
    message = _error(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=2
    )
    assert message == (
        "train_batch_size=32 != train_micro_batch_size_per_gpu=4 * gradient_accumulation_steps=2 * world_size=2 (=16)"
    )


@pytest.mark.parametrize(
    "given, fragments",
    [
        (
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
            ["train_batch_size=30", "train_micro_batch_size_per_gpu=4", "world_size=2", "gradient_accumulation_steps"],
        ),
        (
            {"train_batch_size": 32, "gradient_accumulation_steps": 3},
            ["train_batch_size=32", "gradient_accumulation_steps=3", "world_size=2", "train_micro_batch_size_per_gpu"],
        ),
        ({"train_batch_size": 31}, ["train_batch_size=31", "world_size=2"]),
        ({"train_batch_size": 0}, ["'train_batch_size'", "positive integer"]),
        ({"gradient_accumulation_steps": 2.5}, ["'gradient_accumulation_steps'", "2.5"]),
        ({"train_micro_batch_size_per_gpu": True}, ["'train_micro_batch_size_per_gpu'"]),
    ],
)
def test_underivable_batch_sizes(given, fragments):
    message = _error(given, world_size=2)
    assert all(f in message for f in fragments), message


def test_bad_world_size():
    assert "world_size" in _error({}, world_size=0)


# --- unknown keys and bad values ------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {"zero_optimisation": {"stage": 2}},
            "unknown config key 'zero_optimisation'; did you mean 'zero_optimization'?",
        ),
        (
            {"zero_optimization": {"stgae": 2}},
            "unknown config key 'zero_optimization.stgae'; did you mean 'zero_optimization.stage'?",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}},
            "unknown config key 'zero_optimization.offload_optimizer.devcie'; "
            "did you mean 'zero_optimization.offload_optimizer.device'?",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"weight_dacay": 0.1}}},
            "unknown config key 'optimizer.params.weight_dacay'; did you mean 'optimizer.params.weight_decay'?",
        ),
        ({"fp16": {"enabeld": True}}, "unknown config key 'fp16.enabeld'; did you mean 'fp16.enabled'?"),
        (
            {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
            "unknown config key 'optimizer.params.max_grad_norm': use the top-level key 'gradient_clipping' instead",
        ),
    ],
)
def test_unknown_key_names_path_and_closest_key(config, expected):
    assert _error(config) == expected


def test_unknown_key_without_close_match_lists_valid_keys():
    message = _error({"aio": {"xyzzy": 1}})
    assert message.startswith("unknown config key 'aio.xyzzy'; valid keys in 'aio': block_size, ")


def test_params_are_validated_per_optimizer_type():
    message = _error({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}})
    assert "unknown config key 'optimizer.params.betas'" in message and "momentum" in message


@pytest.mark.parametrize("stage", [4, -1, "3", 2.5])
def test_bad_stage_names_allowed_stages(stage):
    assert _error({"zero_optimization": {"stage": stage}}) == (
        f"invalid value {stage!r} for 'zero_optimization.stage': Input should be 0, 1, 2 or 3"
    )


@pytest.mark.parametrize(
    "key",
    [
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "sub_group_size",
    ],
)
def test_negative_sizes_name_key_and_value(key):
    assert _error({"zero_optimization": {key: -5}}) == (
        f"invalid value -5 for 'zero_optimization.{key}': Input should be greater than or equal to 0"
    )


@pytest.mark.parametrize(
    "config, fragments",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["fp16.enabled", "bf16.enabled", "both"]),
        ({"optimizer": {"type": "FusedAdam"}}, ["optimizer.type", "'FusedAdam'", "Adam, AdamW, SGD"]),
        ({"optimizer": {"params": {"lr": 0.1}}}, ["'optimizer.type' is required", "Adam, AdamW, SGD"]),
        (
            {"scheduler": {"type": "CosineRestarts", "params": {}}},
            ["'CosineRestarts'", "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"],
        ),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, ["'scheduler.params.total_num_steps' is required"]),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}},
            ["'cubic'", "'scheduler.params.warmup_type'", "'log' or 'linear'"],
        ),
        ({"communication_data_type": "fp8"}, ["'fp8'", "'communication_data_type'", "'fp32', 'fp16' or 'bf16'"]),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            ["'gpu'", "'zero_optimization.offload_optimizer.device'", "'none', 'cpu' or 'nvme'"],
        ),
        (
            {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
            ["bf16_optimizer_states needs bf16_master_weights"],
        ),
        ({"torch_autocast": {"enabled": True, "dtype": "fp8"}}, ["'fp8'", "'torch_autocast.dtype'", "bfloat16"]),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, ["nvme_path is not set"]),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            ["ratio < 1 needs stage 3"],
        ),
        ({"gradient_clipping": -1.0}, ["-1.0", "'gradient_clipping'", "greater than or equal to 0"]),
        ({"gradient_clipping": True}, ["'gradient_clipping'", "boolean"]),
        ({"zeroshard": {"comm_timeout_s": 0}}, ["'zeroshard.comm_timeout_s'", "greater than 0"]),
        ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, ["nesterov", "momentum > 0"]),
        ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, ["'optimizer.params.betas'", "index 1"]),
        ({"fp16": True}, ["'fp16' must be a JSON object"]),
        ({"zero_optimization": {"stage": "auto"}}, ["'auto'", "'zero_optimization.stage'"]),
    ],
)
def test_bad_values_name_key_value_and_allowed(config, fragments):
    message = _error(config)
    assert all(f in message for f in fragments), message


# --- keys accepted but not acted on ---------------------------------------------------------------


def test_known_unused_keys_warn_once_each():
    config = {
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "tensorboard": {"enabled": True},
        "prescale_gradients": False,
        "zero_optimization": {"stage": 2, "elastic_checkpoint": True, "ignore_unused_parameters": True},
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": False},
    }
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = load_config(config, 1)
    assert sorted(_not_acted_on_keys(record)) == sorted(
        [
            "steps_per_print",
            "wall_clock_breakdown",
            "tensorboard",
            "prescale_gradients",
            "zero_optimization.elastic_checkpoint",
            "zero_optimization.ignore_unused_parameters",
            "fp16.fp16_master_weights_and_grads",
        ]
    )
    assert str(record[0].message).startswith("zeroshard accepts but does not act on config key '")
    assert cfg.zero_optimization.stage == 2 and cfg.prescale_gradients is False


def test_a_script_loading_its_config_twice_sees_each_key_once():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        for _ in range(3):
            load_config({"steps_per_print": 10}, 1)
    assert _not_acted_on_keys(record) == ["steps_per_print"]


def test_components_declare_keys_they_do_not_act_on():
    zero = load_config({"zero_optimization": {"reduce_bucket_size": 1000}}, 1).zero_optimization
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warn_not_acted_on(zero, "reduce_bucket_size", "allgather_bucket_size")  # the second is a default
    assert _not_acted_on_keys(record) == ["zero_optimization.reduce_bucket_size"]
    with pytest.raises(ValueError, match="no field 'reduce_bucket_sise'"):
        warn_not_acted_on(zero, "reduce_bucket_sise")


# --- "auto" ---------------------------------------------------------------------------------------


def test_auto_values_mean_not_given():
    hf_config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(hf_config, 2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 1, 1)
    assert cfg.gradient_clipping == 1.0 and not cfg.fp16.enabled and not cfg.bf16.enabled
    assert cfg.optimizer.params == schema.AdamParams()
    assert cfg.scheduler.params == schema.WarmupLRParams()
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert "lr" not in cfg.optimizer.params.model_fields_set  # "auto" is not "set"


def test_auto_for_a_required_key_says_who_fills_it():
    message = _error({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}})
    assert "'scheduler.params.total_num_steps' is required" in message and "Hugging Face" in message


# --- files ----------------------------------------------------------------------------------------


def test_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
                "optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
            }
        )
    )
    for given in (path, str(path)):
        cfg = load_config(given, 2)
        assert cfg.train_batch_size == 8 and cfg.zero_optimization.stage == 2 and cfg.optimizer.params.lr == 3e-4


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"zero_optimization": {"stage": 2,}}')
    message = _error(path)
    assert str(path) in message and "not valid JSON" in message and "line 1" in message


def test_missing_file_names_the_file(tmp_path):
    message = _error(str(tmp_path / "nope.json"))
    assert str(tmp_path / "nope.json") in message and "cannot read" in message


def test_json_that_is_not_an_object_names_the_file(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert _error(path) == f"config file '{path}' must hold a JSON object, got list"


@pytest.mark.parametrize("config", [42, [("stage", 1)], b"{}"])
def test_wrong_config_type(config):
    assert "config must be a dict, a path to a JSON file, or None" in _error(config)


def test_sections_are_pydantic_models():
    cfg = load_config({"zero_optimization": {"stage": 1}}, 1)
    assert isinstance(cfg.zero_optimization, BaseModel)
    assert cfg.model_dump(mode="json")["zero_optimization"]["stage"] == 1


def test_snapshot_pace_keys_take_a_count_or_auto_and_a_share_of_step_time():
    assert load_config({"zeroshard": {"snapshot_every_steps": "auto"}}, 2).zeroshard.snapshot_every_steps == "auto"
    assert load_config({"zeroshard": {"snapshot_every_steps": 4}}, 2).zeroshard.snapshot_overhead == 0.03
    message = _error({"zeroshard": {"snapshot_every_steps": "often"}})
    assert "snapshot_every_steps" in message and "often" in message, message
    message = _error({"zeroshard": {"snapshot_every_steps": "auto", "snapshot_overhead": 1.0}})
    assert "snapshot_overhead" in message and "1.0" in message, message
