"""Which modules become units (the granularity of gathering and gradient reduction).

Default: every block of the model's largest `nn.ModuleList` (by parameter count: the transformer
layers of a GPT, the decoder layers of a HuggingFace model), plus the root for everything else.
`wrap_modules` names module classes instead (like FSDP's `ModuleWrapPolicy`).
"""
from __future__ import annotations

from torch import nn

ROOT = "<root>"


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def unit_modules(model: nn.Module, wrap_modules: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each unit, root last. Names are those of `model.named_modules()`."""
    if wrap_modules:
        wanted = set(wrap_modules)
        found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in wanted]
        known = {type(m).__name__ for m in model.modules()}
        missing = wanted - known
        if missing:
            raise ValueError(f"zeroshard.wrap_modules names {sorted(missing)}, which the model does not "
                             f"contain; module classes in the model: {sorted(known)}")
    else:
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        found = []
        if lists:
            name, biggest = max(lists, key=lambda item: _numel(item[1]))
            found = [(f"{name}.{i}", block) for i, block in enumerate(biggest) if _numel(block)]
    return found + [(ROOT, model)]


def is_inside(inner: str, outer: str) -> bool:
    """Is module `inner` (qualified name) inside module `outer` (or the same)?"""
    return outer == ROOT or inner == outer or inner.startswith(outer + ".")


def assign_owners(model: nn.Module, units: list[tuple[str, nn.Module]]) -> dict[int, str]:
    """id(param) -> the unit that owns it: the innermost unit containing every use of the parameter.

    A parameter shared by two sibling units (a tied embedding and LM head in different blocks) goes
    to their common ancestor, the root, which is gathered whenever any of them runs.
    """
    containing: dict[int, list[str]] = {}
    for name, module in units:
        for param in module.parameters():
            containing.setdefault(id(param), []).append(name)
    owners = {}
    for pid, names in containing.items():
        innermost = [n for n in names if not any(o != n and is_inside(o, n) for o in names)]
        chain = len(innermost) == 1
        owners[pid] = innermost[0] if chain else ROOT
    return owners
