"""The manifest of a checkpoint: what was saved, where each parameter lives, and the checks that a
checkpoint is whole and fits the model it is loaded into.

See [Note: checkpoint layout] in checkpoint/__init__.py for the directory and the key names.
"""

from __future__ import annotations

import json
import logging
import re
import types
from pathlib import Path

import torch
from torch import nn

from zeroshard.checkpoint.files import CHECKSUMS, CheckpointError, algorithm_of, dtype_name, hash_file
from zeroshard.core.optim.streamed import is_elementwise

log = logging.getLogger(__name__)

FORMAT = "zeroshard.checkpoint"
# Format versions: 1 dp-only, 2 with tp/pp parts ([Note: checkpoints across layouts] in layout.py), both
# recording files by sha256; 3 records them by XXH3 ([Note: checksums] in files.py). Every checkpoint is
# written as 3; all three are read.
FORMAT_VERSION = 3
READABLE_VERSION = 3
MANIFEST = "manifest.json"
LATEST = "latest"
OBJECTS = "objects.pt"
BUFFERS = "buffers.safetensors"
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def master_key(group_index: int) -> str:
    return f"g{group_index}/master"


def state_key(group_index: int, name: str) -> str:
    return f"g{group_index}/state/{name}"


def grad_key(group_index: int) -> str:
    return f"g{group_index}/grad"


def check_tag(tag: str) -> str:
    if not _TAG.fullmatch(tag) or tag == LATEST:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not usable as a directory name: use letters, "
            "digits and _ . + = - (not starting with '.' and not 'latest')"
        )
    return tag


# -- what the model looks like ----------------------------------------------------------------------
def model_aliases(module: nn.Module) -> dict[str, str]:
    """Second (and later) names of tied parameters -> the first name, as named_parameters() yields it."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state_dict entries that are not parameters (running stats, ...)."""
    params = {id(p) for p in module.parameters()}
    return {
        name: value
        for name, value in module.state_dict(keep_vars=True).items()
        if isinstance(value, torch.Tensor) and id(value) not in params
    }


def state_dict_order(module: nn.Module) -> list[str]:
    """Keys of `module.state_dict()` in its order (tied aliases and buffers included)."""
    return list(module.state_dict(keep_vars=True))


def describe_groups(engine, states: list[dict]) -> list[dict]:
    """One entry per flat group, in engine order: the layout every reader re-slices by. `states`:
    each group's optimizer state (common.optimizer_states)."""
    unit_of = {id(g): unit.name for unit in engine.units for g in unit.groups}
    groups = []
    for group, state in zip(engine.groups, states):
        layout = group.layout
        groups.append(
            {
                "unit": unit_of[id(group)],
                "optimizer_group": group.optimizer_group,
                "numel": layout.numel,
                "shard_numel": layout.shard_numel,
                **({"shard_counts": list(layout.counts)} if layout.counts is not None else {}),
                "params": [
                    {
                        "name": s.name,
                        "shape": list(s.shape),
                        "dtype": dtype_name(group.param_dtype),
                        "offset": s.offset,
                        "numel": s.numel,
                    }
                    for s in layout.slots
                ],
                "state": [
                    [key, "elementwise" if is_elementwise(value, group.master) else "scalar"]
                    for key, value in state.items()
                ],
            }
        )
    return groups


def manifest_text(manifest: dict) -> str:
    """JSON with one line per parameter: readable, and diffable between two checkpoints."""
    head = json.dumps({k: v for k, v in manifest.items() if k != "groups"}, indent=1)[:-2]
    groups = []
    for group in manifest["groups"]:
        fields = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in group.items() if k != "params")
        params = ",\n".join("   " + json.dumps(p) for p in group["params"])
        groups.append(f'  {{{fields}, "params": [\n{params}]}}')
    return head + ',\n "groups": [\n' + ",\n".join(groups) + "\n ]\n}\n"


