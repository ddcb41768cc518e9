"""API keys: each maps to a tenant, the models it may use and its rate limits. Keys come from the
settings file (plain, or `sha256:<hex>` of the key) or are created through the admin API; created ones
live in Redis when `redis_url` is set (stored hashed, shared by every process), else in this process.
Every cache and pin is scoped by the tenant `authenticate` sets on the request.

Where keys are not required, a bearer token that is no key is a tenant of its own, named by an HMAC of
the token under a secret (no one computes a tenant's name without its token, even a guessable token's):
the settings' `tenant_secret`, else one made once in Redis when `redis_url` is set (every front on it
names a token's tenant alike), else one kept in `cache_dir`. Callers without a token are one tenant,
ANONYMOUS. A Redis that does not answer a
key lookup or an admin call is a 503 (`redis_unavailable`) within TIMEOUT_S, never a 401 or a 500."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError

from kvgate.gateway.errors import APIError, answer
from kvgate.gateway.limits import Limiter, Limits
from kvgate.gateway.redis_state import connect
from kvgate.gateway.settings import Settings

log = logging.getLogger("kvgate.keys")
REDIS_PREFIX = "kvgate:key:"
CACHE_S = 5.0  # a key revoked in Redis stops working in other processes within this long
CACHE_MAX = 10_000
KEY_ID = re.compile(r"^key-[0-9a-f]{16}$")
ANONYMOUS = "anonymous"  # the tenant of callers without a token, where keys are not required
SECRET_FILE = "tenant-secret"  # in cache_dir, mode 0600
SECRET_KEY = "kvgate:tenant-secret"  # in Redis, where redis_url is set and tenant_secret is not
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


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
    models = spec.get("models") or []
    counts = [spec[n] for n in ("rpm", "tpm") if spec.get(n) is not None]
    if (
        unknown
        or not isinstance(spec.get("tenant"), str)
        or not spec["tenant"]
        or not isinstance(models, list)
        or not all(isinstance(m, str) for m in models)
        or not all(isinstance(c, int) and not isinstance(c, bool) for c in counts)
    ):
        raise ValueError(f"api key {hashed[:12]}...: expected a tenant or {{tenant, models, rpm, tpm}}, got {spec}")
    limits = Limits(spec.get("rpm", default.rpm), spec.get("tpm", default.tpm))
    return Key("key-" + hashed[:16], spec["tenant"], tuple(models), limits, source)


class Keys:
    def __init__(
        self, settings: Settings, clock: Callable[[], float] = time.monotonic, cache_max: int = CACHE_MAX
    ) -> None:
        self.required, self.default = settings.security.keys_required, settings.limits()
        self.clock, self.cache_max = clock, cache_max  # the Redis lookups' cache: how long, how many
        self.known: dict[str, Key] = {}  # sha256 of the key -> Key
        for token, spec in settings.security.api_keys.items():
            hashed = token.removeprefix("sha256:").lower() if token.startswith("sha256:") else digest(token)
            self.known[hashed] = key_of(hashed, spec, "settings", self.default)
        self.redis: aioredis.Redis | None = None
        if settings.redis_url:
            self.redis = connect(settings.redis_url)
        self.cached: dict[str, tuple[float, Key | None]] = {}
        self.secret: bytes | None = b""  # None: Redis's, fetched at the first token (`named`)
        if settings.security.tenant_secret is not None:
            self.secret = settings.security.tenant_secret.get_secret_value().encode()
        elif not self.required and self.redis is None:
            self.secret = tenant_secret(settings.cache_dir)
        elif not self.required:
            self.secret = None
        self.proxies = networks(settings.security.trusted_proxies)

    def tenant(self, token: str) -> str:
        """The tenant of a caller without a key: its token's own, or ANONYMOUS without one. The secret
        must be known: `named` fetches Redis's."""
        if not token:
            return ANONYMOUS
        assert self.secret is not None, "the tenant secret is Redis's: call named()"
        return "anon-" + hmac.new(self.secret, token.encode(), hashlib.sha256).hexdigest()[:24]

    async def named(self, token: str) -> str:
        """`tenant`, fetching the secret every front shares from Redis the first time (REDIS_DOWN: 503)."""
        if self.secret is None and token:
            assert self.redis is not None
            await self.redis.set(SECRET_KEY, secrets.token_hex(32), nx=True)  # the first front's stays
            shared = await self.redis.get(SECRET_KEY)
            if not shared:  # deleted between the two commands: the next request makes it again
                raise RedisConnectionError("the tenant secret vanished from Redis")
            self.secret = shared
        return self.tenant(token)

    async def find(self, token: str) -> Key | None:
        hashed = digest(token)
        if (key := self.known.get(hashed)) is not None or self.redis is None:
            return key
        now = self.clock()
        hit = self.cached.get(hashed)
        if hit is not None and hit[0] > now:
            return hit[1]
        # Redis down: a REDIS_DOWN error, answered 503 (keys from the settings still work)
        raw = await self.redis.get(REDIS_PREFIX + hashed)
        key = key_of(hashed, json.loads(raw), "redis", self.default) if raw else None
        if len(self.cached) >= self.cache_max:
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


