"""DeepSpeed's module paths under `zeroshard.`, so that `import zeroshard as deepspeed` also serves
`from deepspeed.zero import GatheredParameters` written as `from zeroshard.zero import ...`.

One table, `PATHS`: the DeepSpeed path (without the leading `deepspeed.`) -> the zeroshard module
that implements it. `install()` registers each as an alias in `sys.modules` and as an attribute of
its parent, creating empty namespace modules for intermediate names (`runtime`, `runtime.zero`);
an intermediate name that is itself a path (`utils` of `utils.zero_to_fp32`) is that module.
Aliases point at our own modules; nothing of torch or of other packages is touched.

[Note: DeepSpeed's paths on first use]
`import zeroshard` does not import the DeepSpeed surface (the engine, the config layer and its
pydantic models): a user of `zeroshard.shard` does not need it. The aliases are installed, all at
once, when one is first used: as an attribute (`zeroshard.zero`, the facade's `__getattr__` calls
`install`) or in an import statement (`from zeroshard.runtime.zero.partition_parameters import ...`,
`AliasFinder` on `sys.meta_path` does). The finder answers only for the roots of `PATHS` under its
package, and hands back the very module object the alias names, so each module exists once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
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


ROOTS = frozenset(alias.split(".")[0] for alias in PATHS)  # zeroshard.<root> names the aliases start with


class _AliasLoader(importlib.abc.Loader):
    """Hands back a module `install` already made; executing it again is a no-op."""

    def __init__(self, module: types.ModuleType):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        pass


class AliasFinder(importlib.abc.MetaPathFinder):
    """[Note: DeepSpeed's paths on first use]: an import of `<package>.<root>...` installs the aliases."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, rest = fullname.partition(".")
        if prefix != self.package or rest.split(".")[0] not in ROOTS:
            return None
        install(self.package)
        # The import system puts the module in sys.modules itself; one found there already would be
        # taken for a module of its own spec (its real name) and executed a second time.
        module = sys.modules.pop(fullname, None)
        if module is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module))


def install_on_first_use(package: str = "zeroshard") -> None:
    """Put an `AliasFinder` for `package` on `sys.meta_path` (once)."""
    if not any(isinstance(f, AliasFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(AliasFinder(package))