# -- finding a checkpoint -----------------------------------------------------------------------------
def resolve_tag(load_dir: Path, tag) -> str | None:
    """`tag`, or the one `latest` names; None when there is no `latest` (DeepSpeed: nothing to load)."""
    if tag is not None:
        return check_tag(str(tag))
    latest = load_dir / LATEST
    if not latest.is_file():
        return None
    named = latest.read_text().strip()
    if not named:
        raise CheckpointError(f"{latest}: is empty; it should name the newest checkpoint tag")
    return check_tag(named)


def checkpoint_path(load_dir: Path, tag: str) -> Path:
    """The directory of `tag`. A save that replaced this tag and crashed between its two renames
    left the previous checkpoint as `.old-<tag>-<nonce>`: that one is used (see save.publish)."""
    path = load_dir / tag
    if path.is_dir():
        return path
    stranded = sorted(load_dir.glob(f".old-{tag}-*"), key=lambda p: p.stat().st_mtime)
    stranded = [p for p in stranded if (p / MANIFEST).is_file()]
    if stranded:
        log.warning("checkpoint %s: using %s, left by a save that was interrupted", path, stranded[-1].name)
        return stranded[-1]
    present = (
        sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        if load_dir.is_dir()
        else []
    )
    raise CheckpointError(f"{path}: no checkpoint with tag '{tag}' (tags present: {present or 'none'})")


def read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: manifest is missing; {path} is not a complete zeroshard checkpoint") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: manifest is not valid JSON ({error}): the file is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a zeroshard checkpoint manifest")
    version = manifest.get("format_version", 0)
    if isinstance(version, int) and version > READABLE_VERSION:
        raise CheckpointError(
            f"{file}: format version {manifest['format_version']} is newer than this "
            f"zeroshard ({manifest.get('library_version')} wrote it); upgrade zeroshard"
        )
    check_schema(file, manifest)
    return manifest


# -- [Note: manifest schema] ---------------------------------------------------------------------------
# The manifest is data, never code: JSON whose every field is listed here with its type. A field
# outside the schema, a required field that is missing or a value of another type is an error
# naming the file and the field, so that nothing a checkpoint carries is used without being
# understood. `None` as a type means any JSON value (informational fields, or state that is also
# in objects.pt). Fields marked optional were added after format version 1 was first written.
_JSON = None
# A group's optimizer param-group index, or null for a group no optimizer steps (frozen parameters;
# describe_groups writes FlatGroup.optimizer_group, None there).
_INDEX_OR_NULL = types.SimpleNamespace(__name__="int or null")
_MANIFEST_FIELDS = {
    "format": str,
    "format_version": int,
    "tag": str,
    "world_size": int,
    "stage": int,
    "param_dtype": str,
    "global_steps": int,
    "micro_steps": int,
    "gradient_accumulation_steps": int,
    "mid_accumulation": bool,
    "optimizer": str,
    "lr_scheduler": _JSON,
    "loss_scaler": _JSON,
    "aliases": dict,
    "buffers": list,
    "groups": list,
    "files": dict,
}
_MANIFEST_OPTIONAL = {
    "library_version": str,
    "created": str,
    "skipped_steps": int,
    "config": _JSON,
    # a part of a tp/pp checkpoint ([Note: checkpoints across layouts] in layout.py)
    "mesh": dict,
    "shards": dict,
    # MiCS: how many partition groups held the `world_size` shards ([Note:
    # checkpoints of replicated shards] in save.py); absent means 1
    "replicas": int,
}
# The top manifest of a tp/pp checkpoint: its parts, and the (dp, tp, pp) of every rank file.
_LAYOUT_FIELDS = {
    "format": str,
    "format_version": int,
    "tag": str,
    "mesh": dict,
    "parts": list,
    "shards": dict,
    "files": dict,
    "global_steps": int,
}
_LAYOUT_OPTIONAL = {"library_version": str, "created": str}
_PART_FIELDS = {"tp": int, "pp": int, "dir": str}
_MESH_DIMS = ("dp", "tp", "pp")
_GROUP_FIELDS = {
    "unit": str,
    "optimizer_group": _INDEX_OR_NULL,
    "numel": int,
    "shard_numel": int,
    "params": list,
    "state": list,
}
_GROUP_OPTIONAL = {"shard_counts": list}  # uneven slices: each rank's size ([Note: uneven slices])
_PARAM_FIELDS = {"name": str, "shape": list, "dtype": str, "offset": int, "numel": int}
_PARAM_OPTIONAL = {"tp_split_dim": _JSON}  # int, null (whole on every tp rank) or "unknown"
# a file's size and one checksum, named by its algorithm ([Note: checksums] in files.py)
_FILE_FIELDS = {"bytes": int}
_FILE_CHECKSUMS = dict.fromkeys(CHECKSUMS, str)


