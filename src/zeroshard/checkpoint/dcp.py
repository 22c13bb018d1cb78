"""torch.distributed.checkpoint (DCP) interop: what FSDP2 and torchtitan save and load.

[Note: DCP checkpoints]
An FSDP2 script checkpoints `{"model": model_sd, "optim": optim_sd}` from torch's `get_state_dict(model,
optimizer)` with `dcp.save`: parameters (and persistent buffers) by their names, optimizer state as
`{"state": {name: {"step", "exp_avg", ...}}, "param_groups": [{hyper-parameters, "params": [names]}]}`,
each tensor with the parameter's full shape, stored as the chunks each rank held. DCP re-slices on
load, so any world size and any sharding reads any other's.

`save_dcp` writes that form. Each rank contributes whole tensors of the parameters it is given (the
parameters go to ranks in turn, the least loaded by bytes first), gathered group by group from the
shards: a rank holds its share of the full tensors (its 1/N, parameters and optimizer state) and one
group's gathered buffers at a time. DCP writes one file per rank and the metadata; FSDP2 loads the
result with `dcp.load` and `set_state_dict` at any world size.

`load_dcp` reads such a checkpoint group by group: a `dcp.load` of one group's tensors at their full
shapes (DCP assembles them from whatever chunks were saved), of which each rank keeps its slices. As
with zeroshard's own checkpoints ([Note: a failed load changes nothing] in apply.py), everything is
read into new tensors first and applied only once every rank has read all it needs.
The top-level keys are FSDP2's tutorial's ("model", "optim"); torchtitan's layouts name others:
`model_key` and `optim_key` say which.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch

from zeroshard.checkpoint.apply import Loaded, apply_loaded, restore_param_groups
from zeroshard.checkpoint.common import agree, attempt, optimizer_states
from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.full import gathered
from zeroshard.checkpoint.layout import layout_of
from zeroshard.checkpoint.manifest import is_elementwise, model_aliases, persistent_buffers

log = logging.getLogger(__name__)

SCALAR_STATES = ("step",)  # per-parameter scalars in torch's optimizers; an expanded one is read back as one


def _dcp():
    """torch.distributed.checkpoint, imported on first use: importing it takes most of a second
    (its planners and storage layers), which every `import zeroshard` would otherwise pay."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


def _check_layout(engine, what: str) -> None:
    if layout_of(engine) is not None:
        raise CheckpointError(
            f"{what}: not supported under tensor or pipeline parallelism (save a zeroshard checkpoint)"
        )


@torch.no_grad()
def save_dcp(engine, directory, model_key: str = "model", optim_key: str = "optim") -> str:
    """Write the engine's model and optimizer state as a DCP checkpoint that FSDP2 loads ([Note: DCP
    checkpoints]). Collective; returns `directory`."""
    what = f"saving a DCP checkpoint to {directory}"
    _check_layout(engine, what)
    comm = engine.comm
    states, error = attempt(optimizer_states, engine)
    agree(comm, error, what)
    aliases_of: dict[str, list[str]] = {}
    for alias, name in model_aliases(engine.module).items():
        aliases_of.setdefault(name, []).append(alias)
    load = [0] * comm.world_size  # bytes given to each rank so far
    model_sd: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict] = {}
    for group, state in zip(engine.groups, states):
        master = gathered(engine, group, group.master, f"{what}: masters of {group.names[0]}...")
        full_states = {
            key: gathered(engine, group, value, f"{what}: {key} of {group.names[0]}...")
            for key, value in state.items()
            if is_elementwise(value, group.master)
        }
        for slot, view in zip(group.layout.slots, group.layout.views(master)):
            owner = min(range(comm.world_size), key=lambda r: (load[r], r))
            load[owner] += slot.numel * (1 + len(full_states))
            if owner != comm.rank:
                continue
            for name in [slot.name, *aliases_of.get(slot.name, [])]:
                model_sd[name] = view.to("cpu", torch.float32, copy=True)
            if not group.trainable or not state:
                continue
            entry = {}
            for key, value in state.items():
                if key in full_states:
                    piece = full_states[key][slot.offset : slot.offset + slot.numel]
                    entry[key] = (
                        piece[0].clone().cpu() if key in SCALAR_STATES else piece.view(slot.shape).cpu().clone()
                    )
                elif isinstance(value, torch.Tensor):
                    entry[key] = value.detach().cpu().clone()
                else:
                    entry[key] = value
            optim_state[slot.name] = entry
    if comm.rank == 0:
        for name, value in persistent_buffers(engine.module).items():
            model_sd[name] = value.detach().cpu().clone()
    names_in = _param_group_names(engine)
    param_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": names_in.get(i, [])}
        for i, g in enumerate(engine.optimizer.param_groups)
    ]
    state_dict = {model_key: model_sd, optim_key: {"state": optim_state, "param_groups": param_groups}}
    error = None
    try:
        _dcp().save(state_dict, checkpoint_id=str(directory), process_group=comm.group)
    except Exception as caught:  # noqa: BLE001 - DCP's own errors, every rank told by agree()
        error = f"{type(caught).__name__}: {caught}"
    agree(comm, error, what)
    log.info("zeroshard: saved DCP checkpoint %s", directory)
    return str(directory)


def _param_group_names(engine) -> dict[int, list[str]]:
    """Parameter names per optimizer param group, in the model's parameter order."""
    group_of = {s.name: g.optimizer_group for g in engine.groups if g.trainable for s in g.layout.slots}
    out: dict[int, list[str]] = {}
    for name, _ in engine.module.named_parameters():
        if name in group_of:
            out.setdefault(group_of[name], []).append(name)
    return out


