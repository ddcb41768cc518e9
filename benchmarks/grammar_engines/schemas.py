"""The grammars under test, their prompts, the probe strings, and how an output is checked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

ITEM_SEP, KEY_SEP = ", ", ": "  # json.dumps' and HF chat templates' tojson defaults
TOOL_OPEN, TOOL_CLOSE = "<tool_call>\n", "\n</tool_call>"

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "price": {"type": "number", "minimum": 0, "maximum": 500},
                    "note": {"type": "string", "maxLength": 30},
                },
                "required": ["sku", "price"],
                "additionalProperties": False,
            },
        },
        "deliver": {
            "anyOf": [
                {"type": "string", "enum": ["standard", "express"]},
                {"type": "integer", "minimum": 1, "maximum": 7},
                {"type": "null"},
            ]
        },
    },
    "required": ["items", "deliver"],
    "additionalProperties": False,
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
TOOL_CALL: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

_TOOL_SYSTEM = (
    "You can call the tool get_weather(city: string, days: integer 1-14, unit: 'c' or 'f'). To call it, reply "
    'with <tool_call>\n{"name": "get_weather", "arguments": {...}}\n</tool_call>'
)


@dataclass(frozen=True)
class Spec:
    key: str
    title: str
    kind: str  # "json" | "tool_call" | "tool_calls"
    schema: dict[str, Any]  # what the JSON part must validate against
    system: str
    user: str
    generate: bool = True


SPECS: list[Spec] = [
    Spec(
        "a",
        "function args",
        "json",
        WEATHER,
        "Reply with the JSON arguments of get_weather(city: string, days: integer 1-14, unit: 'c' or 'f').",
        "What will the weather be in Lisbon for the next 5 days, in celsius?",
    ),
    Spec(
        "b",
        "nested object",
        "json",
        ORDER,
        'Reply with a JSON order: {"items": [{"sku": "AB-123", "price": 9.5, "note": "..."}], "deliver": '
        '"standard" | "express" | days (1-7) | null}.',
        "Order two notebooks (sku NB-101, 3.99 each) and a pen (sku PN-007, 1.50), express delivery.",
    ),
    Spec(
        "c",
        "any JSON object",
        "json",
        ANY_OBJECT,
        "Reply with a JSON object only.",
        "Describe the city of Paris in a small JSON object with three short keys.",
    ),
    Spec("d", "tool-call wrapper", "tool_call", TOOL_CALL, _TOOL_SYSTEM, "Weather in Lisbon for 5 days in celsius?"),
    Spec("e", "parallel tool calls", "tool_calls", TOOL_CALL, _TOOL_SYSTEM, "", generate=False),
]


def dumps(obj: Any, compact: bool) -> str:
    seps = (",", ":") if compact else (ITEM_SEP, KEY_SEP)
    return json.dumps(obj, separators=seps, ensure_ascii=False)


def call_text(args: dict[str, Any], compact: bool) -> str:
    return TOOL_OPEN + dumps({"name": "get_weather", "arguments": args}, compact) + TOOL_CLOSE


def check(spec: Spec, text: str, compact: bool) -> tuple[bool, bool]:
    """(valid, canonical): the JSON validates; json.dumps with the engine's separators gives back the text."""
    body = text
    if spec.kind == "tool_call":
        if not (text.startswith(TOOL_OPEN) and text.endswith(TOOL_CLOSE)):
            return False, False
        body = text[len(TOOL_OPEN) : -len(TOOL_CLOSE)]
    try:
        obj = json.loads(body)
        jsonschema.validate(obj, spec.schema)
    except (ValueError, jsonschema.ValidationError):
        return False, False
    return True, dumps(obj, compact) == body


# The probes whose answer is a formatting choice of the engine, not the schema's.
FORMATTING = ("spaced", "compact", "indented", "2 calls, other separators")


def probe(got: bool, want: bool, name: str) -> str:
    """yes / no; "!" marks a disagreement with the schema (not for the formatting probes: those are a choice)."""
    return ("yes" if got else "no") + ("!" if got != want and name not in FORMATTING else "")


def acceptance_cases(spec: Spec, compact: bool) -> dict[str, tuple[str, bool]]:
    """Probe strings: name -> (text, should the schema accept it). "spaced" and "compact" show which formatting
    the grammar takes; the others are written in the engine's own formatting (`compact`), so that a rejection is
    the schema's doing, not the separators'."""
    args = {"city": "Lisbon", "days": 5, "unit": "c"}
    bad = {"city": "Lisbon", "days": 30, "unit": "c"}
    if spec.key == "a":
        return {
            "spaced": (dumps(args, False), True),
            "compact": (dumps(args, True), True),
            "indented": (json.dumps(args, indent=1), True),
            "days=30": (dumps(bad, compact), False),
            "days=0": (dumps({**args, "days": 0}, compact), False),
        }
    if spec.key == "b":
        good = {"items": [{"sku": "NB-101", "price": 3.99, "note": "x"}], "deliver": "express"}

        def order(deliver: Any, **item: Any) -> str:
            return dumps({"items": [{"sku": "NB-101", "price": 1, **item}], "deliver": deliver}, compact)

        return {
            "spaced": (dumps(good, False), True),
            "compact": (dumps(good, True), True),
            "price>500": (order(None, price=900), False),
            "bad sku": (order(2, sku="nb-1"), False),
            "note>30": (order(2, note="x" * 31), False),
            "5 items": (dumps({"items": [{"sku": "NB-101", "price": 1}] * 5, "deliver": 2}, compact), False),
            "deliver=9": (order(9), False),
        }
    if spec.key == "c":
        obj = {"a": [1, {"b": None}], "c": "x\u00e9"}
        deep = {"a": {"b": {"c": {"d": {"e": 1}}}}}
        return {
            "spaced": (dumps(obj, False), True),
            "compact": (dumps(obj, True), True),
            "5 levels deep": (dumps(deep, compact), True),
            "array": ("[1, 2]", False),
        }
    if spec.key == "d":
        return {
            "spaced": (call_text(args, False), True),
            "compact": (call_text(args, True), True),
            "days=30": (call_text(bad, compact), False),
        }
    other = {"city": "Porto", "days": 2, "unit": "f"}
    return {
        "1 call": (call_text(args, compact), True),
        "2 calls": (call_text(args, compact) + "\n" + call_text(other, compact), True),
        "2 calls, other separators": (call_text(args, not compact) + "\n" + call_text(other, not compact), True),
        "2nd bad": (call_text(args, compact) + "\n" + call_text(bad, compact), False),
    }