def check_schema(file: Path, manifest: dict) -> None:
    """Raise CheckpointError naming `file` and the field unless `manifest` fits [Note: manifest schema]."""
    if "parts" in manifest:
        return _check_layout_schema(file, manifest)
    _check_fields(file, "", manifest, _MANIFEST_FIELDS, _MANIFEST_OPTIONAL)
    if "mesh" in manifest:
        _check_grid(file, "mesh", manifest["mesh"])
    for name, coordinate in manifest.get("shards", {}).items():
        _check_grid(file, f"shards[{name!r}]", coordinate)
    for index, group in enumerate(manifest["groups"]):
        where = f"groups[{index}]"
        _check_fields(file, where, group, _GROUP_FIELDS, _GROUP_OPTIONAL)
        counts = group.get("shard_counts")
        if counts is not None and not (
            len(counts) == manifest["world_size"]
            and all(_is(c, int) and c >= 0 for c in counts)
            and sum(counts) == group["numel"]
        ):
            raise CheckpointError(
                f"{file}: field '{where}.shard_counts' must give each of the {manifest['world_size']} ranks "
                f"a size >= 0, summing to the group's numel {group['numel']}, got {counts!r}"
            )
        for number, param in enumerate(group["params"]):
            _check_fields(file, f"{where}.params[{number}]", param, _PARAM_FIELDS, _PARAM_OPTIONAL)
            split = param.get("tp_split_dim")
            if not (split is None or split == "unknown" or (_is(split, int) and 0 <= split < len(param["shape"]))):
                raise CheckpointError(
                    f"{file}: field '{where}.params[{number}].tp_split_dim' must be a dim of its "
                    f"shape {param['shape']}, null or 'unknown', got {split!r}"
                )
        for number, entry in enumerate(group["state"]):
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and isinstance(entry[0], str)
                and entry[1] in ("elementwise", "scalar")
            ):
                raise CheckpointError(
                    f"{file}: field '{where}.state[{number}]' must be [name, 'elementwise' or 'scalar'], got {entry!r}"
                )
    _check_files(file, manifest["files"])
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["aliases"].items()):
        raise CheckpointError(f"{file}: field 'aliases' must map parameter names to parameter names")
    if not all(isinstance(name, str) for name in manifest["buffers"]):
        raise CheckpointError(f"{file}: field 'buffers' must list buffer names")


def _check_layout_schema(file: Path, manifest: dict) -> None:
    _check_fields(file, "", manifest, _LAYOUT_FIELDS, _LAYOUT_OPTIONAL)
    _check_grid(file, "mesh", manifest["mesh"])
    for number, part in enumerate(manifest["parts"]):
        _check_fields(file, f"parts[{number}]", part, _PART_FIELDS)
    for name, coordinate in manifest["shards"].items():
        _check_grid(file, f"shards[{name!r}]", coordinate)
    _check_files(file, manifest["files"])


def _check_files(file: Path, files: dict) -> None:
    for name, entry in files.items():
        _check_fields(file, f"files[{name!r}]", entry, _FILE_FIELDS, _FILE_CHECKSUMS)
        if sum(algorithm in entry for algorithm in CHECKSUMS) != 1:
            raise CheckpointError(
                f"{file}: field 'files[{name!r}]' must carry exactly one checksum, one of "
                f"{', '.join(CHECKSUMS)}; got the fields {', '.join(sorted(entry))}"
            )


def _check_grid(file: Path, where: str, value) -> None:
    """{"dp": .., "tp": .., "pp": ..}: a mesh's sizes or a coordinate in it."""
    if not (isinstance(value, dict) and set(value) == set(_MESH_DIMS) and all(_is(v, int) for v in value.values())):
        raise CheckpointError(
            f"{file}: field '{where}' must map each of {', '.join(_MESH_DIMS)} to an integer, got {value!r:.80}"
        )


