"""Admin endpoints: API keys (create, list, revoke), and the semantic cache's state and invalidation
by entry, category or tenant. They need `security.admin_key` as the bearer token; without one they are closed."""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from kvgate.gateway.errors import APIError
from kvgate.gateway.keys import Keys, bearer
from kvgate.gateway.limits import Limits
from kvgate.gateway.protocol import Body

if TYPE_CHECKING:
    from kvgate.semantic_cache import SemanticCache


async def admin_only(request: Request) -> None:
    key: str | None = request.app.state.settings.security.admin_key
    if key is None:
        raise APIError(403, "admin endpoints are closed: set admin_key to open them", code="admin_disabled")
    token = bearer(request)
    if not token:
        raise APIError(401, "admin endpoints need the admin key as a bearer token", code="invalid_api_key")
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(403, "this key may not use admin endpoints", code="forbidden")


router = APIRouter(prefix="/admin/semantic-cache", dependencies=[Depends(admin_only)])
keys_router = APIRouter(prefix="/admin/keys", dependencies=[Depends(admin_only)])


class KeyRequest(Body):
    tenant: str = Field(min_length=1, max_length=256)
    models: list[str] = Field(default_factory=list)  # empty: every model
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)


@keys_router.post("")
async def create_key(body: KeyRequest, request: Request) -> dict[str, Any]:
    """A new key, shown once: only its hash is kept."""
    keys: Keys = request.app.state.keys
    token, key = await keys.create(body.tenant, body.models, Limits(body.rpm, body.tpm))
    return {**key.card(), "key": token}


@keys_router.get("")
async def list_keys(request: Request) -> dict[str, Any]:
    keys: Keys = request.app.state.keys
    return {"object": "list", "data": [k.card() for k in await keys.all()]}


@keys_router.delete("/{key_id}")
async def revoke_key(key_id: str, request: Request) -> dict[str, Any]:
    keys: Keys = request.app.state.keys
    if not await keys.revoke(key_id):
        raise APIError(404, f"no created key with id {key_id!r}", "key_id", "key_not_found")
    return {"id": key_id, "object": "api_key", "deleted": True}


def cache_of(request: Request) -> SemanticCache:
    cache: SemanticCache | None = request.app.state.semantic  # the runtime's or, in proxy mode, the front's
    if cache is None:
        raise APIError(404, "the semantic cache is off (semantic_cache.enabled: false)", code="semantic_cache_off")
    return cache


@router.get("")
async def stats(request: Request) -> dict[str, Any]:
    cache = cache_of(request)
    categories = [
        {"name": c.name, "threshold": c.threshold, "floor": c.floor, "ttl_s": c.ttl_s, "quota": c.quota}
        for c in cache.config.categories
    ]
    checks = request.app.state.checks.stats()  # would-be hits checked beside the hit
    return {"object": "semantic_cache", **cache.stats(), "categories": categories, "checks": checks}


@router.delete("/entries/{entry_id}")
async def forget_entry(entry_id: str, request: Request) -> dict[str, Any]:
    gone = await asyncio.to_thread(cache_of(request).invalidate, entry_id)
    if not gone:
        raise APIError(404, f"no cached entry with id {entry_id!r}", "entry_id", "entry_not_found")
    return {"object": "semantic_cache.invalidation", "entry": entry_id, "deleted": gone}


@router.delete("/categories/{category}")
async def forget_category(category: str, request: Request) -> dict[str, Any]:
    cache = cache_of(request)
    if category not in {c.name for c in cache.config.categories}:
        raise APIError(404, f"no category named {category!r}", "category", "category_not_found")
    gone = await asyncio.to_thread(cache.invalidate, None, category)
    return {"object": "semantic_cache.invalidation", "category": category, "deleted": gone}


@router.delete("/tenants/{tenant}")
async def forget_tenant(tenant: str, request: Request) -> dict[str, Any]:
    gone = await asyncio.to_thread(cache_of(request).invalidate, None, None, tenant)
    return {"object": "semantic_cache.invalidation", "tenant": tenant, "deleted": gone}
