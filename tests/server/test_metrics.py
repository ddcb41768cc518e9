"""`/metrics` in Prometheus text, `/health` and `/ready`: what a scrape shows after real requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.bench.upstream import serve_upstream
from tests.helpers import loopback
from tests.helpers.servers import serving

DOCS = [{"text": "The lighthouse at Varn was built in 1821."}, {"text": "Its keeper was Ada Moll."}]
ASK = [{"role": "user", "content": "Who kept the lighthouse?"}]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = loopback.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def url(settings, engine) -> Iterator[str]:
    with serving(settings, engine) as base:
        yield base


def test_requests_tokens_reuse_and_tiers_are_counted(url, model_name):
    before = scrape(url)
    body = {"model": model_name, "messages": ASK, "documents": DOCS, "max_tokens": 3, "temperature": 0}
    for _ in range(2):
        assert loopback.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    with loopback.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        r.read()
    one = {"model": model_name, "messages": ASK, "max_tokens": 1}  # no time between tokens
    assert loopback.post(url + "/v1/chat/completions", json=one, timeout=60).status_code == 200
    loopback.post(url + "/v1/chat/completions", json={"model": "nope", "messages": ASK})
    after = scrape(url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/chat/completions"
    assert grew("kvgate_requests_total", route=route, method="POST", status="200") == 4
    assert grew("kvgate_requests_total", route=route, method="POST", status="404") == 1
    assert grew("kvgate_request_duration_seconds_count", route=route) == 5
    assert grew("kvgate_time_to_first_token_seconds_count", route=route) == 1  # the stream
    assert grew("kvgate_prompt_tokens_total", model=model_name) > 0
    assert grew("kvgate_completion_tokens_total", model=model_name) == 10
    # The engine's stages of each answer generated (whole or streamed); a pace between tokens for those of 3.
    assert grew("kvgate_request_queue_time_seconds_count", route=route) == 4
    assert grew("kvgate_request_prefill_time_seconds_count", route=route) == 4
    assert grew("kvgate_time_per_output_token_seconds_count", route=route) == 3
    assert 0 < grew("kvgate_time_per_output_token_seconds_sum", route=route) < 3 * 10
    assert 0 <= grew("kvgate_request_queue_time_seconds_sum", route=route) < 4 * 10
    assert 0 < grew("kvgate_request_prefill_time_seconds_sum", route=route) < 4 * 10
    assert grew("kvgate_reused_prompt_tokens_total", mode="blend") > 0
    assert grew("kvgate_recompute_ratio_count") == 2  # the second and third request reused the documents
    assert grew("kvgate_document_kv_hits_total", tier="memory") >= 2
    assert ("kvgate_pinned_programs", ()) in after and ("kvgate_requests_waiting", ()) in after
    # The quality gate, per model and gated mode: the ratio served and the shadow checks so far.
    for mode in ("blend", "kvcomm"):
        labels = (("mode", mode), ("model", model_name))
        assert ("kvgate_reuse_gate_ratio", labels) in after and ("kvgate_shadow_checks_total", labels) in after
    assert value(after, "kvgate_reuse_gate_ratio", mode="blend", model=model_name) < 1.0
    assert value(after, "kvgate_reuse_gate_ladders", mode="blend", model=model_name) == 1  # KVCOMM: one per shape
    assert value(after, "kvgate_reuse_gate_withheld", mode="blend", model=model_name) == 0
    assert ("kvgate_shadow_due_total", ()) in after and ("kvgate_shadow_dropped_total", ()) in after


def test_health_is_liveness_and_ready_says_the_model_serves(url, model_name):
    assert loopback.get(url + "/health").json()["status"] == "ok"
    ready = loopback.get(url + "/ready").json()
    assert ready["status"] == "ready" and ready["model"] == model_name


def test_the_semantic_layer_is_counted_in_proxy_mode(tmp_path):
    from kvgate.gateway.settings import Settings

    with serve_upstream(models=("stub-a",)) as up:
        settings = Settings(proxy={"upstreams": [{"base_url": up, "models": ["stub-a"]}]}, cache_dir=tmp_path)
        with serving(settings, None) as url:
            ask = {"model": "stub-a", "messages": ASK, "temperature": 0}
            for _ in range(2):
                loopback.post(url + "/v1/chat/completions", json=ask, timeout=30).raise_for_status()
            samples = scrape(url)
    assert value(samples, "kvgate_cache_lookups_total", layer="semantic", result="miss") == 1
    assert value(samples, "kvgate_cache_lookups_total", layer="semantic", result="hit") == 1
    assert value(samples, "kvgate_prompt_tokens_total", model="stub-a") > 0  # from the upstream's usage


def test_refusals_are_counted_by_reason(tmp_path):
    """Each reason's series from the start, at 0; a rate limit's 429 (on OpenAI's and Anthropic's routes) and a
    body over the limit's 413 under theirs, whichever shape the error is answered in."""
    from kvgate.gateway.errors import REASONS, APIError, refusal
    from kvgate.gateway.settings import Settings

    with serve_upstream(models=("stub-a",)) as up:
        settings = Settings(
            proxy={"upstreams": [{"base_url": up, "models": ["stub-a"]}]},
            cache_dir=tmp_path,
            semantic_cache={"enabled": False},
            security={"rate_limit_rpm": 1, "max_body_bytes": 4096},
        )
        with serving(settings, None) as url:
            before = scrape(url)
            ask = {"model": "stub-a", "messages": ASK, "max_tokens": 2}
            assert loopback.post(url + "/v1/chat/completions", json=ask, timeout=30).status_code == 200
            assert loopback.post(url + "/v1/chat/completions", json=ask, timeout=30).status_code == 429
            assert loopback.post(url + "/v1/messages", json=ask, timeout=30).status_code == 429
            big = {**ask, "messages": [{"role": "user", "content": "x" * 5000}]}
            assert loopback.post(url + "/v1/chat/completions", json=big, timeout=30).status_code == 413
            after = scrape(url)
    assert {reason for reason in REASONS if ("kvgate_refused_total", (("reason", reason),)) in before} == set(REASONS)
    grown = {r: value(after, "kvgate_refused_total", reason=r) - value(before, "kvgate_refused_total", reason=r)
             for r in REASONS}  # fmt: skip
    assert {r: n for r, n in grown.items() if n} == {"rate_limit": 2, "request_too_large": 1}
    # The reason from the error's code; a 429 or 503 of another code is "other", and what refuses nothing, none.
    assert refusal(APIError(503, "full", code="server_queue_full")) == "server_queue_full"
    assert refusal(APIError(429, "the upstream's", code="upstream_error")) == "other"
    assert refusal(APIError(400, "bad", code="invalid_value")) is None


