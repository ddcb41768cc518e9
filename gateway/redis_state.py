"""Redis as the fronts share it (keys, tenant secret, responses, placements, conversations, tool
durations): one way to connect, a single server or a Redis Cluster alike, and what counts as an outage."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

TIMEOUT_S = 0.5  # a Redis command that takes longer is an outage
# Redis out of reach (stopped, paused, unreachable, a cluster without its slots), not a wrong command.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterDownError, RedisClusterException)
OPTIONS = {"socket_timeout": TIMEOUT_S, "socket_connect_timeout": TIMEOUT_S}


def clustered(url: str) -> bool:
    """Whether the server at `url` is a Redis Cluster node (asked once, at start; one out of reach or
    refusing INFO is taken for a single server)."""
    probe = redis.Redis.from_url(url, **OPTIONS)
    try:
        return probe.info("cluster").get("cluster_enabled") == 1
    except (*REDIS_DOWN, RedisError):
        return False
    finally:
        probe.close()


def connect(url: str) -> aioredis.Redis | aioredis.RedisCluster:
    """A client whose every command answers, or fails as REDIS_DOWN, within TIMEOUT_S."""
    return aioredis.RedisCluster.from_url(url, **OPTIONS) if clustered(url) else aioredis.from_url(url, **OPTIONS)


def connect_blocking(url: str) -> redis.Redis | redis.RedisCluster:
    """The same, for a caller off the event loop."""
    return redis.RedisCluster.from_url(url, **OPTIONS) if clustered(url) else redis.Redis.from_url(url, **OPTIONS)