def private_file(path: Path) -> Path:
    """A new empty file only its owner may read, whatever the umask: private before its first byte."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def tenant_secret(cache_dir: Path) -> bytes:
    """The secret that names token tenants: read from cache_dir, or made there (0600) the first time,
    so that a token keeps its tenant across restarts and in every process sharing the directory."""
    path = cache_dir / SECRET_FILE
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            fresh = private_file(cache_dir / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
            fresh.write_text(secrets.token_hex(32))
            try:
                os.link(fresh, path)  # atomic, and never over another process's secret
            except FileExistsError:
                pass
            finally:
                fresh.unlink()
        os.chmod(path, 0o600)
        secret = path.read_text().strip()
        if len(secret) >= 32:
            return secret.encode()
        log.warning("%s is too short; token tenants get a secret of this process", path)
    except OSError as exc:
        log.warning("cannot keep the tenant secret in %s (%s); token tenants get one of this process", path, exc)
    return secrets.token_bytes(32)


def networks(given: list[str]) -> tuple[Network, ...]:
    """The trusted proxies' addresses and networks (`security.trusted_proxies`)."""
    try:
        return tuple(ipaddress.ip_network(n.strip(), strict=False) for n in given)
    except ValueError as exc:
        raise ValueError(f"trusted_proxies: {exc}") from None


def trusted(address: str, proxies: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in n for n in proxies)


def caller_address(request: Request) -> str:
    """Whom a request comes from: the peer; behind trusted proxies, the right-most address of
    X-Forwarded-For that is not a trusted proxy (what comes before it, anyone could have written)."""
    peer = request.client.host if request.client else ""
    proxies: tuple[Network, ...] = request.app.state.keys.proxies
    if not proxies or not trusted(peer, proxies):
        return peer
    chain = [a.strip() for h in request.headers.getlist("x-forwarded-for") for a in h.split(",")]
    for address in reversed([a for a in chain if a]):
        if not trusted(address, proxies):
            return address[:64]
        peer = address
    return peer


def bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def authenticate(request: Request) -> None:
    """Sets request.state.tenant and .key, and counts the request against the key's rate limits."""
    keys: Keys = request.app.state.keys
    token = bearer(request) or request.headers.get("x-api-key", "").strip()  # Anthropic's clients send x-api-key
    key = await keys.find(token) if token else None
    if key is None and keys.required:
        missing = "You didn't provide an API key (Authorization: Bearer, or x-api-key)."
        said = "Incorrect API key provided." if token else missing
        raise APIError(401, said, code="invalid_api_key")
    request.state.key = key
    request.state.tenant = key.tenant if key else await keys.named(token)
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
    makes up must not buy a new budget, nor an X-Forwarded-For header no trusted proxy wrote)."""
    key: Key | None = request.state.key
    return key.id if key else "addr:" + caller_address(request)


def allow_model(request: Request, *models: str) -> None:
    """403 unless the key may use one of `models` (the one a request names, or those a route runs)."""
    key: Key | None = request.state.key
    if key is not None and models and not any(key.allows(m) for m in models):
        raise APIError(403, f"this API key may not use the model `{models[0]}`", "model", "model_not_allowed")


async def spend(request: Request, tokens: int) -> None:
    """Tokens a finished request used, against its key's tokens-per-minute limit."""
    limits = limits_of(request)
    if limits.tpm is not None and tokens > 0:
        limiter: Limiter = request.app.state.limiter
        await limiter.spend(budget_of(request), limits, tokens)


async def redis_down(request: Request, exc: Exception) -> JSONResponse:
    """The answer when Redis, which holds created keys and what the admin routes change, does not answer."""
    log.warning("%s %s: redis did not answer (%s)", request.method, request.url.path, type(exc).__name__)
    said = "Redis (keys, the semantic cache) is not answering; retry shortly."
    return answer(request, APIError(503, said, code="redis_unavailable", headers={"retry-after": "1"}))
