"""Admin endpoints: the semantic cache's state, and invalidation by entry, category or tenant.
They need `admin_key` as the bearer token; without one configured they are closed."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request

from gateway.errors import APIError
from gateway.semantic import bearer
from gateway.serving import Served
from semantic_cache import SemanticCache


async def admin_only(request: Request) -> None:
    key: str | None = request.app.state.settings.admin_key
    if key is None:
        raise APIError(403, "admin endpoints are closed: set admin_key to open them", code="admin_disabled")
    token = bearer(request)
    if not token:
        raise APIError(401, "admin endpoints need the admin key as a bearer token", code="invalid_api_key")
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(403, "this key may not use admin endpoints", code="forbidden")


router = APIRouter(prefix="/admin/semantic-cache", dependencies=[Depends(admin_only)])


def cache_of(request: Request) -> SemanticCache:
    served: Served = request.app.state.served
    if served.semantic is None:
        raise APIError(404, "the semantic cache is off (semantic_cache: false)", code="semantic_cache_off")
    return served.semantic


@router.get("")
async def stats(request: Request) -> dict[str, Any]:
    cache = cache_of(request)
    categories = [
        {"name": c.name, "threshold": c.threshold, "floor": c.floor, "ttl_s": c.ttl_s, "quota": c.quota}
        for c in cache.config.categories
    ]
    return {"object": "semantic_cache", **cache.stats(), "categories": categories}


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
