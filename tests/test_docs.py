"""The README's options table is the one generated from the schema, and the generator describes every option."""

from __future__ import annotations

import os

from orttrainer import ORTTrainerOptions
from orttrainer.schema import doc
from orttrainer.trainer.config import _UNSUPPORTED

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_options_table_is_generated_from_the_schema():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert doc.replace_table(text, doc.options_table()) == text, (
        "README.md's options table differs from the schema: run `python -m orttrainer.schema.doc --write README.md`"
    )


def test_every_option_has_a_meaning_and_no_meaning_is_stale():
    paths = [path for path, _ in doc.leaves()]
    assert sorted(paths) == sorted(doc.MEANINGS)


def test_options_that_raise_not_implemented_are_marked_not_built():
    marked = {path for path, meaning in doc.MEANINGS.items() if doc.NOT_BUILT in meaning}
    assert marked == set(_UNSUPPORTED)


def test_defaults_in_the_table_are_what_validation_fills_in():
    validated = ORTTrainerOptions({})._validated_opts
    for path, rule in doc.leaves():
        value = validated
        for key in path.split("."):
            value = value[key]
        shown = doc.describe_default(rule)
        expected = f"`{value.name}`" if hasattr(value, "name") else f"`{value!r}`"
        assert shown == expected, path


def test_table_rows_name_type_and_default():
    table = doc.options_table().splitlines()
    row = next(line for line in table if line.startswith("| `batch.gradient_accumulation_steps`"))
    assert row == (
        "| `batch.gradient_accumulation_steps` | int ≥ 1 | `1` | micro-steps per optimizer update; "
        "the update uses the mean gradient |"
    )
    assert len(table) == 2 + len(doc.MEANINGS)
