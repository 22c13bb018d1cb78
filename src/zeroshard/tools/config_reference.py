"""The config reference page, generated from the schema: every key, its type and allowed values,
zeroshard's default, DeepSpeed's where it differs, and whether zeroshard acts on it.

    python -m zeroshard.tools.config_reference > docs/config_reference.md

The sources are the section models (`zeroshard.config.schema`, their field docstrings included), the
table of keys accepted but not acted on (`zeroshard.config.not_acted_on.TABLE`) and DeepSpeed's
defaults as recorded in `zeroshard.tools.deepspeed_defaults`. `tests/test_config_reference.py` and the
strict docs build fail when the committed page differs from what this writes.
"""

from __future__ import annotations

import itertools
import json
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import annotated_types
from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from zeroshard.config.base import Section
from zeroshard.config.not_acted_on import TABLE
from zeroshard.config.parse import ZeroShardConfig
from zeroshard.config.schema import ZeroConfig
from zeroshard.tools.deepspeed_defaults import DEFAULTS as DS_DEFAULTS, VERSION as DS_VERSION

REMOVED = "removed"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class SectionDoc:
    """One table of the page: a section model and where it sits in the JSON."""

    path: str  # the JSON path, e.g. "zero_optimization.offload_param"; "" for the top level
    model: type[Section]
    types: tuple[str, ...] = ()  # optimizer/scheduler params: the `type` values this table is for
    description: str = ""

    @property
    def ds_prefix(self) -> str:
        # deepspeed_defaults keys typed params as "optimizer[Adam].params"
        if self.types:
            head, _, tail = self.path.partition(".")
            return f"{head}[{self.types[0]}].{tail}"
        return self.path

    @property
    def title(self) -> str:
        if not self.path:
            return "Top level"
        kinds = f" (type {', '.join(self.types)})" if self.types else ""
        return f"`{self.path}`{kinds}"


def sections(model: type[Section] = ZeroShardConfig, path: str = "", description: str = "") -> Iterator[SectionDoc]:
    """Every section under `model`, depth first in field order."""
    yield SectionDoc(path, model, description=description)
    for name, field in model.model_fields.items():
        child = _section_type(field)
        child_path = f"{path}.{name}" if path else name
        if child is not None:
            yield from sections(child, child_path, field.description or "")
        elif name == "params" and hasattr(model, "params_by_type"):
            by_class: dict[type[Section], list[str]] = {}
            for kind, params in model.params_by_type.items():
                by_class.setdefault(params, []).append(kind)
            for params, kinds in by_class.items():
                yield SectionDoc(child_path, params, tuple(kinds), params.__doc__ or "")


def _section_type(field: FieldInfo) -> type[Section] | None:
    args = typing.get_args(field.annotation) or (field.annotation,)
    found = [a for a in args if isinstance(a, type) and issubclass(a, Section)]
    return found[0] if len(found) == 1 and field.annotation is not None and _is_plain_section(args) else None


def _is_plain_section(args: tuple[Any, ...]) -> bool:
    return all(a is type(None) or (isinstance(a, type) and issubclass(a, Section)) for a in args)


# --- one row ---------------------------------------------------------------------------------------