def test_label_values_callers_name_are_capped(tmp_path):
    """In proxy mode an upstream serving `*` answers any model name: the `model` label keeps the
    first MAX_VALUES names and counts the rest as `other`; an unknown HTTP method is `other` too."""
    import asyncio

    from kvgate.gateway.metrics import MAX_VALUES, OTHER, Metrics, Observe
    from kvgate.gateway.settings import Settings

    names = [f"m{i}" for i in range(MAX_VALUES + 6)]
    with serve_upstream(models=names) as up:
        settings = Settings(
            proxy={"upstreams": [{"base_url": up, "models": ["*"]}]},
            cache_dir=tmp_path,
            semantic_cache={"enabled": False},
        )
        with serving(settings, None) as url:
            for name in names:
                ask = {"model": name, "messages": ASK, "max_tokens": 2}
                loopback.post(url + "/v1/chat/completions", json=ask, timeout=30).raise_for_status()
            samples = scrape(url)
    labelled = {dict(labels)["model"] for (name, labels) in samples if name == "kvgate_prompt_tokens_total"}
    assert labelled == {*names[:MAX_VALUES], OTHER}
    assert value(samples, "kvgate_completion_tokens_total", model=OTHER) > 0

    async def answer(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 405, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def nothing(message) -> None:
        return None

    metrics = Metrics()
    for method in ("GET", "BREW", "PROPFIND-ME"):  # h11 (uvicorn without httptools) passes any token
        asyncio.run(Observe(answer, metrics)({"type": "http", "method": method}, None, nothing))
    methods = {s.labels["method"] for f in metrics.registry.collect() for s in f.samples if "method" in s.labels}
    assert methods == {"GET", OTHER}
