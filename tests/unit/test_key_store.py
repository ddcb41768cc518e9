"""The key store: keys from the settings file (their defaults, what a wrong entry says), keys created
in this process or in a real Redis (found through a short cache, listed, revoked), and the tenant secret
that names keyless tokens' tenants (made once, 0600, never readable by others even for a moment)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from kvgate.gateway.errors import APIError
from kvgate.gateway.keys import (
    ANONYMOUS,
    CACHE_MAX,
    CACHE_S,
    REDIS_PREFIX,
    SECRET_FILE,
    SECRET_KEY,
    Key,
    Keys,
    authenticate,
    private_file,
    spend,
)
from kvgate.gateway.limits import Limits
from kvgate.gateway.settings import Settings
from tests.server.test_auth import app_of, request

pytestmark = pytest.mark.anyio


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def store(tmp_path: Path, clock: Clock | None = None, cache_max: int = CACHE_MAX, **settings: Any) -> Keys:
    given = Settings(cache_dir=tmp_path, semantic_cache={"enabled": False}).model_copy(update=settings)
    return Keys(given, clock or time.monotonic, cache_max)


# --- keys from the settings file --------------------------------------------------------------------


async def test_a_settings_key_takes_the_default_limits_it_does_not_set(tmp_path: Path) -> None:
    given = {"sk-a": "a", "sk-b": {"tenant": "b", "models": ["m1", "m2"], "tpm": 3}, "sk-c": {"tenant": "c", "rpm": 4}}
    keys = store(tmp_path, security={"api_keys": given, "rate_limit_rpm": 5, "rate_limit_tpm": 7})
    assert await keys.find("sk-a") == Key("key-" + digest("sk-a")[:16], "a", (), Limits(5, 7), "settings")
    assert await keys.find("sk-b") == Key("key-" + digest("sk-b")[:16], "b", ("m1", "m2"), Limits(5, 3), "settings")
    assert (await keys.find("sk-c")).limits == Limits(4, 7)
    assert await keys.find("sk-d") is None
    await keys.close()  # nothing to close without Redis


WRONG = [
    {"tenant": "a", "rmp": 3},
    {"models": ["m"]},
    {"tenant": 7},
    {"tenant": ""},
    {"tenant": "a", "models": "llama"},  # a string would read as its letters: every model refused, silently
    {"tenant": "a", "models": [7]},
    {"tenant": "a", "rpm": "60"},  # it crashed the start with a TypeError from Limits
    {"tenant": "a", "tpm": True},
]


@pytest.mark.parametrize("spec", WRONG)
def test_a_wrong_settings_entry_is_refused_naming_its_hash_not_the_key(tmp_path: Path, spec: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as refused:
        store(tmp_path, security={"api_keys": {"sk-secret-key": spec}})
    said = str(refused.value)
    assert said.startswith(f"api key {digest('sk-secret-key')[:12]}...: expected a tenant or {{tenant, models, rpm,")
    assert "sk-secret-key" not in said


# --- keys created in this process -------------------------------------------------------------------


async def test_a_key_created_without_redis_lives_in_this_process(tmp_path: Path) -> None:
    keys = store(tmp_path, security={"rate_limit_rpm": 9})
    token, key = await keys.create("t", ["m"], Limits(None, 11))
    assert key == Key("key-" + digest(token)[:16], "t", ("m",), Limits(9, 11), "memory")
    assert await keys.find(token) == key and key in await keys.all()
    assert digest(token) in keys.known and token not in keys.known  # kept hashed
    assert await keys.revoke(key.id) and await keys.find(token) is None


# --- keys created in Redis ----------------------------------------------------------------------------


async def test_a_key_created_in_redis_is_found_and_listed_by_every_process(tmp_path: Path, redis_url: str) -> None:
    one, two = (
        store(tmp_path, redis_url=redis_url, security={"rate_limit_tpm": 8}),
        store(tmp_path, redis_url=redis_url),
    )
    token, key = await one.create("t", [], Limits(2, None))
    assert key == Key("key-" + digest(token)[:16], "t", (), Limits(2, 8), "redis")
    assert await two.find(token) == Key(key.id, "t", (), Limits(2, None), "redis")  # two's own defaults
    raw = redis.Redis.from_url(redis_url)
    raw.set("unrelated", "not json")  # what else lives in the same Redis is not a key
    raw.set("kvgate:other:x", "not json")
    assert await one.all() == [key]
    assert [k.card() for k in await two.all()] == [{**key.card(), "tpm": None}]
    assert await two.revoke(key.id)  # never looked up by two: nothing cached to forget
    assert await one.find(token) is None and await one.all() == []
    assert not await one.revoke(key.id) and not await one.revoke("key-0123456789abcdef")
    assert raw.get("unrelated") == b"not json"
    raw.close()
    for keys in (one, two):
        await keys.close()


class Clock:
    """The key store's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_key_revoked_in_another_process_stops_working_within_the_cache_time(
    tmp_path: Path, redis_url: str
) -> None:
    clock = Clock()
    mine, theirs = store(tmp_path, clock, redis_url=redis_url), store(tmp_path, clock, redis_url=redis_url)
    token, key = await theirs.create("t", [], Limits())
    assert (await mine.find(token)).id == key.id
    assert await theirs.revoke(key.id)
    clock.now = 1000.0 + CACHE_S - 0.5
    assert (await mine.find(token)).id == key.id  # cached: no Redis command
    clock.now = 1000.0 + CACHE_S
    assert await mine.find(token) is None  # the cache time is up: Redis says it is gone
    for keys in (mine, theirs):
        await keys.close()


