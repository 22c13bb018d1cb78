"""The Trainer's settings in a DeepSpeed-style config, as transformers' DeepSpeed integration puts them
there (`HfTrainerDeepSpeedConfig`): a key that is missing or `"auto"` takes the `TrainingArguments`
value; an explicit value that differs from it is an error, and every such difference is named in one
message. Pure dict work: no transformers import, so it is tested without a Trainer.

| config key | from TrainingArguments |
|---|---|
| `train_micro_batch_size_per_gpu` | `per_device_train_batch_size` |
| `gradient_accumulation_steps` | `gradient_accumulation_steps` |
| `train_batch_size` | world size × the two above |
| `gradient_clipping` | `max_grad_norm` |
| `bf16.enabled` / `fp16.enabled` | `bf16` or `bf16_full_eval` / `fp16` or `fp16_full_eval` |
| `optimizer.params` `lr`, `betas`, `eps`, `weight_decay` | `learning_rate`, `adam_beta1`/`adam_beta2`, `adam_epsilon`, `weight_decay` |
| `scheduler.params` `warmup_min_lr` (filled only), `warmup_max_lr`, `warmup_num_steps`, `total_num_steps` | 0, `learning_rate`, `get_warmup_steps(max_steps)` (at least 1), `max_steps` |
| `zeroshard.generate_gather` | `ds3_gather_for_generation` (TRL's trainers): True "whole", False "units" |

One departure: `bf16=False` / `fp16=False` (the Trainer's defaults) leave an explicit `enabled: true`
in the config alone, so a config that sets precision itself keeps working; `bf16=True` against
`"bf16": {"enabled": false}` is an error like any other difference.
"""

from __future__ import annotations

import copy
from typing import Any

from zeroshard.config import ConfigError, read_config

__all__ = ["trainer_config"]

_UNSET = object()


class _Filler:
    """Fills one config dict, collecting the differences from the Trainer's values."""

    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []

    def fill(self, path: str, value: Any, source: str, *, create: bool = True, must_match: bool = True) -> None:
        """Set `path` (dotted) to `value` where it is missing (if `create`) or "auto"; else, with
        `must_match`, note an explicit value that differs."""
        *parents, key = path.split(".")
        node = self.config
        for name in parents:
            if not isinstance(node.get(name), dict):
                if not create:
                    return
                node[name] = {}
            node = node[name]
        given = node.get(key, _UNSET)
        if given is _UNSET:
            if create:
                node[key] = value
        elif given == "auto":
            node[key] = value
        elif must_match and given != value:
            self.mismatches.append(f"- config {path}={given!r} vs TrainingArguments {source}={value!r}")


def trainer_config(config, args, max_steps: int | None, world_size: int) -> dict:
    """A copy of `config` (a dict or a JSON path) with the Trainer's values filled in (the table in
    the module docstring). `max_steps` None leaves the scheduler's step counts as they are (a
    config built before the number of steps is known: a reference model's)."""
    config = copy.deepcopy(read_config(config))
    filler = _Filler(config)
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    filler.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    filler.fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    filler.fill("train_batch_size", world_size * micro * gas, "world size x per_device_train_batch_size x gas")
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    for section, flags in (("bf16", ("bf16", "bf16_full_eval")), ("fp16", ("fp16", "fp16_full_eval"))):
        wanted = any(bool(getattr(args, flag, False)) for flag in flags)
        filler.fill(f"{section}.enabled", wanted, "|".join(flags), create=wanted, must_match=wanted)
    lr = args.learning_rate
    optimizer = {
        "lr": (lr, "learning_rate"),
        "betas": ([args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2"),
        "eps": (args.adam_epsilon, "adam_epsilon"),
        "weight_decay": (args.weight_decay, "weight_decay"),
    }
    for key, (value, source) in optimizer.items():
        filler.fill(f"optimizer.params.{key}", _as_config(value), source, create=False)
    filler.fill("scheduler.params.warmup_min_lr", 0, "(none: 0)", create=False, must_match=False)
    filler.fill("scheduler.params.warmup_max_lr", lr, "learning_rate", create=False)
    if max_steps is not None:
        warmup = max(1, args.get_warmup_steps(max_steps))
        filler.fill("scheduler.params.warmup_num_steps", warmup, "warmup_steps", create=False)
        filler.fill("scheduler.params.total_num_steps", max_steps, "max_steps (calculated)", create=False)
    if hasattr(args, "ds3_gather_for_generation"):  # TRL's generating trainers
        mode = "whole" if args.ds3_gather_for_generation else "units"
        filler.fill("zeroshard.generate_gather", mode, "ds3_gather_for_generation")
    if filler.mismatches:
        raise ConfigError(
            "the zeroshard config differs from the TrainingArguments:\n"
            + "\n".join(filler.mismatches)
            + '\nset these config values to "auto" (or remove them), or make the TrainingArguments agree'
        )
    return config


def _as_config(value):
    """A TrainingArguments value as JSON has it (tuples become lists), so equal values compare equal."""
    return list(value) if isinstance(value, tuple) else value
