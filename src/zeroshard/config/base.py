"""What every config section shares: the base model, the number types, name matching.

Class-level tables read by the parser (they are data, not behaviour):

- ``section_path``: where the section sits in the JSON (for messages and warnings).
Keys accepted but not acted on are not declared here but in one table (``not_acted_on.py``).
- ``auto_keys``: keys for which the value ``"auto"`` means "not given" (see [Note: "auto" values]).
- ``sections``: nested keys whose value is itself a section model.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

# [Note: "auto" values]
# The Hugging Face Trainer writes "auto" for keys it fills from its own arguments (batch sizes,
# gradient_accumulation_steps, gradient_clipping, optimizer lr/betas/eps/weight_decay, scheduler
# warmup/total steps, fp16/bf16 enabled, three ZeRO bucket sizes) and replaces them before DeepSpeed
# sees the config. When zeroshard still sees "auto" nothing has filled it, so for exactly those keys
# "auto" means "not given": the DeepSpeed default (or the batch-size derivation) applies. "auto" for
# any other key, or for a key that is required, is an error.


def _reject_bool(value: Any) -> Any:
    # JSON true/false would otherwise pass as 1/0 for an integer or float field.
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    return value


NonNegInt = Annotated[int, BeforeValidator(_reject_bool), Field(ge=0)]
PosInt = Annotated[int, BeforeValidator(_reject_bool), Field(gt=0)]
NonNegFloat = Annotated[float, BeforeValidator(_reject_bool), Field(ge=0.0)]
PosFloat = Annotated[float, BeforeValidator(_reject_bool), Field(gt=0.0)]
Fraction = Annotated[float, BeforeValidator(_reject_bool), Field(ge=0.0, le=1.0)]
OpenFraction = Annotated[float, BeforeValidator(_reject_bool), Field(gt=0.0, lt=1.0)]
LrValue = NonNegFloat | list[NonNegFloat]


def canonical_name(value: Any, allowed: tuple[str, ...], what: str) -> str:
    """Match ``value`` case-insensitively against ``allowed`` and return the canonical spelling."""
    for name in allowed:
        if isinstance(value, str) and value.lower() == name.lower():
            return name
    raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")


class Section(BaseModel):
    """Base of every config section: immutable, no unknown fields, docstrings become descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    section_path: ClassVar[str] = ""
    auto_keys: ClassVar[frozenset[str]] = frozenset()
    sections: ClassVar[dict[str, type[Section]]] = {}
