"""DeepSpeed's module paths under `zeroshard.`, so that `import zeroshard as deepspeed` also serves
`from deepspeed.zero import GatheredParameters` written as `from zeroshard.zero import ...`.

One table, `PATHS`: the DeepSpeed path (without the leading `deepspeed.`) -> the zeroshard module
that implements it. `install()` registers each as an alias in `sys.modules` and as an attribute of
its parent, creating empty namespace modules for intermediate names (`runtime`, `runtime.zero`);
an intermediate name that is itself a path (`utils` of `utils.zero_to_fp32`) is that module.
Aliases point at our own modules; nothing of torch or of other packages is touched.
"""

from __future__ import annotations

import importlib
import sys
import types

PATHS: dict[str, str] = {
    "zero": "zeroshard.compat.zero",
    "checkpointing": "zeroshard.compat.activation_checkpointing",
    "accelerator": "zeroshard.compat.accelerator",
    "comm": "zeroshard.compat.comm",
    "ops.adam": "zeroshard.compat.adam",
    "runtime.lr_schedules": "zeroshard.compat.schedulers",
    "runtime.engine": "zeroshard.compat.engine",
    "runtime.sequence_parallel.ulysses_sp": "zeroshard.compat.ulysses_sp",
    "runtime.zero.partition_parameters": "zeroshard.compat.partition_parameters",
    "moe.utils": "zeroshard.compat.moe",
    "utils": "zeroshard.compat.utils",
    "utils.zero_to_fp32": "zeroshard.compat.zero_to_fp32",
    "utils.module_utils": "zeroshard.compat.module_utils",
    "compression.helper": "zeroshard.compat.module_utils",
}


def install(package: str = "zeroshard") -> None:
    for alias, target in PATHS.items():
        module = importlib.import_module(target)
        parent_name = package
        parts = alias.split(".")
        for depth, part in enumerate(parts):
            name = f"{parent_name}.{part}"
            last = depth == len(parts) - 1
            if last:
                sys.modules[name] = module
                child = module
            else:
                child = sys.modules.get(name) or types.ModuleType(
                    name, f"DeepSpeed's '{'.'.join(parts[: depth + 1])}' namespace"
                )
                sys.modules[name] = child
            setattr(sys.modules[parent_name], part, child)
            parent_name = name
