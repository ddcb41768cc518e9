"""API keys: each maps to a tenant, the models it may use and its rate limits. Keys come from the
settings file (plain, or `sha256:<hex>` of the key) or are created through the admin API; created ones
live in Redis when `redis_url` is set (stored hashed, shared by every process), else in this process.
Every cache and pin is scoped by the tenant `authenticate` sets on the request."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from fastapi import Request

from kvgate.gateway.errors import APIError
from kvgate.gateway.limits import Limiter, Limits

log = logging.getLogger("kvgate.keys")
REDIS_PREFIX = "kvgate:key:"
CACHE_S = 5.0  # a key revoked in Redis stops working in other processes within this long
CACHE_MAX = 10_000
KEY_ID = re.compile(r"^key-[0-9a-f]{16}$")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Key:
    id: str  # names the key in logs, limits and the admin API, never the key itself
    tenant: str
    models: tuple[str, ...] = ()  # empty: every model
    limits: Limits = field(default_factory=Limits)
    source: str = "settings"  # settings | redis | memory

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def card(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "api_key",
            "tenant": self.tenant,
            "models": list(self.models),
            "rpm": self.limits.rpm,
            "tpm": self.limits.tpm,
            "source": self.source,
        }


def key_of(hashed: str, spec: str | dict[str, Any], source: str, default: Limits) -> Key:
    """A key from its settings entry: a tenant name, or {tenant, models, rpm, tpm}."""
    spec = {"tenant": spec} if isinstance(spec, str) else spec
    unknown = set(spec) - {"tenant", "models", "rpm", "tpm"}
    if unknown or not isinstance(spec.get("tenant"), str):
        raise ValueError(f"api key {hashed[:12]}...: expected a tenant or {{tenant, models, rpm, tpm}}, got {spec}")
    limits = Limits(spec.get("rpm", default.rpm), spec.get("tpm", default.tpm))
    return Key("key-" + hashed[:16], spec["tenant"], tuple(spec.get("models") or ()), limits, source)


class Keys:
    def __init__(self, configured: dict[str, Any], redis_url: str | None, required: bool, default: Limits) -> None:
        self.required, self.default = required, default
        self.known: dict[str, Key] = {}  # sha256 of the key -> Key
        for token, spec in configured.items():
            hashed = token.removeprefix("sha256:").lower() if token.startswith("sha256:") else digest(token)
            self.known[hashed] = key_of(hashed, spec, "settings", default)
        self.redis = aioredis.from_url(redis_url) if redis_url else None
        self.cached: dict[str, tuple[float, Key | None]] = {}

    async def find(self, token: str) -> Key | None:
        hashed = digest(token)
        if (key := self.known.get(hashed)) is not None or self.redis is None:
            return key
        now = time.monotonic()
        hit = self.cached.get(hashed)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            raw = await self.redis.get(REDIS_PREFIX + hashed)
        except Exception as exc:  # Redis down: keys from the settings still work
            log.warning("api key lookup in Redis failed: %s", exc)
            return None
        key = key_of(hashed, json.loads(raw), "redis", self.default) if raw else None
        if len(self.cached) >= CACHE_MAX:
            self.cached.clear()
        self.cached[hashed] = (now + CACHE_S, key)
        return key

    async def create(self, tenant: str, models: list[str], limits: Limits) -> tuple[str, Key]:
        token = "sk-kvgate-" + secrets.token_urlsafe(32)
        hashed = digest(token)
        given = {"tenant": tenant, "models": models, "rpm": limits.rpm, "tpm": limits.tpm}
        spec = {k: v for k, v in given.items() if v is not None}  # a limit not given: the default
        if self.redis is not None:
            await self.redis.set(REDIS_PREFIX + hashed, json.dumps(spec))
            return token, key_of(hashed, spec, "redis", self.default)
        self.known[hashed] = key = key_of(hashed, spec, "memory", self.default)
        return token, key

    async def all(self) -> list[Key]:
        keys = list(self.known.values())
        if self.redis is not None:
            async for name in self.redis.scan_iter(match=REDIS_PREFIX + "*", count=500):
                hashed = name.decode().removeprefix(REDIS_PREFIX)
                raw = await self.redis.get(name)
                if raw:
                    keys.append(key_of(hashed, json.loads(raw), "redis", self.default))
        return keys

    async def revoke(self, key_id: str) -> bool:
        """Revoke a created key (one from the settings file stays until the file changes)."""
        if not KEY_ID.match(key_id):
            return False
        for hashed, key in list(self.known.items()):
            if key.id == key_id and key.source == "memory":
                del self.known[hashed]
                return True
        if self.redis is None:
            return False
        async for name in self.redis.scan_iter(match=REDIS_PREFIX + key_id.removeprefix("key-") + "*"):
            self.cached.pop(name.decode().removeprefix(REDIS_PREFIX), None)
            return bool(await self.redis.delete(name))
        return False

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


def bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def authenticate(request: Request) -> None:
    """Sets request.state.tenant and .key, and counts the request against the key's rate limits.
    Without a key (where keys are not required) the tenant is a hash of the bearer token, so two
    callers never share cached answers by default."""
    keys: Keys = request.app.state.keys
    token = bearer(request)
    key = await keys.find(token) if token else None
    if key is None and keys.required:
        said = "Incorrect API key provided." if token else "You didn't provide an API key (Authorization: Bearer)."
        raise APIError(401, said, code="invalid_api_key")
    request.state.key = key
    request.state.tenant = key.tenant if key else "anon-" + digest(token)[:24]
    limits = limits_of(request)
    if limits.rpm is None and limits.tpm is None:
        return
    limiter: Limiter = request.app.state.limiter
    verdict = await limiter.admit(budget_of(request), limits)
    request.state.response_headers = dict(verdict.headers)
    if not verdict.allowed:
        wait = max(1, int(verdict.retry_after_s + 0.999))
        raise APIError(
            429,
            f"Rate limit reached; retry after {wait} s.",
            code="rate_limit_exceeded",
            headers={
                **verdict.headers,
                "retry-after": str(wait),
                "retry-after-ms": str(int(verdict.retry_after_s * 1000)),
            },
        )


def limits_of(request: Request) -> Limits:
    """The key's limits, or the defaults for a caller without a key (of its own)."""
    key: Key | None = request.state.key
    return key.limits if key else request.app.state.keys.default


def budget_of(request: Request) -> str:
    """Whose rate limits: the key's; a caller without a key is counted by address (a bearer token it
    makes up must not buy a new budget)."""
    key: Key | None = request.state.key
    return key.id if key else "addr:" + (request.client.host if request.client else "")


def allow_model(request: Request, model: str) -> None:
    key: Key | None = request.state.key
    if key is not None and not key.allows(model):
        raise APIError(403, f"this API key may not use the model `{model}`", "model", "model_not_allowed")


async def spend(request: Request, tokens: int) -> None:
    """Tokens a finished request used, against its key's tokens-per-minute limit."""
    limits = limits_of(request)
    if limits.tpm is not None and tokens > 0:
        limiter: Limiter = request.app.state.limiter
        await limiter.spend(budget_of(request), limits, tokens)
