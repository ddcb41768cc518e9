"""API keys, tenants and rate limits: keys from the settings file or created through the admin API
(kept in a real Redis, hashed), the models a key may use, requests and tokens per minute."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvgate.gateway.settings import Settings
from tests.helpers import loopback
from tests.helpers.servers import serving

HASHED = "sk-only-its-hash-is-in-the-file"
KEYS = {
    "sk-alpha": "alpha",
    "sk-beta": {"tenant": "beta", "models": ["some-other-model"]},
    "sha256:" + hashlib.sha256(HASHED.encode()).hexdigest(): {"tenant": "gamma", "rpm": 2},
    "sk-thrifty": {"tenant": "delta", "tpm": 10},
}
ADMIN = "sk-admin"
HELLO = [{"role": "user", "content": "Say hi."}]


def keyed(settings: Settings, **more) -> Settings:
    return settings.model_copy(update={"security": {"api_keys": KEYS, "admin_key": ADMIN}, **more})


@pytest.fixture(scope="module")
def url(settings, engine) -> Iterator[str]:
    with serving(keyed(settings), engine) as base:
        yield base


def ask(url: str, key: str | None, model: str, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    payload = {"model": model, "messages": HELLO, "max_tokens": 2, "temperature": 0, **body}
    return loopback.post(url + "/v1/chat/completions", json=payload, headers=headers, timeout=60)


def test_a_missing_or_wrong_key_is_401(url, model_name):
    for key in (None, "sk-wrong"):
        r = ask(url, key, model_name)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_a_key_limited_to_other_models_gets_403_and_an_unknown_model_404(url, model_name):
    r = ask(url, "sk-beta", model_name)
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    r = ask(url, "sk-alpha", "no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_requests_per_minute_get_a_429_with_retry_after(url, model_name):
    """The key in the settings file as its hash only; two requests a minute."""
    first, second, third = (ask(url, HASHED, model_name) for _ in range(3))
    assert [first.status_code, second.status_code] == [200, 200]
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.status_code == 429
    assert third.json()["error"]["type"] == "rate_limit_error"
    assert int(third.headers["retry-after"]) >= 1
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in third.headers
    assert "x-ratelimit-remaining-requests" not in ask(url, "sk-alpha", model_name).headers  # alpha: no limits


def test_tokens_per_minute_refuse_the_next_request(url, model_name):
    first = ask(url, "sk-thrifty", model_name)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 10
    r = ask(url, "sk-thrifty", model_name)
    assert r.status_code == 429
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"


def test_documents_belong_to_their_tenant(url, model_name):
    stored = loopback.post(
        url + "/v1/documents",
        json={"text": "Alpha's private notes."},
        headers={"authorization": "Bearer sk-alpha"},
        timeout=60,
    ).json()
    cite = {"documents": [{"id": stored["id"]}]}
    assert ask(url, "sk-alpha", model_name, **cite).status_code == 200
    other = loopback.get(url + f"/v1/documents/{stored['id']}", headers={"authorization": "Bearer sk-beta"})
    assert other.status_code == 404


def test_admin_endpoints_need_the_admin_key(url):
    assert loopback.get(url + "/admin/keys").status_code == 401
    r = loopback.get(url + "/admin/keys", headers={"authorization": "Bearer sk-alpha"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    listed = loopback.get(url + "/admin/keys", headers={"authorization": f"Bearer {ADMIN}"}).json()["data"]
    assert {k["tenant"] for k in listed} == {"alpha", "beta", "gamma", "delta"}
    assert all("key" not in k for k in listed)


def test_keys_created_through_the_admin_api_live_hashed_in_redis(settings, engine, redis_server, model_name):
    admin = {"authorization": f"Bearer {ADMIN}"}
    shared = keyed(settings, redis_url=redis_server.url)
    with serving(shared, engine) as one, serving(shared, engine) as two:
        made = loopback.post(
            one + "/admin/keys", json={"tenant": "epsilon", "models": [model_name], "rpm": 3}, headers=admin
        )
        assert made.status_code == 200
        key = made.json()["key"]
        assert ask(one, key, model_name).status_code == 200
        assert ask(two, key, model_name).status_code == 200  # another process finds it in Redis
        assert ask(two, key, model_name).status_code == 200
        r = ask(one, key, model_name)
        assert r.status_code == 429  # the limit is counted in Redis, across both
        stored = redis_server.client().keys("kvgate:key:*")
        assert stored and all(key.encode() not in name for name in stored)
        assert all(key.encode() not in redis_server.client().get(name) for name in stored)
        key_id = made.json()["id"]
        assert loopback.delete(one + f"/admin/keys/{key_id}", headers=admin).status_code == 200
        assert ask(one, key, model_name).status_code == 401
        assert loopback.delete(one + f"/admin/keys/{key_id}", headers=admin).status_code == 404


def test_callers_without_a_key_share_their_address_budget(settings, engine, model_name):
    """A bearer token made up for each request does not buy a new budget."""
    with serving(settings.model_copy(update={"security": {"rate_limit_rpm": 1}}), engine) as url:
        assert ask(url, "made-up-1", model_name).status_code == 200
        assert ask(url, "made-up-2", model_name).status_code == 429


def test_a_token_tenant_needs_the_token_and_the_servers_secret(tmp_path):
    """Without keys, a token's tenant is an HMAC of it under a secret made once (0600) in cache_dir:
    the same across processes sharing the directory, not computable from the token alone (a plain
    hash of a guessable token would be), and callers without a token are one tenant of their own."""
    import hmac

    from kvgate.gateway.keys import ANONYMOUS, SECRET_FILE, Keys

    one, two = (Keys(Settings(cache_dir=tmp_path / "a")) for _ in range(2))
    secret = (tmp_path / "a" / SECRET_FILE).read_bytes()
    assert (tmp_path / "a" / SECRET_FILE).stat().st_mode & 0o777 == 0o600 and len(secret) >= 32
    token = "EMPTY"  # what many clients send when no key is needed
    assert one.tenant(token) == two.tenant(token) == "anon-" + hmac.new(secret, b"EMPTY", "sha256").hexdigest()[:24]
    assert one.tenant(token) != "anon-" + hashlib.sha256(b"EMPTY").hexdigest()[:24]
    assert one.tenant(token) != Keys(Settings(cache_dir=tmp_path / "b")).tenant(token)
    assert one.tenant("EMPTY2") != one.tenant(token) and one.tenant("") == ANONYMOUS != one.tenant(token)
