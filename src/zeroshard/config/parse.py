"""Parse a DeepSpeed JSON config once, at the edge, into a typed ``ZeroShardConfig``.

``load_config(config, world_size)`` takes a dict, a path to a ``.json`` file, or None and returns a frozen
``ZeroShardConfig``; components receive their own section (``cfg.zero_optimization``, ``cfg.optimizer``,
...). The section models and their defaults are in ``zeroshard.config.schema``.

Nothing is silently ignored:

- a key nobody knows (a typo) is a ``ConfigError`` naming its path and the closest valid key;
- a bad value is a ``ConfigError`` naming the key path, the value and what is allowed;
- a key DeepSpeed knows but zeroshard does not act on is accepted with one
  ``ConfigKeyNotActedOnWarning`` naming it; all such keys are in one table, ``not_acted_on.TABLE``;
- ``"auto"`` (written by the Hugging Face Trainer) means "not given" for the keys listed in
  [Note: "auto" values] in ``base``.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import AliasChoices, Field, ValidationError, model_validator

from zeroshard.config.not_acted_on import reported_keys, unparsed_keys
from zeroshard.config.schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    FP16Config,
    NonNegFloat,
    OptimizerConfig,
    PosFloat,
    PosInt,
    SchedulerConfig,
    Section,
    TorchAutocastConfig,
    WeightQuantizationConfig,
    ZeroConfig,
    ZeroShardExtConfig,
    canonical_name,
)

__all__ = [
    "ConfigError",
    "ConfigKeyNotActedOnWarning",
    "ZeroShardConfig",
    "load_config",
    "read_config",
    "warn_not_acted_on",
]


class ConfigError(ValueError):
    """A config that zeroshard cannot run: unknown key, bad value, unreadable file."""


class ConfigKeyNotActedOnWarning(UserWarning):
    """A config key that zeroshard accepts (DeepSpeed knows it) but does not act on."""


# --- the whole config ----------------------------------------------------------------------------


class ZeroShardConfig(Section):
    """A parsed DeepSpeed JSON config. Build it with ``zeroshard.config.load_config``; components
    receive their own section (``cfg.zero_optimization``, ``cfg.optimizer``, ...)."""

    section_path: ClassVar[str] = ""
    auto_keys: ClassVar[frozenset[str]] = frozenset(
        {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"}
    )
    # Internal fields, set by load_config, never read from the JSON.
    internal_keys: ClassVar[frozenset[str]] = frozenset({"world_size"})
    sections: ClassVar[dict[str, type[Section]]] = {
        "optimizer": OptimizerConfig,
        "scheduler": SchedulerConfig,
        "fp16": FP16Config,
        "bf16": BF16Config,
        "bfloat16": BF16Config,
        "zero_optimization": ZeroConfig,
        "aio": AioConfig,
        "activation_checkpointing": ActivationCheckpointingConfig,
        "zeroshard": ZeroShardExtConfig,
        "torch_autocast": TorchAutocastConfig,
        "weight_quantization": WeightQuantizationConfig,
    }

    world_size: PosInt
    """Data-parallel ranks the batch sizes were resolved for (not a JSON key)."""
    train_batch_size: PosInt
    """Samples per optimizer step over all ranks = micro batch * accumulation steps * world size."""
    train_micro_batch_size_per_gpu: PosInt
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: PosInt
    """Micro batches accumulated before each optimizer step."""
    sequence_parallel_size: PosInt = 1
    """Ranks that each hold a shard of every sequence (Ulysses sequence parallelism, DeepSpeed's ALST):
    ZeRO partitions over data-parallel x sequence-parallel ranks, and batch sizes count the
    data-parallel ones, world size / sequence_parallel_size. Its groups are those of the mpu or mesh
    given to initialize (``UlyssesSPAttentionHF.register_with_transformers`` returns one), which must
    agree; without one, initialize builds them from consecutive ranks. A transformers model's
    attention is wired to them by initialize (compat/ulysses_sp.py)."""
    gradient_clipping: NonNegFloat = 1.0
    """Clip the global gradient norm to this value; 0 = off. DeepSpeed 0.19.8's default is 1.0
    (``GRADIENT_CLIPPING_DEFAULT`` in deepspeed/runtime/constants.py): a config without the key clips.
    The norm is the L2 norm over every rank's shards, accumulated in fp64, with DeepSpeed's 1e-6
    epsilon; ``get_global_grad_norm()`` returns it before clipping."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """Dtype gradients are accumulated and reduced in; None = the compute dtype (as DeepSpeed)."""
    prescale_gradients: bool = False
    """DeepSpeed: divide gradients before rather than after the reduction (accepted, not acted on)."""
    gradient_predivide_factor: PosFloat = 1.0
    """DeepSpeed: factor divided out before the reduction (accepted, not acted on)."""
    optimizer: OptimizerConfig | None = None
    """Optimizer built by the engine, with DeepSpeed's semantics and torch's fused kernel (like
    FusedAdam); None = the client passes one (any elementwise ``torch.optim`` class)."""
    scheduler: SchedulerConfig | None = None
    """Lr schedule built by the engine with DeepSpeed's formulas, stepped after each applied optimizer
    step; None = none, or the client passes one."""
    fp16: FP16Config = FP16Config()
    """fp16 mixed precision."""
    bf16: BF16Config = Field(BF16Config(), validation_alias=AliasChoices("bf16", "bfloat16"))
    """bf16 mixed precision (JSON key ``bf16`` or ``bfloat16``)."""
    zero_optimization: ZeroConfig = ZeroConfig()
    """ZeRO stage and its communication / offload settings."""
    aio: AioConfig = AioConfig()
    """Asynchronous I/O for the NVMe store."""
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    """Activation checkpointing options."""
    zeroshard: ZeroShardExtConfig = ZeroShardExtConfig()
    """zeroshard's own extensions."""
    torch_autocast: TorchAutocastConfig = TorchAutocastConfig()
    """torch.autocast around the forward."""
    weight_quantization: WeightQuantizationConfig = WeightQuantizationConfig()
    """ZeRO-Inference's weight quantization (inference engines at stage 3)."""

    @model_validator(mode="after")
    def _one_half_precision(self) -> ZeroShardConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        return self


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Keys whose usual mistake deserves more than "did you mean".
_HINTS = {"max_grad_norm": "use the top-level key 'gradient_clipping' instead"}
_AUTO_HINT = ' ("auto" is only filled in by the Hugging Face Trainer; give a value)'


def load_config(
    config: Mapping[str, Any] | str | os.PathLike | ZeroShardConfig | None, world_size: int
) -> ZeroShardConfig:
    """Parse ``config`` (dict, path to a JSON file, or None for all defaults) for ``world_size`` ranks.

    Batch sizes are resolved as DeepSpeed does, train_batch_size = micro * accumulation * world_size:
    any two given derive the third; only train_batch_size gives accumulation 1; only the micro batch
    gives accumulation 1; only the accumulation steps, or nothing, gives micro batch 1.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(config, ZeroShardConfig):
        if config.world_size != world_size:
            raise ConfigError(f"config was resolved for world_size={config.world_size}, not {world_size}")
        return config
    raw = read_config(config)
    given = {k: raw[k] for k in _BATCH_KEYS if k in raw and not _is_auto(raw[k])}
    body = {k: v for k, v in raw.items() if k not in _BATCH_KEYS}
    batch = _resolve_batch_sizes(given, world_size)
    cfg = _parse_section(ZeroShardConfig, body, extra={"world_size": world_size, **batch})
    for key in reported_keys(cfg):  # see [Note: keys accepted but not acted on]
        _warn_key(key)
    return cfg


def warn_not_acted_on(section: Section, *keys: str) -> None:
    """Warn once per key in ``keys`` that the user set in ``section`` but the caller does not act on.

    For components that accept a key without implementing it (e.g. the engine and
    ``reduce_bucket_size``). Keys left at their default are not reported.
    """
    for key in keys:
        if key not in type(section).model_fields:
            raise ValueError(f"{type(section).__name__} has no field {key!r}")
        if key in section.model_fields_set:
            _warn_key(_join(section.section_path, key))


# --- reading --------------------------------------------------------------------------------------


def read_config(config: Any) -> dict[str, Any]:
    """The raw DeepSpeed config as a dict (a copy), from a dict, a path to a JSON file, or None; a
    file that cannot be read, is not JSON or holds no object is a ConfigError naming it. Every reader
    of a config (engine, integrations, CLI) comes through here; `load_config` then validates."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        return _read_json_file(Path(config))
    raise ConfigError(f"config must be a dict, a path to a JSON file, or None; got {type(config).__name__}")


def _read_json_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file '{path}': {err}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file '{path}' must hold a JSON object, got {type(raw).__name__}")
    return raw


# --- batch sizes ----------------------------------------------------------------------------------


def _batch_int(key: str, value: Any) -> int:
    # JSON may spell an integer as 32.0; anything else (bool, string, 2.5, <= 0) is an error.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"invalid value {value!r} for '{key}': expected a positive integer")
    return value


def _resolve_batch_sizes(given: dict[str, Any], ws: int) -> dict[str, int]:
    tb, mb, gas = (_batch_int(k, given[k]) if k in given else None for k in _BATCH_KEYS)
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * ws:
            raise ConfigError(
                f"train_batch_size={tb} != train_micro_batch_size_per_gpu={mb} * "
                f"gradient_accumulation_steps={gas} * world_size={ws} (={mb * gas * ws})"
            )
    elif tb is not None and mb is not None:
        gas = _exact_div(
            tb, mb * ws, f"train_micro_batch_size_per_gpu={mb} * world_size={ws}", "gradient_accumulation_steps"
        )
    elif tb is not None:
        gas = gas or 1
        mb = _exact_div(
            tb, gas * ws, f"gradient_accumulation_steps={gas} * world_size={ws}", "train_micro_batch_size_per_gpu"
        )
    else:
        mb, gas = mb or 1, gas or 1
        tb = mb * gas * ws
    return dict(zip(_BATCH_KEYS, (tb, mb, gas)))


def _exact_div(tb: int, divisor: int, divisor_text: str, derived: str) -> int:
    if tb % divisor:
        raise ConfigError(
            f"train_batch_size={tb} is not divisible by {divisor_text} (={divisor}); "
            f"cannot derive {derived} (would be {tb / divisor:g})"
        )
    return tb // divisor


# --- sections -------------------------------------------------------------------------------------


_S = TypeVar("_S", bound=Section)


def _parse_section(model: type[_S], raw: Any, extra: dict[str, Any] | None = None) -> _S:
    """Check the keys of ``raw`` against ``model``, parse nested sections, then validate."""
    path = model.section_path
    if model is ZeroConfig:
        raw = _translate_legacy_zero(raw)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"'{path}' must be a JSON object, got {type(raw).__name__} {raw!r}")
    data, autos = _checked_keys(model, raw)
    for key, child in model.sections.items():
        if data.get(key) is not None:
            data[key] = _parse_section(child, data[key])
    if hasattr(model, "params_by_type"):
        _parse_typed_params(model, data)
    data.update(extra or {})
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _config_error(err, path, autos) from None


