"""OpenAI's strict schemas (Structured Outputs): under `strict: true` every object is closed and every
property required. OpenAI refuses a strict schema that leaves either implicit (no `additionalProperties:
false`, a property not listed in `required`); vLLM accepts it and ignores `strict`. kvgate gives it the
strict meaning instead: what the model writes then satisfies the schema as sent and OpenAI's reading of it
alike, and a framework that sends pydantic's schemas as strict (smolagents) gets closed objects rather
than a 400 or an object the model never stops adding keys to. A strict schema that says otherwise
(`additionalProperties` true, or a schema of its own) is refused, as OpenAI refuses it."""

from __future__ import annotations

from typing import Any

SUBSCHEMAS = ("items", "not", "contains", "additionalItems")  # a schema each
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # a list of schemas each
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")  # a name -> schema map each


class NotStrict(ValueError):
    """A schema sent as strict that contradicts strict: where, and why."""


def is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def strict(schema: Any, where: str = "") -> Any:
    """`schema` with every object closed and every property required (a copy; the caller's is untouched)."""
    if isinstance(schema, list):
        return [strict(s, f"{where}.{i}") for i, s in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMAS:
        if key in out:
            out[key] = strict(out[key], f"{where}.{key}")
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = strict(out[key], f"{where}.{key}")
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict(s, f"{where}.{key}.{name}") for name, s in out[key].items()}
    if is_object(out):
        if out.get("additionalProperties", False) is not False:
            raise NotStrict(f"{where or 'the schema'}: additionalProperties must be false in a strict schema")
        out["additionalProperties"] = False
        out["required"] = list(dict.fromkeys([*(out.get("required") or []), *(out.get("properties") or {})]))
    return out
