"""Tenant isolation and the public surface, replayed against real servers (the real model, uvicorn on
loopback, httpx): every route that runs the model obeys the key's models and tpm; without keys each
token is a tenant of its own and callers without one share only with each other; X-Forwarded-For is
believed from trusted proxies only; /metrics and the OpenAPI pages close; no path is shown. No
answer here is a 5xx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.gateway.keys import SECRET_FILE
from kvgate.gateway.settings import Settings
from tests.helpers.servers import serving

ADMIN = "sk-iso-admin"
KEYS = {
    "sk-iso-other": {"tenant": "other", "models": ["some-other-model"]},
    "sk-iso-thrifty": {"tenant": "thrifty", "tpm": 20},
    "sk-iso-open": "open",
}
DOCUMENT = "The lighthouse at Varn was built in 1821 by the harbour guild, and its lamp burned whale oil until 1870."


def no_5xx(response: httpx.Response) -> None:
    assert response.status_code < 500, f"{response.request.url}: {response.status_code}"


http = httpx.Client(timeout=120, event_hooks={"response": [no_5xx]})


def bearer(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def refused(r: httpx.Response, status: int, code: str) -> None:
    """The answer is OpenAI's error shape with this status and code."""
    r.read()
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


@pytest.fixture(scope="module")
def keyed(settings: Settings, engine) -> Iterator[str]:
    closed = {"api_keys": KEYS, "admin_key": ADMIN, "metrics_access": "admin", "openapi_docs": False}
    with serving(settings.model_copy(update={"security": closed}), engine) as url:
        yield url


@pytest.fixture(scope="module")
def keyless_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keyless")


@pytest.fixture(scope="module")
def keyless(settings: Settings, engine, keyless_dir: Path) -> Iterator[str]:
    semantic = {"enabled": True, "path": keyless_dir / "semantic.sqlite3"}
    given = {"semantic_cache": semantic, "cache_dir": keyless_dir, "security": {"metrics_access": "off"}}
    with serving(settings.model_copy(update=given), engine) as url:
        yield url


def chat(url: str, token: str | None, model: str, question: str, **more) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 3, "temperature": 0}
    return http.post(url + "/v1/chat/completions", json={**body, **more}, headers=bearer(token))


def test_a_key_for_other_models_runs_none_of_this_one_on_any_route(keyed: str, model_name: str) -> None:
    other = bearer("sk-iso-other")
    refused(http.post(keyed + "/v1/documents", json={"text": DOCUMENT}, headers=other), 403, "model_not_allowed")
    refused(chat(keyed, "sk-iso-other", model_name, "Hi"), 403, "model_not_allowed")
    answer = {"model": model_name, "input": "Hi", "max_output_tokens": 16}
    refused(http.post(keyed + "/v1/responses", json=answer, headers=other), 403, "model_not_allowed")
    embedder = http.get(keyed + "/v1/models", headers=other).json()["data"][1]["id"]
    embed = {"model": embedder, "input": "Hi"}
    refused(http.post(keyed + "/v1/embeddings", json=embed, headers=other), 403, "model_not_allowed")
    assert http.post(keyed + "/v1/documents", json={"text": DOCUMENT}, headers=bearer("sk-iso-open")).status_code == 200


def test_a_documents_tokens_count_against_tpm(keyed: str, model_name: str) -> None:
    thrifty = bearer("sk-iso-thrifty")
    first = http.post(keyed + "/v1/documents", json={"text": DOCUMENT}, headers=thrifty)
    assert first.status_code == 200 and first.json()["tokens"] > 20
    again = http.post(keyed + "/v1/documents", json={"text": DOCUMENT + " Again."}, headers=thrifty)
    refused(again, 429, "rate_limit_exceeded")
    assert again.headers["x-ratelimit-remaining-tokens"] == "0" and int(again.headers["retry-after"]) >= 1
    refused(chat(keyed, "sk-iso-thrifty", model_name, "Hi"), 429, "rate_limit_exceeded")