async def test_the_lookup_cache_is_bounded(tmp_path: Path, redis_url: str) -> None:
    keys = store(tmp_path, cache_max=3, redis_url=redis_url)
    for i in range(3):
        assert await keys.find(f"unknown-{i}") is None
    assert len(keys.cached) == 3
    assert await keys.find("unknown-3") is None
    assert list(keys.cached) == [digest("unknown-3")]  # full: emptied, then this one
    await keys.close()


async def test_a_key_is_kept_in_redis_under_its_hash(redis_url: str, tmp_path: Path) -> None:
    assert REDIS_PREFIX == "kvgate:key:"
    with redis.Redis.from_url(redis_url) as raw:
        raw.set(REDIS_PREFIX + digest("sk-planted"), '{"tenant": "planted", "models": ["m"]}')
    keys = store(tmp_path, redis_url=redis_url)
    assert (await keys.find("sk-planted")).source == "redis"
    card = [k.card() for k in await keys.all()]
    await keys.close()
    assert card == [{"id": "key-" + digest("sk-planted")[:16], "object": "api_key", "tenant": "planted",
                     "models": ["m"], "rpm": None, "tpm": None, "source": "redis"}]  # fmt: skip


# --- what a key's tokens cost -------------------------------------------------------------------------


async def test_even_one_token_counts_against_a_tokens_per_minute_limit(tmp_path: Path) -> None:
    app = app_of(tmp_path, security={"api_keys": {"sk-one": {"tenant": "t", "tpm": 1}}})
    first = request(app, "sk-one")
    await authenticate(first)
    await spend(first, 1)
    with pytest.raises(APIError) as refused:
        await authenticate(request(app, "sk-one"))
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"


# --- the tenant secret --------------------------------------------------------------------------------


def test_the_secrets_file_is_private_before_its_first_byte_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)  # the most permissive: only the mode asked for protects the file
    try:
        made = private_file(tmp_path / "fresh")
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o600 and made.stat().st_size == 0
    with pytest.raises(FileExistsError):  # never over a file already there
        private_file(made)


def test_the_secret_is_made_once_and_kept_private(tmp_path: Path) -> None:
    where = tmp_path / "not" / "yet" / "there"
    one = store(where)
    secret = (where / SECRET_FILE).read_text()
    assert stat.S_IMODE((where / SECRET_FILE).stat().st_mode) == 0o600
    assert len(secret) == 64 and int(secret, 16) >= 0  # 256 bits, hex
    assert [p.name for p in where.iterdir()] == [SECRET_FILE]  # no temporary file left
    again = store(where)  # a restart, or another process: the same secret, the same tenants
    assert one.tenant("tok") == again.tenant("tok")
    assert one.tenant("tok") == "anon-" + hmac.new(secret.encode(), b"tok", "sha256").hexdigest()[:24]


