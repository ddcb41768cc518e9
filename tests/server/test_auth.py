"""Who a caller is: the bearer key (refused in OpenAI's error shape when wrong, revoked or missing), the
admin key for key management, the address behind trusted proxies, the key's models and rate limits, and
a Redis that does not answer. The real app runs in process (httpx's ASGI transport sets the peer
address); pure functions are called on a real Starlette request."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import Request

from kvgate.gateway.app import create_app
from kvgate.gateway.backend import make_backend
from kvgate.gateway.errors import APIError
from kvgate.gateway.keys import allow_model, authenticate, budget_of, caller_address
from kvgate.gateway.limits import MemoryLimiter
from kvgate.gateway.settings import Settings
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import free_port

pytestmark = pytest.mark.anyio
ADMIN = "sk-admin-auth"
HASHED = "sk-known-only-by-its-hash"
HEX = hashlib.sha256(HASHED.encode()).hexdigest()
KEYS: dict[str, Any] = {
    "sk-alpha": "alpha",
    "sk-beta": {"tenant": "beta", "models": ["model-b"]},
    "sha256:" + HEX: "gamma",
    "sha256:" + hashlib.sha256(b"sk-upper").hexdigest().upper(): "upper",
}
PEER = "203.0.113.1"
MISSING = "You didn't provide an API key (Authorization: Bearer, or x-api-key)."
WRONG = "Incorrect API key provided."
REDIS_SAID = "Redis (keys, the semantic cache) is not answering; retry shortly."


def app_of(tmp_path: Path, **settings: Any) -> FastAPI:
    """The gateway in proxy mode without upstreams: every route of keys.py, no model."""
    keyed = {"api_keys": KEYS, "admin_key": ADMIN}
    config = Settings(cache_dir=tmp_path, semantic_cache={"enabled": False}, security=keyed).model_copy(update=settings)
    return create_app(config, make_backend(config))


@asynccontextmanager
async def client(app: FastAPI, peer: str = PEER) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
            yield c
    finally:
        await app.state.keys.close()
        await app.state.limiter.close()


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def error(r: httpx.Response, status: int, code: str | None, message: str | None = None) -> dict[str, Any]:
    """OpenAI's error body with this status and code (and message, when given)."""
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == code
    assert message is None or body["message"] == message
    return body


def request(app: FastAPI, token: str = "", peer: str | None = PEER, forwarded: tuple[str, ...] = ()) -> Request:
    """A real Starlette request as the app would hand it to a dependency."""
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    headers += [(b"x-forwarded-for", f.encode()) for f in forwarded]
    client = (peer, 40000) if peer is not None else None
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers, "client": client}
    return Request({**scope, "app": app, "state": {}, "query_string": b""})


# --- the bearer key -------------------------------------------------------------------------------


async def test_a_missing_or_wrong_key_is_a_401_that_says_which(tmp_path: Path) -> None:
    async with client(app_of(tmp_path)) as c:
        body = error(await c.get("/v1/models"), 401, "invalid_api_key", MISSING)
        assert body["type"] == "authentication_error" and body["param"] is None
        error(await c.get("/v1/models", headers=bearer("sk-wrong")), 401, "invalid_api_key", WRONG)
        # Only the Bearer scheme carries a key: a valid key under another scheme is no key at all.
        error(await c.get("/v1/models", headers={"authorization": "Basic sk-alpha"}), 401, "invalid_api_key", MISSING)
        assert (await c.get("/v1/models", headers={"authorization": "bearer   sk-alpha "})).status_code == 200


async def test_a_key_in_the_settings_may_be_its_sha256_in_either_case(tmp_path: Path) -> None:
    async with client(app_of(tmp_path)) as c:
        for token in ("sk-alpha", HASHED, "sk-upper"):
            assert (await c.get("/v1/models", headers=bearer(token))).status_code == 200, token
        # The hash from the settings file is not a key: a leaked file gives no access.
        for token in (HEX, "sha256:" + HEX, HEX.upper()):
            error(await c.get("/v1/models", headers=bearer(token)), 401, "invalid_api_key", WRONG)


async def test_a_key_sets_its_tenant_and_a_keyless_token_gets_its_own(tmp_path: Path) -> None:
    keyed = app_of(tmp_path)
    r = request(keyed, "sk-beta")
    await authenticate(r)
    assert r.state.tenant == "beta" and r.state.key.models == ("model-b",)
    assert budget_of(r) == r.state.key.id  # a key's own budget, wherever it calls from
    keyless = app_of(tmp_path, security={"api_keys": {}})
    for token, tenant in (("tok-1", keyless.state.keys.tenant("tok-1")), ("", "anonymous")):
        r = request(keyless, token)
        await authenticate(r)
        assert r.state.key is None and r.state.tenant == tenant
        assert budget_of(r) == "addr:" + PEER  # a made-up token buys no budget of its own
    assert keyless.state.keys.tenant("tok-1").startswith("anon-")