def describe_type(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """`int` with `Ge(0)` -> "integer ≥ 0"; Literal -> "one of ..."; unions joined by "or"."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return describe_type(args[0], list(args[1:]))
    if origin is typing.Literal:
        text = "one of " + ", ".join(f"`{json.dumps(a)}`" for a in args)
    elif origin in (typing.Union, types.UnionType):
        text = " or ".join(describe_type(a) for a in args)
    elif origin is list:
        text = f"list of {describe_type(args[0])}"
    elif origin is tuple:
        text = "pair of " + describe_type(args[0]) if len(set(args)) == 1 and len(args) == 2 else f"tuple of {args}"
    else:
        text = _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))
    bounds = [_bound(m) for meta in metadata for m in (meta.metadata if isinstance(meta, FieldInfo) else [meta])]
    return " ".join([text, *(b for b in bounds if b)])


_SCALARS = {int: "integer", float: "number", bool: "boolean", str: "string", type(None): "null"}


def _bound(meta: Any) -> str:
    for cls, attr, sign in (
        (annotated_types.Ge, "ge", "≥"),
        (annotated_types.Gt, "gt", ">"),
        (annotated_types.Le, "le", "≤"),
        (annotated_types.Lt, "lt", "<"),
    ):
        if isinstance(meta, cls):
            return f"{sign} {getattr(meta, attr)}"
    return ""


def _json(value: Any) -> str:
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def _names(name: str, field: FieldInfo) -> tuple[str, ...]:
    alias = field.validation_alias
    return tuple(str(n) for n in alias.choices) if isinstance(alias, AliasChoices) else (name,)


def _default(section: SectionDoc, name: str, field: FieldInfo) -> str:
    if not section.path and name in _BATCH_KEYS:
        return "derived (below)"
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    return _json(field.get_default(call_default_factory=True))


def _deepspeed_default(section: SectionDoc, names: tuple[str, ...], field: FieldInfo) -> str:
    """DeepSpeed's default where it differs from ours; "" where equal; "—" where none is recorded."""
    key = next(
        (
            f"{section.ds_prefix}.{n}".lstrip(".")
            for n in names
            if f"{section.ds_prefix}.{n}".lstrip(".") in DS_DEFAULTS
        ),
        None,
    )
    if key is None:
        return "—"
    theirs = DS_DEFAULTS[key]
    if theirs == REMOVED:
        return f"removed in {DS_VERSION}"
    ours = field.get_default(call_default_factory=True) if field.default is not PydanticUndefined else None
    if isinstance(theirs, dict):
        return "; ".join(f"{_json(value)} at {where}" for where, value in theirs.items())
    return "" if _same(ours, theirs) else _json(theirs)


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, tuple) or isinstance(theirs, tuple):
        return list(ours or ()) == list(theirs or ())
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return ours is theirs
    return ours == theirs


def _acted_on(key: str) -> str:
    rule = TABLE.get(key)
    if rule is None:
        return "yes"
    return f"no: {rule.why}" if rule.when is None else f"depends: {rule.why}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rows(section: SectionDoc) -> Iterator[str]:
    internal: frozenset[str] = getattr(section.model, "internal_keys", frozenset())
    for name, field in section.model.model_fields.items():
        if (
            name in internal
            or _section_type(field) is not None
            or (name == "params" and section.model is not ZeroShardConfig and hasattr(section.model, "params_by_type"))
        ):
            continue
        names = _names(name, field)
        key = f"{section.path}.{name}" if section.path else name
        also = f" (also `{'`, `'.join(n for n in names if n != name)}`)" if len(names) > 1 else ""
        auto = ', or `"auto"`' if name in section.model.auto_keys else ""
        cells = [
            f"`{name}`{also}",
            describe_type(field.annotation, field.metadata) + auto,
            _default(section, name, field),
            _deepspeed_default(section, names, field),
            _acted_on(key),
            field.description or "",
        ]
        yield "| " + " | ".join(_cell(c) for c in cells) + " |"


# --- the page --------------------------------------------------------------------------------------

