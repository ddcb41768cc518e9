"""The items of kept responses, as OpenAI keeps them: every input item gets an id when its response is
kept (one it came with stays), an `item_reference` in the input is the kept item it names (unknown,
expired, unkept or another tenant's: a 404 naming it), and GET /v1/responses/{id}/input_items lists a
response's input items a page at a time. An input that refers to, or carries, kept items continues the
chain of the latest of them: its agent program, whose KV the next turn reuses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.gateway.errors import APIError, bad_request
from kvgate.gateway.responses_output import new_id
from kvgate.gateway.responses_protocol import DROPPED, unsupported
from kvgate.gateway.responses_store import ResponseStore

REFERENCE = "item_reference"
PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
MAX_ID = 256  # characters: an id is a key in the store
LIMIT, MAX_LIMIT = 20, 100
ORDERS = ("asc", "desc")


@dataclass(frozen=True)
class Input:
    """A request's input items, each reference replaced by the item it names; and the program of the chain
    of the latest kept item among them (None: none is kept)."""

    items: list[dict[str, Any]]
    program: str | None


async def resolved(store: ResponseStore, tenant: str, given: str | list[dict[str, Any]]) -> Input:
    """The input with its references resolved, in one lookup of every id it holds."""
    if isinstance(given, str):
        return Input([{"role": "user", "content": given}], None)
    ids = [item_id for _, item_id in carried(given)]
    found = dict(zip(ids, await store.held(tenant, ids), strict=True)) if ids else {}
    items = []
    for n, item in enumerate(given):
        if is_reference(item):
            held = found[item["id"]]
            if held is None:
                raise APIError(404, f"Item with id '{item['id']}' not found.", f"input.{n}.id", "item_not_found")
            item = held.item
        items.append(item)
    latest = next((held for i in reversed(ids) if (held := found[i]) is not None), None)
    return Input(items, None if latest is None else latest.program)


def is_reference(item: dict[str, Any]) -> bool:
    """An `item_reference` (its type may be left out: an item of an id alone)."""
    kind = item.get("type")
    return kind == REFERENCE or (kind is None and "role" not in item and "id" in item)


def carried(items: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The ids the input's items carry, by index: each a string, at most once."""
    seen: dict[str, int] = {}
    for n, item in enumerate(items):
        item_id, at = item.get("id"), f"input.{n}.id"
        if item_id is None:
            if is_reference(item):
                raise bad_request(f"missing required field '{at}'", at, "missing_field")
            continue
        if not isinstance(item_id, str) or not 0 < len(item_id) <= MAX_ID:
            raise bad_request(f"'{at}' must be a string of 1 to {MAX_ID} characters", at, "invalid_value")
        if item_id in seen:
            raise bad_request(f"Duplicate item found with id '{item_id}'.", at, "duplicate_item")
        seen[item_id] = n
    return [(n, item_id) for item_id, n in seen.items()]


def kept(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as their response keeps and lists them: each with its id and its type, a message's
    text as a part (reasoning, which kvgate drops, is not kept)."""
    return [with_id(item) for item in items if item.get("type", "message") not in DROPPED]


def with_id(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    out = {**item, "id": item.get("id") or new_id(PREFIXES[kind]), "type": kind}
    out.setdefault("status", "completed")
    if kind == "message" and isinstance(item.get("content"), str):
        part = {"type": "output_text", "annotations": []} if item.get("role") == "assistant" else {"type": "input_text"}
        out["content"] = [{**part, "text": item["content"]}]
    return out


# ---- GET /v1/responses/{id}/input_items -----------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    limit: int
    order: str
    after: str | None


def listing(query: Mapping[str, str], include: list[str]) -> Listing:
    """The list's query (`include`: its values, however spelled), a 400 naming what is wrong."""
    if any(include):
        raise unsupported(f"include values are not supported: {', '.join(include)}", "include")
    try:
        limit = int(query.get("limit") or LIMIT)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}", "limit", "invalid_value")
    order = query.get("order") or "desc"
    if order not in ORDERS:
        raise bad_request("order must be one of asc, desc", "order", "invalid_value")
    return Listing(limit, order, query.get("after") or None)


def page(items: list[dict[str, Any]], asked: Listing) -> dict[str, Any]:
    """OpenAI's list of `asked.limit` items in `asked.order`, after the item `asked.after`."""
    ordered = items if asked.order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = 0
    if asked.after is not None:
        if asked.after not in ids:
            said = f"No input item with id '{asked.after}' in this response."
            raise bad_request(said, "after", "invalid_value")
        start = ids.index(asked.after) + 1
    data = ordered[start : start + asked.limit]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    more = start + asked.limit < len(ordered)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}