async def test_a_key_for_other_models_is_a_403_naming_the_model(tmp_path: Path) -> None:
    async with client(app_of(tmp_path)) as c:
        chat = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}
        refused = await c.post("/v1/chat/completions", json=chat, headers=bearer("sk-beta"))
        body = error(refused, 403, "model_not_allowed")
        assert body["message"] == "this API key may not use the model `model-a`"
        assert (body["param"], body["type"]) == ("model", "permission_error")
        # A key for every model passes the check; the model is then unknown here.
        error(await c.post("/v1/chat/completions", json=chat, headers=bearer("sk-alpha")), 404, "model_not_found")
    beta = request(app_of(tmp_path), "sk-beta")
    await authenticate(beta)
    allow_model(beta, "model-a", "model-b")  # a route running several: one allowed is enough
    with pytest.raises(APIError) as refused:
        allow_model(beta, "model-c", "model-a")
    assert refused.value.status == 403 and "`model-c`" in refused.value.message


# --- the admin key and key management ---------------------------------------------------------------


async def test_key_management_needs_the_admin_key(tmp_path: Path) -> None:
    async with client(app_of(tmp_path)) as c:
        error(await c.get("/admin/keys"), 401, "invalid_api_key")
        error(await c.post("/admin/keys", json={"tenant": "x"}, headers=bearer("sk-alpha")), 403, "forbidden")
        error(await c.delete("/admin/keys/key-0123456789abcdef", headers=bearer("sk-alpha")), 403, "forbidden")
    async with client(app_of(tmp_path, security={"admin_key": None})) as c:
        error(await c.get("/admin/keys", headers=bearer(ADMIN)), 403, "admin_disabled")


async def test_a_created_key_is_shown_once_then_only_its_card(tmp_path: Path) -> None:
    admin = bearer(ADMIN)
    async with client(app_of(tmp_path, security={"rate_limit_rpm": 50})) as c:
        made = (await c.post("/admin/keys", json={"tenant": "t1", "models": ["m"], "tpm": 70}, headers=admin)).json()
        token = made.pop("key")
        assert token.startswith("sk-kvgate-") and len(token) == len("sk-kvgate-") + 43  # 256 random bits
        key_id = "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]
        card = {"id": key_id, "object": "api_key", "tenant": "t1", "models": ["m"], "rpm": 50, "tpm": 70}
        assert made == {**card, "source": "memory"}
        assert (await c.get("/v1/models", headers=bearer(token))).status_code == 200
        listed = (await c.get("/admin/keys", headers=admin)).json()
        assert listed["object"] == "list" and {**card, "source": "memory"} in listed["data"]
        assert {"id": "key-" + HEX[:16], "object": "api_key", "tenant": "gamma", "models": [], "rpm": 50,
                "tpm": None, "source": "settings"} in listed["data"]  # fmt: skip
        assert token[10:] not in str(listed) and hashlib.sha256(token.encode()).hexdigest() not in str(listed)


async def test_a_revoked_key_is_refused_and_only_created_keys_can_be_revoked(tmp_path: Path) -> None:
    admin = bearer(ADMIN)
    async with client(app_of(tmp_path)) as c:
        first, second = [(await c.post("/admin/keys", json={"tenant": t}, headers=admin)).json() for t in "ab"]
        gone = await c.delete(f"/admin/keys/{second['id']}", headers=admin)
        assert gone.status_code == 200 and gone.json() == {"id": second["id"], "object": "api_key", "deleted": True}
        error(await c.get("/v1/models", headers=bearer(second["key"])), 401, "invalid_api_key", WRONG)
        assert (await c.get("/v1/models", headers=bearer(first["key"]))).status_code == 200  # the other one stays
        settings_key = "key-" + hashlib.sha256(b"sk-alpha").hexdigest()[:16]
        for key_id in (second["id"], settings_key, "key-0123456789abcdef", "not-a-key", first["id"] + "0"):
            body = error(await c.delete(f"/admin/keys/{key_id}", headers=admin), 404, "key_not_found")
            assert body["param"] == "key_id"
        assert (await c.get("/v1/models", headers=bearer("sk-alpha"))).status_code == 200  # from the file: stays