def test_without_keys_each_token_is_a_tenant_and_no_token_is_one_more(keyless: str, model_name: str) -> None:
    question = f"What is the capital of France? ({time.monotonic_ns()})"
    seen = {}
    for token in ("token-a", "token-a", "token-b", None, None):
        seen.setdefault(token, []).append(chat(keyless, token, model_name, question).headers["x-kvgate-cache"])
    assert seen == {"token-a": ["miss", "hit"], "token-b": ["miss"], None: ["miss", "hit"]}

    stored = http.post(keyless + "/v1/documents", json={"text": DOCUMENT}, headers=bearer("token-a")).json()["id"]
    assert http.get(keyless + f"/v1/documents/{stored}", headers=bearer("token-a")).status_code == 200
    for token in ("token-b", None):
        refused(http.get(keyless + f"/v1/documents/{stored}", headers=bearer(token)), 404, "document_not_found")
        cited = chat(keyless, token, model_name, "Who built it?", documents=[{"id": stored}])
        refused(cited, 404, "document_not_found")
    mine = http.post(keyless + "/v1/documents", json={"text": DOCUMENT + " Mine."}).json()["id"]
    assert http.get(keyless + f"/v1/documents/{mine}").status_code == 200  # no token: one tenant, as documented
    refused(http.get(keyless + f"/v1/documents/{mine}", headers=bearer("token-a")), 404, "document_not_found")


def test_the_tenant_secret_is_kept_private_in_the_cache_dir(keyless: str, keyless_dir: Path) -> None:
    assert (keyless_dir / SECRET_FILE).stat().st_mode & 0o777 == 0o600


def limited(settings: Settings, engine, proxies: list[str]):
    return serving(settings.model_copy(update={"security": {"rate_limit_rpm": 1, "trusted_proxies": proxies}}), engine)


def models_from(url: str, forwarded: str) -> int:
    """A request that costs no model work but counts against the caller's requests per minute."""
    return http.get(url + "/v1/models", headers={"x-forwarded-for": forwarded}).status_code


def test_x_forwarded_for_is_believed_from_trusted_proxies_only(settings: Settings, engine) -> None:
    with limited(settings, engine, []) as url:  # nobody trusted: the loopback peer is the caller
        assert [models_from(url, "203.0.113.1"), models_from(url, "203.0.113.2")] == [200, 429]
    with limited(settings, engine, ["127.0.0.1", "10.0.0.0/8"]) as url:
        assert models_from(url, "203.0.113.1") == 200
        assert models_from(url, "203.0.113.2") == 200  # another caller behind the proxy
        # The right-most address that is not a trusted proxy; what precedes it anyone could write.
        assert models_from(url, "198.51.100.9, 203.0.113.1") == 429
        assert models_from(url, "203.0.113.3, 10.1.2.3") == 200
        assert models_from(url, "203.0.113.3") == 429


def test_metrics_and_openapi_close(keyed: str, keyless: str) -> None:
    refused(http.get(keyed + "/metrics"), 401, "invalid_api_key")
    refused(http.get(keyed + "/metrics", headers=bearer("sk-iso-open")), 403, "forbidden")
    assert http.get(keyed + "/metrics", headers=bearer(ADMIN)).status_code == 200
    refused(http.get(keyless + "/metrics", headers=bearer(ADMIN)), 404, None)
    for page in ("/openapi.json", "/docs", "/redoc"):
        refused(http.get(keyed + page), 404, None)
        assert http.get(keyless + page).status_code == 200


def test_models_show_no_path(keyless: str, engine, model_name: str) -> None:
    path = str(engine.loaded.path)
    listed = http.get(keyless + "/v1/models").json()["data"]
    one = http.get(keyless + f"/v1/models/{model_name}").json()
    assert listed[0]["root"] == model_name and one["root"] == model_name
    for card in (*listed, one):
        assert path not in str(card)
    refused(http.get(keyless + "/v1/models/no/such/model"), 404, "model_not_found")
    assert path not in http.get(keyless + "/v1/models/no/such/model").text