def test_a_secret_file_someone_else_could_read_is_made_private(tmp_path: Path) -> None:
    (tmp_path / SECRET_FILE).write_text("s" * 32 + "\n")
    (tmp_path / SECRET_FILE).chmod(0o644)
    keys = store(tmp_path)
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600
    assert keys.tenant("tok") == "anon-" + hmac.new(b"s" * 32, b"tok", "sha256").hexdigest()[:24]  # 32 will do


def test_a_short_secret_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / SECRET_FILE).write_text("s" * 31)
    with caplog.at_level(logging.WARNING, logger="kvgate.keys"):
        one, two = store(tmp_path), store(tmp_path)
    assert one.tenant("tok") != two.tenant("tok")  # each process its own: no shared tenants
    assert one.tenant("tok") != "anon-" + hmac.new(b"s" * 31, b"tok", "sha256").hexdigest()[:24]
    said = f"{tmp_path / SECRET_FILE} is too short; token tenants get a secret of this process"
    assert caplog.messages == [said, said]


def test_a_cache_dir_that_cannot_hold_the_secret_gives_a_secret_of_this_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="kvgate.keys"):
        keys = store(tmp_path / "file" / "cache")
    assert keys.tenant("tok") == keys.tenant("tok") != store(tmp_path / "file" / "cache").tenant("tok")
    assert keys.tenant("tok").startswith("anon-") and keys.tenant("") == ANONYMOUS
    said = caplog.messages[0]
    assert said.startswith(f"cannot keep the tenant secret in {tmp_path / 'file' / 'cache' / SECRET_FILE} (")
    assert "Not a directory" in said and said.endswith("); token tenants get one of this process")


def test_a_server_that_requires_keys_keeps_no_tenant_secret(tmp_path: Path) -> None:
    store(tmp_path / "keyed", security={"api_keys": {"sk-a": "a"}})
    assert not (tmp_path / "keyed" / SECRET_FILE).exists()  # no keyless tenants to name
    store(tmp_path / "open", security={"api_keys": {"sk-a": "a"}, "require_api_key": False})
    assert (tmp_path / "open" / SECRET_FILE).exists()


async def test_fronts_on_one_redis_name_a_tokens_tenant_alike_whatever_their_cache_dirs(
    tmp_path: Path, redis_url: str
) -> None:
    """Two machines: each its own cache_dir, one Redis. The first front makes the secret there; every
    other front takes that one, so a token's documents and answers are its own on any of them."""
    one, two = store(tmp_path / "a", redis_url=redis_url), store(tmp_path / "b", redis_url=redis_url)
    tenant = await one.named("tok")
    assert await two.named("tok") == tenant != await two.named("tok2")
    with redis.Redis.from_url(redis_url) as raw:
        secret = raw.get(SECRET_KEY)
    assert len(secret) == 64 and tenant == "anon-" + hmac.new(secret, b"tok", "sha256").hexdigest()[:24]
    assert not (tmp_path / "a" / SECRET_FILE).exists()  # the fleet's secret, not this machine's
    assert await store(tmp_path / "c", redis_url=redis_url).named("tok") == tenant  # a front started later
    assert await one.named("") == ANONYMOUS
    await one.close()
    await two.close()


async def test_a_configured_tenant_secret_names_tenants_alike_and_is_never_shown(
    tmp_path: Path, redis_url: str
) -> None:
    given = "t" * 40
    one = store(tmp_path / "a", security={"tenant_secret": given})
    two = store(tmp_path / "b", security={"tenant_secret": given}, redis_url=redis_url)
    assert (
        await one.named("tok")
        == await two.named("tok")
        == "anon-" + hmac.new(given.encode(), b"tok", "sha256").hexdigest()[:24]
    )
    assert not (tmp_path / "a" / SECRET_FILE).exists()
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.get(SECRET_KEY) is None  # the settings' secret wins: nothing made in Redis
    assert given not in repr(Settings(security={"tenant_secret": given})) and given not in str(
        Settings(security={"tenant_secret": given})
    )
    with pytest.raises(ValidationError) as refused:
        Settings(security={"tenant_secret": "s" * 31})
    assert "at least 32 characters" in str(refused.value) and "s" * 31 not in str(refused.value)
    await two.close()
