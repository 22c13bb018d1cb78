"""Loading a checkpoint into an engine of any world size and stage.

Order of work, each phase ending with every rank agreeing it succeeded (see `agree`):
  1. find the checkpoint (`latest` or the tag) and read its manifest;
  2. verify every file's size and checksum, the files spread over the ranks;
  3. check the model and optimizer fit, then read this rank's shard of every group's master
     weights and optimizer state, re-sliced by element ranges ([Note: resharding by element
     ranges] in reader.py);
  4. gather the unsharded parameters from the loaded masters, restore counters, scheduler and loss
     scaler.
A damaged or incompatible checkpoint, or a failure while reading, is reported in phase 1-3 before
anything is changed ([Note: a failed load changes nothing] in apply.py).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from zeroshard.checkpoint.apply import Loaded, apply_loaded, restore_param_groups
from zeroshard.checkpoint.common import agree, attempt, partition_of
from zeroshard.checkpoint.contract import Counters
from zeroshard.checkpoint.deepspeed import find as find_deepspeed
from zeroshard.checkpoint.deepspeed_load import load_deepspeed_checkpoint
from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.layout import Layout, check_same_model_parallel, layout_of
from zeroshard.checkpoint.manifest import (
    MANIFEST,
    OBJECTS,
    check_compatible,
    check_file,
    check_files,
    checkpoint_path,
    grad_key,
    is_layout,
    persistent_buffers,
    rank_file,
    read_manifest,
    resolve_tag,
    state_key,
)
from zeroshard.checkpoint.objects import load_objects, set_rng_state
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.core.optim.masked import PER_PARAMETER

log = logging.getLogger(__name__)


def load_checkpoint(
    engine,
    load_dir,
    tag=None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    load_module_strict: bool = True,
    verify: bool = True,
    name: str | None = None,
):
    """Restore `engine` from `load_dir/<tag>` (default: the tag `latest` names, or `load_dir`
    itself when it is the directory of one checkpoint). Collective. A checkpoint DeepSpeed wrote
    (ZeRO stages 1-3) is recognised and read in its own format (deepspeed_load.py).

    Returns `(checkpoint directory, client_state)`, or `(None, None)` with a warning when
    `load_dir` has no `latest` and no tag was given (DeepSpeed's behaviour). `load_module_only`
    restores the weights alone; `load_module_strict=False` loads the parameters the checkpoint and
    the model share and leaves the others as they are; `verify=False` skips the checksums. `name`:
    how the collectives of the load describe the checkpoint (default: its path), the same on every
    rank where each machine reads its own copy under another path (snapshots).

    Nothing in a checkpoint can run code: the manifest is JSON checked against its schema, tensors
    are safetensors, and client state comes back through torch.load(weights_only=True), so it may
    hold tensors, dicts, lists, tuples, strings, numbers, booleans and None (classes allowed with
    torch.serialization.add_safe_globals too), not arbitrary objects as DeepSpeed's may; saving
    other objects is refused ([Note: objects.pt holds data, not code] in objects.py).
    """
    comm = engine.comm  # the dp group: the ranks that read one part ([Note: checkpoints across layouts])
    layout = layout_of(engine)
    grid = layout.comm if layout is not None else comm
    load_dir = Path(load_dir)
    deepspeed_dir = find_deepspeed(load_dir, tag)  # a checkpoint DeepSpeed wrote: read its own format
    if deepspeed_dir is not None:
        if layout is not None:
            raise CheckpointError(
                f"{deepspeed_dir}: loading a DeepSpeed checkpoint under tensor/pipeline "
                "parallelism is not supported; consolidate it (`zeroshard consolidate`) and load "
                "the full weights (zeroshard.checkpoint.load_full_weights)"
            )
        return load_deepspeed_checkpoint(
            engine, deepspeed_dir, load_optimizer_states, load_lr_scheduler_states, load_module_only, load_module_strict
        )
    found, error = attempt(find_checkpoint, load_dir, tag)
    if error is None and found is not None:
        found, error = attempt(_own_part, *found, engine, layout, verify)
    agree(grid, error, f"loading checkpoint from {name or load_dir}")
    if found is None:
        log.warning("zeroshard: %s has no '%s' file and no tag was given: nothing loaded", load_dir, "latest")
        return None, None
    path, manifest = found
    what = f"loading checkpoint {name or (path.parent if layout is not None else path)}"  # the same on every part
    if verify:
        files = sorted(manifest["files"])
        problems, error = attempt(check_files, path, manifest, files[comm.rank :: comm.world_size])
        every = [p for mine in grid.all_gather_objects(problems or [], f"{what}: verification") for p in mine]
        agree(grid, error or ("; ".join(every) if every else None), what)
    restore_optimizer = load_optimizer_states and not load_module_only
    read, error = attempt(_read_shards, engine, path, manifest, restore_optimizer, load_module_strict, load_module_only)
    agree(grid, error, what)
    # [Note: a failed load changes nothing] (apply.py): every rank has read all it needs; only now is it applied
    objects, loaded = read
    _, error = attempt(apply_loaded, engine, loaded)
    agree(grid, error, f"{what}: applying what was read")
    engine.refresh_parameters()
    if restore_optimizer:
        restore_param_groups(engine, objects["optimizer"]["param_groups"])
    if not load_module_only:
        _restore_counters(engine, manifest)
        if load_lr_scheduler_states and engine.lr_scheduler is not None and objects["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(objects["lr_scheduler"])
        if engine.loss_scaler is not None and objects["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(objects["loss_scaler"])
        generators = objects.get("rng") or []  # a snapshot's; a rank beyond its world keeps its own
        if comm.rank < len(generators):
            set_rng_state(generators[comm.rank])
    log.info(
        "zeroshard: loaded checkpoint %s (saved at %d ranks, stage %d; now %d ranks, stage %d)",
        path,
        manifest["world_size"],
        manifest["stage"],
        comm.world_size,
        engine.policy.stage,
    )
    return str(path), objects["client_state"]


def find_checkpoint(load_dir: Path, tag):
    """(directory, manifest) of the checkpoint `tag` under `load_dir` (or `load_dir` itself); None without a tag."""
    if tag is None and (load_dir / MANIFEST).is_file():  # the directory of one checkpoint
        return load_dir, read_manifest(load_dir)
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        return None
    path = checkpoint_path(load_dir, tag)
    return path, read_manifest(path)


def _own_part(path: Path, manifest: dict, engine, layout: Layout | None, verify: bool) -> tuple[Path, dict]:
    """The checkpoint this rank reads: the whole one when dp-only, else the part of its own (tp, pp)
    ([Note: checkpoints across layouts] in layout.py); another tp or pp is an error naming both."""
    check_same_model_parallel(path, manifest, engine, layout)
    if layout is None:
        return path, manifest
    if not is_layout(manifest):
        raise CheckpointError(
            f"{path / MANIFEST}: is one part of a tensor/pipeline-parallel checkpoint; pass the "
            f"checkpoint's directory ({path.parent}), whose manifest lists every part"
        )
    tp, pp = layout.coordinate["tp"], layout.coordinate["pp"]
    part = next((p for p in manifest["parts"] if (p["tp"], p["pp"]) == (tp, pp)), None)
    if part is None:
        raise CheckpointError(
            f"{path / MANIFEST}: has no part for tp rank {tp}, pp rank {pp} (parts: "
            f"{[(p['tp'], p['pp']) for p in manifest['parts']]}): the checkpoint is damaged"
        )
    name = f"{part['dir']}/{MANIFEST}"
    if verify and name in manifest["files"]:
        problem = check_file(path, name, manifest["files"][name])
        if problem is not None:
            raise CheckpointError(problem)
    part_path = path / part["dir"]
    part_manifest = read_manifest(part_path)
    if part_manifest.get("mesh") != manifest["mesh"]:
        raise CheckpointError(
            f"{part_path / MANIFEST}: its mesh {part_manifest.get('mesh')} is not the checkpoint's "
            f"{manifest['mesh']} ({path / MANIFEST}): the checkpoint is damaged"
        )
    return part_path, part_manifest


def engine_param_shapes(engine) -> dict[str, list[int]]:
    return {s.name: list(s.shape) for g in engine.groups for s in g.layout.slots}


@torch.no_grad()
def _read_shards(
    engine, path: Path, manifest: dict, restore_optimizer: bool, strict: bool, module_only: bool
) -> tuple[dict, Loaded]:
    check_compatible(path, manifest, engine_param_shapes(engine), strict)
    objects = _read_objects(path)
    optimizer = engine.optimizer
    if restore_optimizer:
        _check_optimizer(path, manifest, objects, optimizer)
    with_grads = manifest["mid_accumulation"] and not module_only
    if with_grads:
        _check_same_partition(path, manifest, engine)
    loaded = Loaded()
    with CheckpointReader(path, manifest) as reader:
        if restore_optimizer:
            _check_state_complete(reader, engine)
        for index, group in enumerate(engine.groups):
            master = torch.empty(group.master.shape, dtype=group.master.dtype)  # each element written once
            for (slot, lo, hi, dest), (*_, now) in zip(group.master_pieces(master), group.master_pieces()):
                if slot.name in reader.index:
                    reader.read_param(slot.name, "master", lo, hi, dest)
                else:
                    dest.copy_(now)  # what the checkpoint lacks stays as it is
            _zero_padding(group, master)
            loaded.copies.append((group.master, master))
            if restore_optimizer and group.trainable:
                state = _load_optimizer_state(reader, group, objects["optimizer"]["scalars"], optimizer)
                if state is not None:
                    loaded.states.append((group, state))
            if with_grads and group.trainable:
                copies = _load_grads(reader, index, group, partition_of(engine).rank)
                loaded.copies += copies
                loaded.grads += [group] if copies else []
        loaded.copies += _load_buffers(engine.module, reader.buffers(), path, strict)
    return objects, loaded


_OBJECT_KEYS = {"client_state", "optimizer", "lr_scheduler", "loss_scaler"}
_OPTIONAL_OBJECT_KEYS = {"rng"}  # a snapshot's ranks' random-number generators (snapshot.py)


def _read_objects(path: Path) -> dict:
    """objects.pt through torch.load(weights_only=True): see [Note: objects.pt holds data, not code]."""
    objects = load_objects(path / OBJECTS)
    if (
        not isinstance(objects, dict)
        or not _OBJECT_KEYS <= set(objects) <= _OBJECT_KEYS | _OPTIONAL_OBJECT_KEYS
        or not isinstance(objects["optimizer"], dict)
        or set(objects["optimizer"]) != {"param_groups", "scalars"}
    ):
        raise CheckpointError(
            f"{path / OBJECTS}: not the objects file of a zeroshard checkpoint (expected a dict "
            f"of {sorted(_OBJECT_KEYS)})"
        )
    return objects


def _check_optimizer(path: Path, manifest: dict, objects: dict, optimizer) -> None:
    saved = len(objects["optimizer"]["param_groups"])
    if manifest["optimizer"] != optimizer.name or saved != len(optimizer.param_groups):
        raise CheckpointError(
            f"{path / MANIFEST}: optimizer states of {manifest['optimizer']} with {saved} param group(s) "
            f"cannot be loaded into {optimizer.name} with {len(optimizer.param_groups)}; "
            "pass load_optimizer_states=False to load the weights only"
        )


def _check_same_partition(path: Path, manifest: dict, engine) -> None:
    """Gradients accumulated so far are rank-local (unreduced at stages 0/1): they only fit the same
    world size, stage, accumulation steps and grouping -- and under MiCS the same partition size
    (the manifest's world size, [Note: checkpoints of replicated shards] in save.py)."""
    shards, replicas = partition_of(engine).world_size, engine.comm.world_size // partition_of(engine).world_size
    same = (
        manifest["world_size"] == shards
        and manifest.get("replicas", 1) == replicas
        and manifest["stage"] == engine.policy.stage
        and manifest["gradient_accumulation_steps"] == engine.counters().gradient_accumulation_steps
        and [[p["name"] for p in g["params"]] for g in manifest["groups"]] == [g.names for g in engine.groups]
    )
    if not same:
        raise CheckpointError(
            f"{path / MANIFEST}: saved in the middle of gradient accumulation (micro step "
            f"{manifest['micro_steps']}, {manifest['gradient_accumulation_steps']} per step) at "
            f"{_ranks(manifest['world_size'], manifest.get('replicas', 1))} and stage {manifest['stage']}; its "
            f"accumulated gradients load only into the same setup, not {_ranks(shards, replicas)}, stage "
            f"{engine.policy.stage}, {engine.counters().gradient_accumulation_steps} micro steps. Save at an "
            "accumulation boundary to change the world size, MiCS size or stage, or pass load_module_only=True"
        )


def _ranks(shards: int, replicas: int) -> str:
    """'4 ranks', or under MiCS '4 ranks (mics_shard_size 2)'."""
    return f"{shards} ranks" if replicas == 1 else f"{shards * replicas} ranks (mics_shard_size {shards})"


def _load_optimizer_state(reader: CheckpointReader, group, scalars: dict, optimizer) -> dict | None:
    """One group's optimizer state read from the checkpoint, for ZeroOptimizer.load_group_state
    (applied by `apply_loaded`); None: the checkpoint has none of its parameters here. Elementwise
    state re-sliced; scalar state (Adam's `step`) from the saved group(s) holding this
    group's parameters -- one value when they agree, else one per parameter ([Note: parameters
    without a gradient] in core/optim/masked.py: step counts differ where some had no gradient)."""
    sources = {s.name: reader.index.locate(s.name)[0] for s in group.layout.slots if s.name in reader.index}
    if not any(slot.name in sources for slot, _, _, _ in group.master_pieces()):
        return None
    kinds = {source: dict(reader.manifest["groups"][source]["state"]) for source in sources.values()}
    stepped = [source for source in dict.fromkeys(sources.values()) if kinds[source]]
    if not stepped:
        return {}  # saved before any of them stepped
    statuses = {
        slot.name: _saved_status(scalars, kinds, sources.get(slot.name), slot.name) for slot in group.layout.slots
    }
    first_name = group.layout.slots[0].name
    if len({_status_key(status) for status in statuses.values()}) > 1:
        state: dict = {PER_PARAMETER: copy.deepcopy(statuses)}
    elif PER_PARAMETER in scalars[sources[first_name]]:
        state = copy.deepcopy(statuses[first_name])
    else:
        # A copy per group: optimizers update scalar state in place (Adam: step += 1), and two
        # groups may take theirs from the same saved group.
        state = {
            key: copy.deepcopy(value.to(group.master.device) if on_device else value)
            for key, (value, on_device) in _saved_scalars(scalars, sources[first_name]).items()
        }
    for key in [k for k, kind in kinds[stepped[0]].items() if kind == "elementwise"]:
        state[key] = torch.empty_like(group.master)  # 1-D, numel = end - start; each element written once
        for slot, lo, hi, dest in group.master_pieces(state[key]):
            if slot.name in sources and kinds[sources[slot.name]]:
                reader.read_param(slot.name, key, lo, hi, dest)
            else:
                dest.zero_()  # new to the model, or never stepped
        _zero_padding(group, state[key])
    return state


def _zero_padding(group, tensor: torch.Tensor) -> None:
    """The elements of `tensor` (1-D, laid out like the group's master) that no parameter covers:
    padding, which stays zero. A load fills the rest piece by piece, so its buffers start empty:
    writing each element once, not zeros first."""
    start, end = group.opt_range
    for lo, hi in group.layout.gaps(start, end):
        tensor[lo - start : hi - start].zero_()


def _saved_scalars(scalars: dict, source: int) -> dict:
    return {key: entry for key, entry in scalars[source].items() if key != PER_PARAMETER}


def _saved_status(scalars: dict, kinds: dict, source: int | None, name: str):
    """One parameter's scalar optimizer state in the checkpoint; None where it never stepped."""
    if source is None or not kinds[source]:
        return None
    if PER_PARAMETER in scalars[source]:
        return scalars[source][PER_PARAMETER][0][name]
    return {key: value for key, (value, _) in _saved_scalars(scalars, source).items()}


def _status_key(status):
    if status is None:
        return None
    return tuple(sorted((k, float(v.item() if isinstance(v, torch.Tensor) else v)) for k, v in status.items()))


def _check_state_complete(reader: CheckpointReader, engine) -> None:
    """Before anything is loaded: the optimizer state this engine will read is all there (see
    `_check_state_not_lost`); every elementwise state a saved group lists is in every rank file;
    and parameters that now share a flat group had the same kinds of state."""
    _check_state_not_lost(reader, engine.optimizer)
    groups = reader.manifest["groups"]
    for index, saved in enumerate(groups):
        for key, kind in saved["state"]:
            for rank in range(reader.world_size) if kind == "elementwise" else ():
                file = reader.file(rank_file(rank))
                if state_key(index, key) not in file:
                    raise CheckpointError(
                        f"{file.path}: has no optimizer state '{state_key(index, key)}', which "
                        f"{reader.path / MANIFEST} lists; pass load_optimizer_states=False to "
                        "load the weights only"
                    )
    for group in engine.groups:
        names = [s.name for s in group.layout.slots if s.name in reader.index] if group.trainable else []
        # Parameters that never stepped have no state; those that did must have the same kinds.
        kinds = {name: _elementwise_kinds(reader.index.state_kinds(name)) for name in names}  # () never stepped
        kinds = {name: k for name, k in kinds.items() if k}
        if len(set(kinds.values())) > 1:
            first, other = next(iter(kinds)), next(n for n in kinds if kinds[n] != next(iter(kinds.values())))
            raise CheckpointError(
                f"{reader.path / MANIFEST}: parameters '{first}' and '{other}' have different optimizer state "
                f"({list(kinds[first])} and {list(kinds[other])}) but share a flat group here: part of the "
                "optimizer state was lost; pass load_optimizer_states=False to load the weights only"
            )


def _elementwise_kinds(kinds: dict) -> tuple[str, ...]:
    return tuple(sorted(k for k, kind in kinds.items() if kind == "elementwise"))


def _check_state_not_lost(reader: CheckpointReader, optimizer) -> None:
    """A checkpoint of an optimizer that keeps state (Adam's moments, SGD's momentum) and had
    stepped, yet holds no optimizer state at all, lost it (offloaded sub-groups saved wrongly would): an error, never a silently fresh optimizer. A group of its own may lack
    state, since its parameters may never have had a gradient; all of them cannot."""
    manifest = reader.manifest
    applied = manifest["global_steps"] - manifest.get("skipped_steps", 0)
    trainable = [g for g in manifest["groups"] if g.get("optimizer_group") is not None]
    if applied > 0 and trainable and not any(g["state"] for g in trainable) and optimizer.keeps_state():
        raise CheckpointError(
            f"{reader.path / MANIFEST}: the optimizer ({manifest['optimizer']}) took {applied} step(s) but the "
            "checkpoint holds no optimizer state for any parameter: it was lost when the checkpoint was written; "
            "pass load_optimizer_states=False to load the weights only (the optimizer then starts afresh)"
        )


def _load_grads(reader: CheckpointReader, index: int, group, rank: int) -> list:
    file = reader.file(rank_file(rank))
    if not group.trainable or grad_key(index) not in file:
        return []
    grad = group.grad()  # a stage-2/3 shard freed since the last step is made again (zeros) here
    value = torch.empty(grad.numel(), dtype=grad.dtype)  # 1-D, as the flat gradient shard
    file.read_into(grad_key(index), 0, grad.numel(), value)
    return [(grad, value)]


def _load_buffers(module, saved: dict[str, torch.Tensor], path: Path, strict: bool) -> list:
    buffers = persistent_buffers(module)
    if strict and set(saved) != set(buffers):
        missing, unexpected = sorted(set(buffers) - set(saved)), sorted(set(saved) - set(buffers))
        raise CheckpointError(
            f"{path / MANIFEST}: the checkpoint is from an incompatible model: buffers "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return [(buffers[name], value) for name, value in saved.items() if name in buffers]


def _restore_counters(engine, manifest: dict) -> None:
    gas = engine.counters().gradient_accumulation_steps
    global_steps = manifest["global_steps"]
    # At a boundary (checked) the position in a step is 0 whatever the accumulation steps are now.
    micro_steps = manifest["micro_steps"] if manifest["gradient_accumulation_steps"] == gas else global_steps * gas
    engine.restore_counters(Counters(global_steps, micro_steps, gas, manifest.get("skipped_steps", 0)))
