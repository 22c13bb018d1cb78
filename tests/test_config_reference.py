"""docs/config_reference.md is what `python -m zeroshard.tools.config_reference` writes from the schema."""

from pathlib import Path

from zeroshard.config.not_acted_on import TABLE
from zeroshard.tools import config_reference
from zeroshard.tools.deepspeed_defaults import DEFAULTS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config_reference.md"


def test_committed_page_is_what_the_generator_writes():
    assert PAGE.read_text(encoding="utf-8") == config_reference.render(), (
        "docs/config_reference.md is stale: run `python -m zeroshard.tools.config_reference > docs/config_reference.md`"
    )


def test_every_schema_key_and_not_acted_on_key_is_on_the_page():
    page = config_reference.render()
    for section in config_reference.sections():
        for name in section.model.model_fields:
            if name not in getattr(section.model, "internal_keys", ()) and name != "params":  # params: own tables
                key = f"{section.path}.{name}".lstrip(".")
                assert f"`{name}`" in page or f"## `{key}`" in page, key
    for key in TABLE:
        assert f"`{key.rpartition('.')[2]}`" in page or f"`{key}`" in page, key


def test_deepspeed_default_shown_where_it_differs_and_blank_where_equal():
    rows = {line.split(" | ")[0]: line for line in config_reference.render().splitlines() if line.startswith("| `")}
    assert DEFAULTS["zero_optimization.stage3_prefetch_bucket_size"] == 50_000_000
    assert "| `1` | `50000000` |" in rows["| `stage3_prefetch_bucket_size`"]
    assert "| `1000` |  |" in rows["| `loss_scale_window`"]  # equal defaults leave the column blank
    assert '| `"fail_stop"` | — |' in rows["| `transactional_step`"]  # zeroshard's own key


def test_describe_type_names_bounds_and_choices():
    from typing import Literal

    from zeroshard.config.base import NonNegInt

    assert config_reference.describe_type(Literal["a", "b"]) == 'one of `"a"`, `"b"`'
    assert config_reference.describe_type(NonNegInt | None) == "integer ≥ 0 or null"
