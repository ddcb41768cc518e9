"""Cache-aware routing over the replicas serving a model (kvgate's runtime workers, vLLM, SGLang): a turn
goes where its conversation's KV is (the replica that served its latest turn, as every front sees it:
gateway/placement.py); a new conversation where its documents' KV likely is (a consistent-hash ring),
else to the replica holding the fewest conversations. A replica as loaded as `proxy.spill_at` spills the
request to the least loaded; one that does not answer is passed over, and the turn stays where it went."""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvgate.agents.conversations import canonical
from kvgate.gateway.placement import Placements

VNODES = 64  # points per worker on the ring: keys spread evenly and move little when a worker joins


def point(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode())


class Ring:
    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        points = sorted((point(f"{name}#{v}"), name) for name in names for v in range(VNODES))
        self.points = [p for p, _ in points]
        self.owners = [n for _, n in points]

    def owner(self, key: str) -> str:
        i = bisect.bisect(self.points, point(key)) % len(self.points)
        return self.owners[i]

    def preferred(self, keys: Sequence[str]) -> str | None:
        """The worker owning most of `keys` (the first key's owner breaks a tie); None without keys."""
        if not keys:
            return None
        owners = [self.owner(k) for k in keys]
        votes = Counter(owners)
        best = max(votes.values())
        return next(o for o in owners if votes[o] == best)

    def order(self, keys: Sequence[str], load: Callable[[str], int], spill_at: int) -> list[str]:
        """Every worker, best first: the preferred one unless its load is at `proxy.spill_at` or more
        (then the least loaded goes first), the rest by load as fallbacks."""
        by_load = sorted(self.names, key=load)
        first = self.preferred(keys)
        if first is None or load(first) >= spill_at and load(by_load[0]) < load(first):
            return by_load
        return [first, *(n for n in by_load if n != first)]


def conversation_key(tenant: str, body: dict[str, Any], program: str | None, affinity: Sequence[str]) -> str | None:
    """What names the conversation a request belongs to, alike on every front: its program; else its
    tenant, tools, documents (`affinity`) and messages up to the first user message, which every later
    turn resends. None: no messages to tell (a completions prompt)."""
    if program is not None:
        head: Any = ["program", program]
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
        head = [body.get("tools"), list(affinity), [said(m) for m in messages[: first + 1]]]
    named = json.dumps(["kvgate.route.v1", tenant, head], sort_keys=True, default=str)
    return hashlib.sha256(named.encode()).hexdigest()[:32]


def said(message: dict[str, Any]) -> str:
    """A message as the model reads it (call ids aside); one a proxy forwards unread may be any JSON."""
    try:
        return canonical(message)
    except (TypeError, ValueError, AttributeError):
        return json.dumps(message, sort_keys=True, default=str)


# Why a request went where it went (`kvgate_routing_decisions_total{reason}`): to its conversation's replica, to
# the one its documents hash to, to the one with the fewest conversations (a new one, or one whose replica is busy
# or gone: spilled), or in turn.
REASONS = ("conversation", "documents", "fewest", "spilled", "round_robin")


class Router:
    """Orders the replicas serving a request, best first, and remembers where each conversation went."""

    def __init__(self, names: Sequence[str], placements: Placements, spill_at: int, policy: str = "cache") -> None:
        self.ring = Ring(names)
        self.rank = {name: i for i, name in enumerate(names)}  # ties go in the configured order
        self.placements, self.spill_at, self.policy = placements, spill_at, policy
        self.turns = 0  # requests ordered: round_robin's position
        self.decisions = dict.fromkeys(REASONS, 0)

    async def order(
        self, serving: Sequence[str], key: str | None, affinity: Sequence[str], load: Callable[[str], int]
    ) -> list[str]:
        by_load = sorted(serving, key=lambda n: (load(n), self.rank[n]))
        if not by_load:
            return []
        if self.policy == "round_robin":
            self.turns += 1
            self.decisions["round_robin"] += 1
            first = serving[self.turns % len(serving)]
            return [first, *(n for n in by_load if n != first)]
        least = load(by_load[0])

        def free(name: str) -> bool:
            return load(name) < self.spill_at or load(name) <= least

        placed = await self.placements.where(key) if key else None
        preferred = self.ring.preferred(affinity)
        if placed in serving and free(placed):
            first, why = placed, "conversation"
        elif placed is None and preferred in serving and free(preferred):
            first, why = preferred, "documents"
        else:  # new, or its replica is busy or gone: the one holding the fewest conversations
            live = await self.placements.live(serving)
            first = min(serving, key=lambda n: (not free(n), live[n], load(n), self.rank[n]))
            why = "fewest" if placed is None and preferred is None else "spilled"
        self.decisions[why] += 1
        return [first, *(n for n in by_load if n != first)]

    async def served(self, key: str | None, replica: str) -> None:
        if key is not None and self.policy == "cache":
            await self.placements.place(key, replica)
