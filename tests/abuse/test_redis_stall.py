"""A Redis that stops answering, replayed against a real server and a real redis-server (with a
password): paused with SIGSTOP, then killed. Keys it holds and the admin routes answer 503
`redis_unavailable` within a bounded time, never a 500 or a wrong 401; keys from the settings file
go on (rate limits fail open); the password never reaches a log line."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from kvgate.gateway.settings import Settings
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import serving

PASSWORD = "s3cret-pw-4711"
ADMIN = "sk-stall-admin"
SETTINGS_KEY = "sk-stall-settings"
# An answer during an outage comes within this. Redis socket timeouts are 0.5 s; the rest is slack for a
# loaded machine (CI saw 2.8 s beside another test process); without a timeout a call waits for ever.
BOUND_S = 5.0


def only_503s(response: httpx.Response) -> None:
    response.read()
    if response.status_code >= 500:
        assert response.status_code == 503, f"{response.request.url}: {response.status_code} {response.text}"
        assert response.json()["error"]["code"] == "redis_unavailable"


http = httpx.Client(timeout=30, event_hooks={"response": [only_503s]})


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        with started.client() as raw:
            raw.config_set("requirepass", PASSWORD)
        yield started
        if started.process is not None and started.process.poll() is None:
            os.kill(started.process.pid, signal.SIGCONT)  # in case a test left it paused


@pytest.fixture(scope="module")
def url(settings: Settings, engine, server: RedisServer) -> Iterator[str]:
    given = {
        "redis_url": f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0",
        "security": {
            "api_keys": {SETTINGS_KEY: {"tenant": "settled", "rpm": 1000}},  # limits counted in Redis
            "admin_key": ADMIN,
        },
        "semantic_cache": {"enabled": True},  # its store in Redis too: the admin routes that change it
    }
    with serving(settings.model_copy(update=given), engine) as base:
        yield base


def get(url: str, token: str, path: str = "/v1/models") -> tuple[int, float]:
    started = time.monotonic()
    status = http.get(url + path, headers={"authorization": f"Bearer {token}"}).status_code
    return status, time.monotonic() - started


def admin(url: str, method: str, path: str, **kw) -> int:
    return http.request(method, url + path, headers={"authorization": f"Bearer {ADMIN}"}, **kw).status_code


def new_key(url: str) -> str:
    made = http.post(url + "/admin/keys", json={"tenant": "made"}, headers={"authorization": f"Bearer {ADMIN}"})
    assert made.status_code == 200
    return made.json()["key"]


def outage(url: str, fresh_key: str) -> None:
    """What every caller gets while Redis does not answer."""
    for token in (fresh_key, f"sk-not-a-key-{time.monotonic_ns()}"):  # not cached here: only Redis could tell
        status, took = get(url, token)
        assert status == 503 and took < BOUND_S
    status, took = get(url, SETTINGS_KEY)
    assert status == 200 and took < BOUND_S
    assert admin(url, "GET", "/admin/keys") == 503
    assert admin(url, "POST", "/admin/keys", json={"tenant": "t"}) == 503
    assert admin(url, "DELETE", "/admin/keys/key-0123456789abcdef") == 503
    started = time.monotonic()
    assert admin(url, "DELETE", "/admin/semantic-cache/tenants/someone") == 503
    assert time.monotonic() - started < BOUND_S + 1  # the semantic store's own timeout is 2 s
    r = http.get(url + "/v1/models", headers={"authorization": f"Bearer {fresh_key}"})
    assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "server_error"


def logged(caplog: pytest.LogCaptureFixture) -> str:
    text = caplog.text + "".join(r.exc_text or "" for r in caplog.records)
    assert "redis did not answer" in text and PASSWORD not in text
    return text


def test_a_paused_redis_is_a_503_and_then_keys_work_again(
    url: str, server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    key = new_key(url)
    caplog.set_level(logging.WARNING)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        outage(url, key)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert "redis://***@127.0.0.1" in logged(caplog)  # the limiter's warning (once an outage), its URL masked
    assert get(url, key)[0] == 200
    assert get(url, f"sk-not-a-key-{time.monotonic_ns()}")[0] == 401  # Redis answers again: an unknown key is one
    assert admin(url, "GET", "/admin/keys") == 200


def test_a_stopped_redis_is_a_503_and_its_password_is_in_no_log(
    url: str, server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    key = new_key(url)
    caplog.set_level(logging.WARNING)
    server.kill()
    outage(url, key)
    logged(caplog)


def test_any_log_line_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever formats a secret into a message or a traceback, on kvgate's loggers or uvicorn's."""
    from kvgate.gateway import logs

    logs.install()
    uvicorn = logging.getLogger("uvicorn.error")
    uvicorn.addHandler(caplog.handler)  # uvicorn's loggers do not propagate to the root
    try:
        caplog.set_level(logging.INFO)
        logging.getLogger("kvgate.keys").warning("connecting to %s", f"rediss://user:{PASSWORD}@host:6380")
        uvicorn.warning("GET /v1/models?api_key=%s Authorization: Bearer %s", PASSWORD, PASSWORD)
        try:
            redis.Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:1", socket_connect_timeout=0.5).ping()
        except redis.ConnectionError as exc:
            logging.getLogger("kvgate.limits").warning("http://admin:%s@proxy failed: %s", PASSWORD, exc)
        try:
            raise ValueError(f"cannot read redis://:{PASSWORD}@127.0.0.1")  # a message that quotes a secret
        except ValueError:
            logging.getLogger("kvgate").exception("in a traceback")
    finally:
        uvicorn.removeHandler(caplog.handler)
    text = caplog.text
    assert "rediss://***@host" in text and "http://***@proxy" in text
    # Another library's filter (litellm's, once imported) may mask the uvicorn line first: ours, alone
    assert logs.redacted(f"Authorization: Bearer {PASSWORD}") == "Authorization: Bearer ***"
    assert "ValueError: cannot read redis://***@127.0.0.1" in text
    assert PASSWORD not in text
