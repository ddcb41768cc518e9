"""gateway/strict.py: a schema sent with `strict: true` gets OpenAI's strict meaning (every object closed,
every property required) wherever objects nest; one that contradicts strict is refused, naming where."""

from __future__ import annotations

import pytest

from kvgate.gateway.strict import NotStrict, strict

PERSON = {  # as pydantic writes a model with an optional field and a nested model: open objects
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "default": 0},
        "home": {"$ref": "#/$defs/Address"},
        "pets": {"type": "array", "items": {"type": "object", "properties": {"kind": {"type": "string"}}}},
        "nick": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"short": {"type": "string"}}}]},
    },
    "required": ["name"],
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def objects(schema: object) -> list[dict]:
    """Every object schema within `schema`."""
    found = []
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            found.append(schema)
        for value in schema.values():
            found += objects(value)
    elif isinstance(schema, list):
        for value in schema:
            found += objects(value)
    return found


def test_every_object_is_closed_and_every_property_required_wherever_it_nests() -> None:
    closed = strict(PERSON)
    assert len(objects(closed)) == 4  # the root, the address, a pet, a nickname
    for each in objects(closed):
        assert each["additionalProperties"] is False and each["required"] == list(each["properties"])
    assert closed["required"] == ["name", "age", "home", "pets", "nick"]
    assert "additionalProperties" not in PERSON and PERSON["required"] == ["name"]  # the caller's is untouched


@pytest.mark.parametrize("extra", [True, {"type": "string"}])
def test_a_strict_schema_that_opens_an_object_is_refused_naming_where(extra: object) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "object", "additionalProperties": extra}}}
    with pytest.raises(NotStrict, match=r"^schema\.properties\.tags: additionalProperties must be false"):
        strict(schema, "schema")


def test_what_is_not_an_object_is_left_as_it_is() -> None:
    assert strict({"type": "array", "items": {"type": "string"}}) == {"type": "array", "items": {"type": "string"}}
    assert strict({"enum": ["a", "b"]}) == {"enum": ["a", "b"]}
