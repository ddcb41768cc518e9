"""Responses kept for `previous_response_id` and GET /v1/responses/{id}: in this process, bounded
(the least recently used go beyond `max_count`; each is gone `ttl_s` after it was written), each its
tenant's alone. Each holds its conversation as chat messages, and the agent program of its chain."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_COUNT = 4096
TTL_S = 3600.0


@dataclass
class Stored:
    response: dict[str, Any]  # the Response object as it was sent
    messages: list[dict[str, Any]]  # the conversation as chat messages: every input, then this output
    program: str | None  # the agent program of its chain: the next turn continues its KV
    written: float = 0.0
    items: tuple[str, ...] = field(default=())  # its output items' ids

    @property
    def id(self) -> str:
        return self.response["id"]


class ResponseStore:
    def __init__(
        self, max_count: int = MAX_COUNT, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_count, self.ttl_s, self.clock = max_count, ttl_s, clock
        self.entries: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self.owners: dict[tuple[str, str], str] = {}  # (tenant, output item id) -> response id

    def put(self, tenant: str, stored: Stored) -> None:
        stored.written = self.clock()
        stored.items = tuple(i["id"] for i in stored.response["output"] if isinstance(i.get("id"), str))
        self.entries[(tenant, stored.id)] = stored
        self.entries.move_to_end((tenant, stored.id))
        self.owners |= {(tenant, item): stored.id for item in stored.items}
        while self.entries and (len(self.entries) > self.max_count or self.expired(next(iter(self.entries.values())))):
            self.drop(next(iter(self.entries)))

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's response (None: unknown, expired, or another tenant's)."""
        key = (tenant, response_id)
        stored = self.entries.get(key)
        if stored is None:
            return None
        if self.expired(stored):
            self.drop(key)
            return None
        self.entries.move_to_end(key)
        return stored

    def expired(self, stored: Stored) -> bool:
        return self.clock() - stored.written > self.ttl_s

    def owner(self, tenant: str, item_ids: Iterable[str]) -> Stored | None:
        """The latest of the tenant's responses that wrote one of these output items."""
        for item in reversed(list(item_ids)):
            response_id = self.owners.get((tenant, item))
            if response_id is not None and (found := self.get(tenant, response_id)) is not None:
                return found
        return None

    def delete(self, tenant: str, response_id: str) -> bool:
        if (tenant, response_id) not in self.entries:
            return False
        self.drop((tenant, response_id))
        return True

    def drop(self, key: tuple[str, str]) -> None:
        stored = self.entries.pop(key)
        for item in stored.items:
            self.owners.pop((key[0], item), None)

    def __len__(self) -> int:
        return len(self.entries)