# --- the caller's address ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "forwarded", "caller"),
    [
        ("198.51.100.7", ("203.0.113.9",), "198.51.100.7"),  # not a trusted proxy: its header is not believed
        ("127.0.0.1", (), "127.0.0.1"),
        ("127.0.0.1", ("203.0.113.9",), "203.0.113.9"),
        ("127.0.0.1", ("198.51.100.1,203.0.113.9",), "203.0.113.9"),  # the right-most: anyone wrote the rest
        ("127.0.0.1", ("198.51.100.1, 203.0.113.9, 10.9.0.2",), "203.0.113.9"),  # skipping trusted proxies
        ("10.1.1.1", ("198.51.100.1", "203.0.113.9 , 10.0.0.2"), "203.0.113.9"),  # several header lines
        ("127.0.0.1", ("203.0.113.9, , ",), "203.0.113.9"),
        ("127.0.0.1", ("10.0.0.5, 10.0.0.6",), "10.0.0.5"),  # proxies all the way: the farthest one
        ("127.0.0.1", ("203.0.113.9, unknown",), "unknown"),  # not an address: not a proxy either
        ("127.0.0.1", ("x" * 100,), "x" * 64),  # bounded, whatever is written
        ("testclient", ("203.0.113.9",), "testclient"),
        (None, ("203.0.113.9",), ""),
    ],
)
def test_x_forwarded_for_is_believed_from_trusted_proxies_only(
    tmp_path: Path, peer: str | None, forwarded: tuple[str, ...], caller: str
) -> None:
    app = app_of(tmp_path, security={"api_keys": {}, "trusted_proxies": ["127.0.0.1", " 10.1.2.3/8 "]})
    assert caller_address(request(app, peer=peer, forwarded=forwarded)) == caller
    untrusting = app_of(tmp_path, security={"api_keys": {}})
    assert caller_address(request(untrusting, peer=peer, forwarded=forwarded)) == (peer or "")


def test_trusted_proxies_must_be_addresses_or_networks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^trusted_proxies: 'nonsense' does not appear"):
        app_of(tmp_path, security={"trusted_proxies": ["10.0.0.1", "nonsense"]})


# --- rate limits ------------------------------------------------------------------------------------


async def test_a_429_says_when_to_retry_in_seconds_and_milliseconds(tmp_path: Path) -> None:
    now = [6000.0 + 59.5]  # half a second before a fixed window ends
    app = app_of(tmp_path, security={"api_keys": {}, "rate_limit_rpm": 1})
    app.state.limiter = MemoryLimiter(clock=lambda: now[0])
    async with client(app) as c, client(app, peer="203.0.113.2") as elsewhere:
        assert (await c.get("/v1/models")).status_code == 200
        over = await c.get("/v1/models")
        body = error(over, 429, "rate_limit_exceeded", "Rate limit reached; retry after 61 s.")
        assert body["type"] == "rate_limit_error"
        assert (over.headers["retry-after"], over.headers["retry-after-ms"]) == ("61", "60501")
        assert over.headers["x-ratelimit-limit-requests"] == "1"
        now[0] += 60.25  # the last window's request has all but 0.25 s left the minute
        soon = await c.get("/v1/models")
        error(soon, 429, "rate_limit_exceeded", "Rate limit reached; retry after 1 s.")
        assert (soon.headers["retry-after"], soon.headers["retry-after-ms"]) == ("1", "251")
        assert (await c.get("/v1/models", headers=bearer("other-token"))).status_code == 429  # same address
        assert (await elsewhere.get("/v1/models")).status_code == 200  # another address, another budget


# --- Redis out of reach -----------------------------------------------------------------------------


async def test_a_redis_that_is_down_is_a_503_for_what_needs_it_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = app_of(tmp_path, redis_url=f"redis://127.0.0.1:{free_port()}")  # nothing listens there
    async with client(app) as c:
        with caplog.at_level(logging.WARNING, logger="kvgate.keys"):
            down = await c.get("/v1/models", headers=bearer("sk-unknown"))
        body = error(down, 503, "redis_unavailable", REDIS_SAID)
        assert body["type"] == "server_error" and down.headers["retry-after"] == "1"
        assert "GET /v1/models: redis did not answer (ConnectionError)" in caplog.messages
        error(await c.get("/admin/keys", headers=bearer(ADMIN)), 503, "redis_unavailable")
        error(await c.post("/admin/keys", json={"tenant": "t"}, headers=bearer(ADMIN)), 503, "redis_unavailable")
        assert (await c.get("/v1/models", headers=bearer("sk-alpha"))).status_code == 200  # from the settings
        # No token: nothing to look up, so a plain 401 (never a wait on Redis).
        error(await c.get("/v1/models"), 401, "invalid_api_key", MISSING)


async def test_a_paused_redis_is_a_503_within_half_a_second(tmp_path: Path) -> None:
    with RedisServer() as server:
        app = app_of(tmp_path, redis_url=server.url)
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            async with client(app) as c:
                started = time.monotonic()
                down = await asyncio.wait_for(c.get("/v1/models", headers=bearer("sk-unknown")), 10)
                assert time.monotonic() - started < 2.5
                error(down, 503, "redis_unavailable")
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
