"""Which modules become units (the granularity of gathering and gradient reduction).

Default: every block of the model's largest `nn.ModuleList` (by parameter count: the transformer
layers of a GPT, the decoder layers of a HuggingFace model), each large module after the blocks (the
head: see [Note: the head is a unit]), plus the root for everything else. `wrap_modules` names module
classes instead (like FSDP's `ModuleWrapPolicy`), and then only those become units.

[Note: the head is a unit]
A unit's gradients are reduced once all of them are ready. Left in the root, an untied LM head (in a
GPT with a large vocabulary, half a block or more) has its gradient first in backward but waits
until the embedding's, the very last, so its reduction cannot overlap any compute and backward ends
waiting for it (measured: docs/performance.md). DDP starts it at once, since its
buckets follow parameter registration order backwards; torchtitan wraps the output layer apart from
the root for the same reason. So a module registered after the blocks, outside them, holding
parameters of its own and at least half a block's worth of them, is a unit of its own. At stage 3
that also frees it outside its use. Not the embedding: its gradient is the last of backward anyway.
A module whose parameters are also used outside it (a head tied to the embedding) stays in the
root, where its other user is.

[Note: calls below a unit's module]
Code outside the engine calls modules inside the model directly: PEFT's `generate` runs the base
model's forward, never the PeftModel's; scripts embed tokens with `get_input_embeddings()(ids)` or
call a vision tower by hand. A unit's parameters are therefore gathered by a call of any module that
holds some of them, or lies between such a module and the unit's module (`entry_modules`), not only
by a call of the unit's module. Calls nest: the outermost one gathers and frees, the calls inside it
find the unit gathered (lifecycle.py keeps the stack of open calls). The price is a forward pre-
and post-hook on each of those modules (torch's slower call path), paid whether a call gathers or
not; DeepSpeed's stage 3 hooks every module.
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
            raise ValueError(
                f"GatheringPolicy.wrap names {sorted(missing)}, which the model does not "
                f"contain; module classes in the model: {sorted(known)}"
            )
    else:
        blocks, heads = _default_units(model)
        found = blocks + heads
    return found + [(ROOT, model)]


def block_classes(model: nn.Module) -> list[str]:
    """Class names of the default policy's blocks: as `wrap_modules`, the same units with every head
    left in the root."""
    blocks, _ = _default_units(model)
    return sorted({type(block).__name__ for _, block in blocks})


def _default_units(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """(the blocks of the largest ModuleList, the heads after them)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return [], []
    name, biggest = max(lists, key=lambda item: _numel(item[1]))
    blocks = [(f"{name}.{i}", block) for i, block in enumerate(biggest) if _numel(block)]
    return blocks, _heads(model, name, [block for _, block in blocks])


def _heads(model: nn.Module, blocks_name: str, blocks: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The modules after the blocks that are units of their own: [Note: the head is a unit]."""
    if not blocks:
        return []
    least = sum(_numel(b) for b in blocks) / len(blocks) / 2
    named = list(model.named_modules())
    start = next(i for i, (n, _) in enumerate(named) if n == blocks_name) + 1
    heads: list[tuple[str, nn.Module]] = []
    for name, module in named[start:]:  # registered after the blocks
        if is_inside(name, blocks_name) or any(is_inside(name, h) for h, _ in heads):
            continue
        if next(module.parameters(recurse=False), None) is None or _numel(module) < least:
            continue
        inside = {id(p) for p in module.parameters()}
        elsewhere = {
            id(p) for n, m in model.named_modules() if not is_inside(n, name) for p in m.parameters(recurse=False)
        }
        if not inside & elsewhere:
            heads.append((name, module))
    return heads


def entry_modules(unit_module: nn.Module, params: set[int]) -> list[nn.Module]:
    """The modules whose call needs parameters of a unit whose module is `unit_module` and whose
    parameters have the ids `params`: those holding one, and each module between them and
    `unit_module`, which comes first. See [Note: calls below a unit's module]."""
    named = list(unit_module.named_modules())
    needed = {""}
    for name, module in named:
        if name and any(id(p) in params for p in module.parameters(recurse=False)):
            parts = name.split(".")
            needed.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return [module for name, module in named if name in needed]


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
