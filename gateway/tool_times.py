"""Tool durations pooled by every replica on one Redis (agents/predictor.py `SharedTools`), so a replica
pins a program's KV for as long as that tenant's tools take anywhere, not only where it has seen them.

Per tenant (its digest, one hash slot): a list per tool of its latest `window` durations, a sorted set
of its tools by last use (the newest `max_tools` kept, and "every tool" always), and a hash counting which
call followed which (at most `MAX_FOLLOWS` pairs; beyond, it starts over). Each key lives `ttl_s`
after its tenant's latest return. Called off the event loop (at a turn's end): a blocking client."""

from __future__ import annotations

import hashlib
import json
import time

from kvgate.agents.predictor import ANY, Follows, Seen
from kvgate.gateway.redis_state import connect_blocking

PREFIX = "kvgate:tools:"
MAX_FOLLOWS = 4096
TTL_S = 86400.0


class RedisToolTimes:
    def __init__(
        self, url: str, window: int = 512, max_tools: int = 256, ttl_s: float = TTL_S, prefix: str = PREFIX
    ) -> None:
        self.window, self.max_tools, self.ttl, self.prefix = window, max_tools, max(1, round(ttl_s)), prefix
        self.redis = connect_blocking(url)

    def base(self, tenant: str) -> str:
        return f"{self.prefix}{{{hashlib.sha256(tenant.encode()).hexdigest()[:24]}}}:"

    def exchange(self, seen: dict[str, Seen]) -> dict[str, tuple[dict[str, list[float]], Follows]]:
        now, pipe, reads = time.time(), self.redis.pipeline(transaction=False), {}
        for tenant, mine in seen.items():
            base = self.base(tenant)
            for tools, seconds in mine.returns:
                for tool in {*tools, ANY}:
                    pipe.lpush(base + "d:" + tool, seconds)
                    pipe.ltrim(base + "d:" + tool, 0, self.window - 1)
                    pipe.expire(base + "d:" + tool, self.ttl)
                    if tool != ANY:  # every tool pooled: never dropped
                        pipe.zadd(base + "names", {tool: now})
            for before, after in mine.follows:
                pipe.hincrby(base + "f", json.dumps([before, after]), 1)
            reads[tenant] = len(pipe)  # where this tenant's six replies start
            pipe.zrange(base + "names", 0, -(self.max_tools + 1))  # beyond the newest max_tools
            pipe.zremrangebyrank(base + "names", 0, -(self.max_tools + 1))
            pipe.zrange(base + "names", 0, -1)
            pipe.hgetall(base + "f")
            for name in ("names", "f"):
                pipe.expire(base + name, self.ttl)
        found = pipe.execute()
        reading, pooled = self.redis.pipeline(transaction=False), {}
        for tenant, at in reads.items():
            base = self.base(tenant)
            dropped, _, names, pairs, _, _ = found[at : at + 6]
            for name in dropped:
                reading.delete(base + "d:" + name.decode())
            if len(pairs) > MAX_FOLLOWS:
                reading.delete(base + "f")
            tools = [ANY, *(name.decode() for name in names)]
            for tool in tools:
                reading.lrange(base + "d:" + tool, 0, -1)
            follows = [(tuple(b), tuple(a), int(n)) for (b, a), n in ((json.loads(k), v) for k, v in pairs.items())]
            pooled[tenant] = (tools, follows)
        lists = [r for r in reading.execute() if isinstance(r, list)]
        out, at = {}, 0
        for tenant, (tools, follows) in pooled.items():
            durations = {tool: [float(x) for x in reversed(lists[at + j])] for j, tool in enumerate(tools)}
            out[tenant], at = (durations, follows), at + len(tools)
        return out

    def close(self) -> None:
        self.redis.close()