@torch.no_grad()
def load_dcp(
    engine, directory, model_key: str = "model", optim_key: str = "optim", load_optimizer_states: bool = True
) -> str:
    """Load a DCP checkpoint FSDP2 (or `save_dcp`) wrote into the engine, at any stage and world size
    ([Note: DCP checkpoints]). Collective; returns `directory`."""
    what = f"loading DCP checkpoint {directory}"
    _check_layout(engine, what)
    comm = engine.comm
    metadata, error = attempt(_metadata, Path(directory))
    agree(comm, error, what)
    entries = metadata.state_dict_metadata
    problems = _missing(engine, entries, model_key, optim_key, load_optimizer_states)
    agree(comm, "; ".join(problems) if problems else None, what)
    loaded = Loaded()
    failed = None
    for group in engine.groups:
        if failed is None:
            _, failed = attempt(
                _read_group, engine, group, directory, entries, model_key, optim_key, load_optimizer_states, loaded
            )
        else:  # every rank runs every group's dcp.load (collective), also after a failure
            _read_group(engine, group, directory, entries, model_key, optim_key, False, Loaded())
    agree(comm, failed, what)
    buffers = {n: b for n, b in persistent_buffers(engine.module).items() if f"{model_key}.{n}" in entries}
    if buffers:
        state = {model_key: {n: torch.empty_like(b, device="cpu") for n, b in buffers.items()}}
        _dcp().load(state, checkpoint_id=str(directory), process_group=comm.group)
        loaded.copies += [(b, state[model_key][n]) for n, b in buffers.items()]
    groups = None
    if load_optimizer_states:
        groups, error = attempt(_read_param_groups, engine, directory, entries, optim_key)
        agree(comm, error, what)
    _, error = attempt(apply_loaded, engine, loaded)
    agree(comm, error, f"{what}: applying what was read")
    engine.refresh_parameters()
    if groups is not None:
        restore_param_groups(engine, groups)
    log.info("zeroshard: loaded DCP checkpoint %s", directory)
    return str(directory)


def _metadata(directory: Path):
    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"{directory}: not a DCP checkpoint (no .metadata file)")
    return _dcp().FileSystemReader(str(directory)).read_metadata()


def _missing(engine, entries, model_key: str, optim_key: str, with_optimizer: bool) -> list[str]:
    """What the engine needs that the checkpoint lacks or holds at another shape."""
    problems = []
    for group in engine.groups:
        for slot in group.layout.slots:
            entry = entries.get(f"{model_key}.{slot.name}")
            if entry is None:
                problems.append(f"no '{model_key}.{slot.name}'")
            elif tuple(getattr(entry, "size", ())) != tuple(slot.shape):
                problems.append(f"'{model_key}.{slot.name}' is {list(entry.size)}, the model's {list(slot.shape)}")
            if with_optimizer and group.trainable and not _state_keys(entries, optim_key, slot.name):
                problems.append(f"no optimizer state '{optim_key}.state.{slot.name}.*'")
    return problems[:8] + ([f"... {len(problems) - 8} more"] if len(problems) > 8 else [])


def _state_keys(entries, optim_key: str, name: str) -> list[str]:
    prefix = f"{optim_key}.state.{name}."
    return [key[len(prefix) :] for key in entries if key.startswith(prefix) and "." not in key[len(prefix) :]]


def _read_group(engine, group, directory, entries, model_key, optim_key, with_optimizer: bool, loaded: Loaded):
    """One group's tensors at full shape through dcp.load; this rank's slices into `loaded`."""
    slots = group.layout.slots
    state_keys = sorted(_state_keys(entries, optim_key, slots[0].name)) if with_optimizer and group.trainable else []
    request: dict = {model_key: {s.name: torch.empty(s.shape, dtype=torch.float32) for s in slots}}
    if state_keys:
        request[optim_key] = {
            "state": {
                s.name: {k: torch.empty(tuple(entries[f"{optim_key}.state.{s.name}.{k}"].size)) for k in state_keys}
                for s in slots
            }
        }
    _dcp().load(request, checkpoint_id=str(directory), process_group=engine.comm.group)
    start, end = group.opt_range
    device = group.master.device
    full = group.layout.flatten([request[model_key][s.name] for s in slots], torch.float32)
    loaded.copies.append((group.master, full[start:end].to(device)))
    if not state_keys:
        return
    state = {}
    for key in state_keys:
        values = [request[optim_key]["state"][s.name][key] for s in slots]
        if all(v.dim() == 0 for v in values):
            if any(not torch.equal(v, values[0]) for v in values):  # one scalar per flat group
                raise CheckpointError(
                    f"'{optim_key}.state.*.{key}' differs between parameters of one group: cannot load"
                )
            state[key] = values[0].clone()
        else:
            state[key] = group.layout.flatten(values, values[0].dtype)[start:end].to(device)
    loaded.states.append((group, state))


def _read_param_groups(engine, directory, entries, optim_key: str) -> list[dict]:
    """The saved hyper-parameters of each param group (non-tensor DCP entries)."""
    groups = []
    for index in range(len(engine.optimizer.param_groups)):
        prefix = f"{optim_key}.param_groups.{index}."
        keys = [k[len(prefix) :] for k in entries if k.startswith(prefix) and "." not in k[len(prefix) :]]
        if not keys:
            raise CheckpointError(f"no '{prefix}*' entries: the checkpoint's optimizer has fewer param groups")
        groups.append({k: io.BytesIO() for k in keys if k != "params"})
    request = {optim_key: {"param_groups": groups}}
    _dcp().load(request, checkpoint_id=str(directory), process_group=engine.comm.group)
    return request[optim_key]["param_groups"]
