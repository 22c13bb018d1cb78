"""Record DeepSpeed's config defaults into src/zeroshard/tools/deepspeed_defaults.py.

Run it in an environment with DeepSpeed installed (never a dependency of zeroshard):

    DS_ACCELERATOR=cpu python scripts/record_deepspeed_defaults.py > src/zeroshard/tools/deepspeed_defaults.py

The defaults are read from DeepSpeed's own config classes and constants, not copied by hand: the pydantic
models of `zero_optimization`, its offload sections, `fp16` and `bf16` (instantiated empty, and at stage 3
where a default depends on the stage), the constants of `aio`, `activation_checkpointing`, `torch_autocast`
and the top-level keys, and the signatures of FusedAdam, torch's SGD and the lr schedules. Keys DeepSpeed
rejects as removed are recorded as removed. The config reference generator
(`python -m zeroshard.tools.config_reference`) reads the committed table; nothing imports DeepSpeed at build
time.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import deepspeed
import torch
from deepspeed.ops.adam.fused_adam import FusedAdam
from deepspeed.runtime import config as ds_config, constants as c, lr_schedules
from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.swap_tensor import constants as aio
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

REMOVED = "removed"  # the value recorded for a key DeepSpeed rejects as removed


def model_defaults(prefix: str, model: Any) -> dict[str, Any]:
    dumped = model.model_dump(by_alias=True)
    return {f"{prefix}.{key}": value for key, value in dumped.items() if not isinstance(value, dict)}


def signature_defaults(prefix: str, fn: Any, skip: tuple[str, ...] = ("self", "params", "optimizer")) -> dict:
    out = {}
    for name, param in inspect.signature(fn).parameters.items():
        if name not in skip and param.default is not inspect.Parameter.empty:
            out[f"{prefix}.{name}"] = param.default
    return out


def zero_defaults() -> dict[str, Any]:
    below, at3 = (
        model_defaults("zero_optimization", DeepSpeedZeroConfig()),
        model_defaults("zero_optimization", DeepSpeedZeroConfig(stage=3)),
    )
    out: dict[str, Any] = {}
    for key, value in below.items():
        if key == "zero_optimization.stage" or value == at3[key]:
            out[key] = value
        else:
            out[key] = {"stage 3": at3[key], "stages 0-2": value}
    out.update(model_defaults("zero_optimization.offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig()))
    out.update(model_defaults("zero_optimization.offload_param", DeepSpeedZeroOffloadParamConfig()))
    for key in ds_config._REMOVED_ZERO_CONFIG_KEYS:
        out[f"zero_optimization.{key}"] = REMOVED
    return out


def collect() -> dict[str, Any]:
    out: dict[str, Any] = {
        "gradient_clipping": c.GRADIENT_CLIPPING_DEFAULT,
        "prescale_gradients": c.PRESCALE_GRADIENTS_DEFAULT,
        "gradient_predivide_factor": c.GRADIENT_PREDIVIDE_FACTOR_DEFAULT,
        "communication_data_type": c.COMMUNICATION_DATA_TYPE_DEFAULT,
        "torch_autocast.enabled": c.TORCH_AUTOCAST_ENABLED_DEFAULT,
        "torch_autocast.dtype": None,  # get_torch_autocast_dtype: None when the key is absent
        "aio.block_size": aio.AIO_BLOCK_SIZE_DEFAULT,
        "aio.queue_depth": aio.AIO_QUEUE_DEPTH_DEFAULT,
        "aio.intra_op_parallelism": aio.AIO_INTRA_OP_PARALLELISM_DEFAULT,
        "aio.single_submit": aio.AIO_SINGLE_SUBMIT_DEFAULT,
        "aio.overlap_events": aio.AIO_OVERLAP_EVENTS_DEFAULT,
        "aio.use_gds": aio.AIO_USE_GDS_DEFAULT,
    }
    out.update({f"activation_checkpointing.{k}": v for k, v in ACT_CHKPT_DEFAULT.items()})
    out.update(model_defaults("fp16", DeepSpeedFP16Config()))
    out.update(model_defaults("bf16", DeepSpeedBF16Config()))
    out.update(zero_defaults())
    for kind in ("Adam", "AdamW"):
        out.update(signature_defaults(f"optimizer[{kind}].params", FusedAdam.__init__))
    out.update(signature_defaults("optimizer[SGD].params", torch.optim.SGD.__init__))
    for kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        out.update(signature_defaults(f"scheduler[{kind}].params", getattr(lr_schedules, kind).__init__))
    for key in ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS:
        out[key] = REMOVED
    return {key: _plain(value) for key, value in sorted(out.items())}


def _plain(value: Any) -> Any:
    # Literals only, so the table reads back without DeepSpeed: enums to their value, tuples stay.
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
        return value.value
    return value


def main() -> None:
    lines = [
        f'"""DeepSpeed {deepspeed.__version__}\'s config defaults, recorded by scripts/record_deepspeed_defaults.py.',
        "",
        "Generated: do not edit. Read by zeroshard.tools.config_reference, which shows a DeepSpeed default where",
        'it differs from zeroshard\'s. A dict value is a default that depends on the stage; "removed" marks a key',
        "DeepSpeed rejects as removed.",
        '"""',
        "",
        f'VERSION = "{deepspeed.__version__}"',
        "",
        "DEFAULTS: dict[str, object] = {",
    ]
    lines += [f"    {key!r}: {value!r},".replace("'", '"') for key, value in collect().items()]
    lines.append("}")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