def _checked_keys(model: type[Section], raw: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Drop "auto" and ignored keys (warning for the latter); reject unknown keys."""
    accepted, alias_groups = _accepted_keys(model)
    data: dict[str, Any] = {}
    autos: set[str] = set()
    for key, value in raw.items():
        key = str(key)
        key_path = _join(model.section_path, key)
        if _is_auto(value) and key in model.auto_keys:
            autos.add(key)
        elif key in unparsed_keys(model.section_path):  # see [Note: keys accepted but not acted on]
            _warn_key(key_path)
        elif key in accepted:
            data[key] = value
        else:
            raise _unknown_key(model, key, accepted)
    for group in alias_groups:
        if len(present := [k for k in group if k in data]) > 1:
            raise ConfigError(
                f"'{_join(model.section_path, present[0])}' and "
                f"'{_join(model.section_path, present[1])}' are the same key; give one"
            )
    return data, autos


def _accepted_keys(model: type[Section]) -> tuple[set[str], list[tuple[str, ...]]]:
    accepted: set[str] = set()
    groups: list[tuple[str, ...]] = []
    internal: frozenset[str] = getattr(model, "internal_keys", frozenset())
    for name, field in model.model_fields.items():
        alias = field.validation_alias
        names = tuple(alias.choices) if isinstance(alias, AliasChoices) else (name,)
        if name not in internal:
            accepted.update(str(n) for n in names)
            groups += [tuple(str(n) for n in names)] if len(names) > 1 else []
    return accepted, groups


def _unknown_key(model: type[Section], key: str, accepted: set[str]) -> ConfigError:
    path = model.section_path
    message = f"unknown config key '{_join(path, key)}'"
    if key in _HINTS:
        return ConfigError(f"{message}: {_HINTS[key]}")
    close = difflib.get_close_matches(key, sorted(accepted | unparsed_keys(path)), n=1, cutoff=0.6)
    if close:
        return ConfigError(f"{message}; did you mean '{_join(path, close[0])}'?")
    where = f"in '{path}'" if path else "at the top level"
    return ConfigError(f"{message}; valid keys {where}: {', '.join(sorted(accepted))}")


def _parse_typed_params(model: type[Section], data: dict[str, Any]) -> None:
    """``optimizer`` / ``scheduler``: the valid ``params`` keys depend on ``type``."""
    path = model.section_path
    kinds: dict[str, type[Section]] = model.params_by_type  # type: ignore[attr-defined]
    if "type" not in data:
        raise ConfigError(f"'{path}.type' is required; allowed: {', '.join(kinds)}")
    try:
        data["type"] = canonical_name(data["type"], tuple(kinds), f"{path}.type")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    params = data.get("params")
    data["params"] = _parse_section(kinds[data["type"]], {} if params is None else params)


def _translate_legacy_zero(raw: Any) -> Any:
    """DeepSpeed's deprecated spellings: ``"zero_optimization": true`` and ``cpu_offload*`` flags."""
    if isinstance(raw, bool):
        _warn_deprecated("zero_optimization: true/false", '"zero_optimization": {"stage": N}')
        return {"stage": int(raw)}
    if not isinstance(raw, Mapping) or not (ZeroConfig.legacy_offload_keys & raw.keys()):
        return raw
    raw = dict(raw)
    pin = raw.pop("cpu_offload_use_pin_memory", None)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in raw:
            _warn_deprecated(f"zero_optimization.{old}", f"zero_optimization.{new}")
            if raw.pop(old) and new not in raw:
                raw[new] = {"device": "cpu", **({"pin_memory": pin} if pin is not None else {})}
    return raw


def _config_error(err: ValidationError, path: str, autos: set[str]) -> ConfigError:
    messages = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(part) for part in e["loc"])
        key_path = _join(path, loc)
        if e["type"] == "missing" and isinstance(e["loc"][-1], int):
            messages.append(f"'{key_path.rpartition('.')[0]}' needs an item at index {e['loc'][-1]}")
        elif e["type"] == "missing":
            hint = _AUTO_HINT if loc in autos else ""
            messages.append(f"'{key_path}' is required{hint}")
        elif e["type"] == "value_error" and not loc:
            messages.append(f"invalid {repr(path) if path else 'config'}: {e['ctx']['error']}")
        else:
            reason = e["ctx"]["error"] if e["type"] == "value_error" else e["msg"]
            messages.append(f"invalid value {e['input']!r} for '{key_path}': {reason}")
    return ConfigError("; ".join(messages))


# --- small helpers --------------------------------------------------------------------------------


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and key else path or key


def _warn_key(key_path: str) -> None:
    # Attributed to the user's call site; the default warnings filter then shows a message once per
    # call site, so a script that loads its config once sees each key once.
    warnings.warn(
        f"zeroshard accepts but does not act on config key '{key_path}'",
        ConfigKeyNotActedOnWarning,
        stacklevel=_stacklevel_outside_package(),
    )


def _warn_deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"config key '{old}' is deprecated (DeepSpeed); zeroshard reads it as '{new}'",
        FutureWarning,
        stacklevel=_stacklevel_outside_package(),
    )


def _stacklevel_outside_package() -> int:
    """The ``stacklevel`` (seen from the caller) of the innermost frame outside the zeroshard package."""
    package_dir = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package_dir):
        frame, level = frame.f_back, level + 1
    return level
