"""Redis as the fronts share it (keys, tenant secret, responses, placements): one way to connect, and
what counts as an outage."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ClusterDownError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

TIMEOUT_S = 0.5  # a Redis command that takes longer is an outage
# Redis out of reach (stopped, paused, unreachable, a cluster without its slots), not a wrong command.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterDownError, RedisClusterException)


def connect(url: str) -> aioredis.Redis:
    """A client whose every command answers, or fails as REDIS_DOWN, within TIMEOUT_S."""
    return aioredis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