HEADER = f"""# Config reference

<!-- Generated by `python -m zeroshard.tools.config_reference > docs/config_reference.md`; do not edit. -->

Every key of the DeepSpeed JSON config that zeroshard reads, generated from the schema
(`zeroshard.config.schema`) and the one table of keys accepted but not acted on
(`zeroshard.config.not_acted_on`). A test and the strict docs build fail when this page differs from
what the generator writes.

How a config is read ([configuration](configuration.md)): a key nobody knows is an error naming the
closest valid key; a bad value is an error naming the key, the value and what is allowed; a key
DeepSpeed knows but zeroshard does not act on is accepted with one `ConfigKeyNotActedOnWarning`
naming it. Keys that accept `"auto"` (written by the Hugging Face Trainer) treat it as "not given".

Columns: **default** is zeroshard's; **DeepSpeed {DS_VERSION}** is DeepSpeed's default where it differs
(blank where it is the same; — where DeepSpeed has no such key or no recorded default, as for
zeroshard's own keys); **acted on** is "yes", "no" (accepted, and reported once when set), or
"depends" (not acted on, and reported, in the configurations the reason names). DeepSpeed's defaults are read from its config
classes by `scripts/record_deepspeed_defaults.py` into `zeroshard.tools.deepspeed_defaults`.

The batch sizes are resolved as DeepSpeed resolves them: `train_batch_size` =
`train_micro_batch_size_per_gpu` × `gradient_accumulation_steps` × world size; any two given derive
the third; only `train_batch_size` gives accumulation 1; only the micro batch gives accumulation 1;
only the accumulation steps, or nothing, gives micro batch 1.
"""

TOP_LEVEL = "Keys of the JSON object itself; each section below is a key of it (or of its parent section)."

TABLE_HEAD = "| key | type | default | DeepSpeed {v} | acted on | meaning |\n|---|---|---|---|---|---|"


def _unparsed_section() -> str:
    by_why: dict[str, list[str]] = {}
    for key, rule in TABLE.items():
        if not rule.parsed:
            by_why.setdefault(rule.why, []).append(key)
    lines = [
        "## Accepted without validation, not acted on",
        "",
        "Any value is accepted for these DeepSpeed keys, and each present key is reported once.",
        "",
        "| keys | why |",
        "|---|---|",
    ]
    lines += [f"| {', '.join(f'`{k}`' for k in keys)} | {_cell(why)} |" for why, keys in by_why.items()]
    return "\n".join(lines)


def _known_keys() -> set[str]:
    known = {key for key in TABLE}
    for section in sections():
        prefixes = [section.ds_prefix.replace(f"[{section.types[0]}]", f"[{t}]") for t in section.types] or [
            section.path
        ]
        for name, field in section.model.model_fields.items():
            for n, prefix in itertools.product(_names(name, field), prefixes):
                known.add(f"{prefix}.{n}".lstrip("."))
    return known


def _unknown_deepspeed_keys() -> str:
    known = _known_keys()
    legacy = {f"zero_optimization.{k}" for k in ZeroConfig.legacy_offload_keys}
    missing = [k for k, v in DS_DEFAULTS.items() if k not in known and k not in legacy and v != REMOVED]
    removed = [k for k, v in DS_DEFAULTS.items() if v == REMOVED and k not in known]
    lines = [
        f"## DeepSpeed {DS_VERSION} keys zeroshard does not accept",
        "",
        "Keys with a default in DeepSpeed's config classes that this schema and the table above do not name:",
        "a config that sets one fails with an unknown-key error. Optimizer parameters of DeepSpeed's",
        "FusedAdam and torch's SGD that zeroshard does not take are listed with their type.",
        "",
    ]
    lines += [f"- `{k}`" for k in missing] or ["- none"]
    if removed:
        lines += [
            "",
            f"Removed in DeepSpeed {DS_VERSION} and unknown to zeroshard: {', '.join(f'`{k}`' for k in removed)}.",
        ]
    return "\n".join(lines)


def render() -> str:
    """The whole page, as committed in docs/config_reference.md."""
    parts = [HEADER]
    for section in sections():
        parts.append(f"## {section.title}\n")
        text = " ".join((section.description or section.model.__doc__ or "").split()) if section.path else TOP_LEVEL
        if text:
            parts.append(text + "\n")
        if section.path in TABLE:
            parts.append(f"Acted on: {_acted_on(section.path)}.\n")
        parts.append(TABLE_HEAD.format(v=DS_VERSION))
        parts.extend(rows(section))
        parts.append("")
    parts.append(_unparsed_section())
    parts.append("")
    parts.append(_unknown_deepspeed_keys())
    return "\n".join(parts) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