def is_layout(manifest: dict) -> bool:
    """The top manifest of a tp/pp checkpoint ([Note: checkpoints across layouts] in layout.py)."""
    return "parts" in manifest


def _check_fields(file: Path, where: str, value, required: dict, optional: dict | None = None) -> None:
    prefix = f"{where}." if where else ""
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: field '{where}' must be a JSON object, got {type(value).__name__}")
    allowed = {**required, **(optional or {})}
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise CheckpointError(
            f"{file}: field '{prefix}{unknown[0]}' is not part of the zeroshard manifest "
            f"schema (format version {READABLE_VERSION}); allowed here: {', '.join(allowed)}"
        )
    missing = [key for key in required if key not in value]
    if missing:
        raise CheckpointError(f"{file}: required field '{prefix}{missing[0]}' is missing: the manifest is damaged")
    for key, kind in allowed.items():
        if key in value and kind is not None and not _is(value[key], kind):
            raise CheckpointError(
                f"{file}: field '{prefix}{key}' must be {kind.__name__}, got "
                f"{type(value[key]).__name__} {value[key]!r:.60}"
            )


def _is(value, kind) -> bool:
    if kind is _INDEX_OR_NULL:
        return value is None or _is(value, int)
    if kind is int:  # JSON true/false is not a count
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_file(path: Path, name: str, expected: dict) -> str | None:
    """The problem with one file of the checkpoint, or None when it is whole."""
    file = path / name
    if not file.is_file():
        return f"{file}: file is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        shorter = "truncated" if size < expected["bytes"] else "longer than written"
        return f"{file}: {shorter}, {size} bytes on disk but {expected['bytes']} were written"
    algorithm = algorithm_of(expected)
    if hash_file(file, algorithm)[algorithm] != expected[algorithm]:
        return f"{file}: corrupted, its {algorithm} checksum does not match the manifest's"
    return None


def check_files(path: Path, manifest: dict, names=None) -> list[str]:
    files = manifest["files"]
    return [
        problem
        for name in (files if names is None else names)
        if (problem := check_file(path, name, files[name])) is not None
    ]


def check_compatible(path: Path, manifest: dict, engine_params: dict[str, list[int]], strict: bool) -> None:
    """The checkpoint's parameters (names and shapes) against the model's; raises when they differ."""
    saved = {p["name"]: p["shape"] for g in manifest["groups"] for p in g["params"]}
    missing = [n for n in engine_params if n not in saved]
    unexpected = [n for n in saved if n not in engine_params]
    reshaped = [n for n in engine_params if n in saved and list(saved[n]) != list(engine_params[n])]
    problems = []
    if reshaped:
        n = reshaped[0]
        problems.append(
            f"{len(reshaped)} parameter(s) with a different shape (e.g. '{n}': "
            f"{saved[n]} in the checkpoint, {list(engine_params[n])} in the model)"
        )
    if strict and missing:
        problems.append(f"{len(missing)} parameter(s) of the model missing from the checkpoint (e.g. {missing[:3]})")
    if strict and unexpected:
        problems.append(
            f"{len(unexpected)} parameter(s) in the checkpoint that the model does not have (e.g. {unexpected[:3]})"
        )
    if problems:
        raise CheckpointError(
            f"{path / MANIFEST}: the checkpoint is from an incompatible model: " + "; ".join(problems)
        )


class ParamIndex:
    """Where each parameter of a checkpoint lives: its group and first element in that group's buffer."""

    def __init__(self, manifest: dict):
        self.groups = manifest["groups"]
        self.where = {p["name"]: (gi, p) for gi, g in enumerate(self.groups) for p in g["params"]}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def locate(self, name: str) -> tuple[int, int]:
        group_index, param = self.where[name]
        return group_index, param["offset"]

    def state_kinds(self, name: str) -> dict[str, str]:
        group_index, _ = self.where[name]
        return dict(self.groups[group_index]["state"])
