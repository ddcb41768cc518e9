"""Fuzzing: schemathesis sends what the gateway's OpenAPI schema allows (and what it forbids) to real servers on
loopback; whatever a client sends, the answer is never a 5xx (schemathesis's check `not_a_server_error`).

Two gateways: over the real model (the session's engine), and in proxy mode over a stub upstream. Each is fuzzed
twice: open, every request carrying the admin key (so the admin endpoints run too), and with API keys required,
every request carrying a valid one (the admin endpoints stay closed; a third of the examples: EXAMPLES).

Every operation of the schema gets its own Hypothesis run of valid and invalid requests (a new random sample each
run). The 5xx found are reported together, each with a curl command that replays it; the server's traceback is in
the captured log."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode, HookContext
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup

from kvgate.bench.upstream import serve_upstream
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from tests.helpers.servers import serving

API_KEY, ADMIN_KEY = "sk-test", "sk-admin"
STUB_MODEL = "stub-a"
GENERATING = ("POST /v1/chat/completions", "POST /v1/completions")
FUZZ = settings(
    max_examples=80,  # per operation, valid and invalid requests together: 30-60 s a gateway over the model
    deadline=None,
    database=None,  # no failing examples saved for the next run: the report says what failed
    phases=[Phase.explicit, Phase.generate],  # no shrinking: minutes of model calls; the curl shows the request
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
# The reproductions say what was sent: schemathesis would print "[Filtered]" for max_tokens and the bearer.
CONFIG = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
# The fuzzer may ask for 8k new tokens (the model's whole window; `ignore_eos` makes the model take them all) in
# 16 choices: many minutes a request on two CPU cores. A smaller `max_model_len` in the gateway's Settings does not
# bound that: the context window is the engine's, fixed when it was built (Settings.engine.max_model_len reaches it only
# through Settings.engine_config()), and the gateway over the session's engine still takes 300 new tokens with
# max_model_len=256 in its Settings. So bodies are bounded before they are sent (bound_generation).
MAX_TOKENS = 4  # what a longer answer would add is more decode steps of the same code
MAX_CHOICES = 4  # `n` and `best_of` up to 128 (max_request_seqs) are as many prefills: minutes, and no other code

VARIANTS = {
    "admin-key": ({"security": {"admin_key": ADMIN_KEY}}, {"authorization": f"Bearer {ADMIN_KEY}"}),
    "api-key": ({"security": {"api_keys": {API_KEY: "tenant-a"}}}, {"authorization": f"Bearer {API_KEY}"}),
}
# Examples per operation: the open variant reaches every route and is the deep run; with keys required the
# same bodies meet the same code past authentication (and the admin routes a 401), so a quarter of them.
EXAMPLES = {"admin-key": FUZZ.max_examples, "api-key": FUZZ.max_examples // 4}


@dataclass(frozen=True)
class Gateway:
    url: str
    headers: dict[str, str]  # what every fuzzed request carries
    model: str  # the model it serves
    examples: int  # per operation


def fuzz(
    schema: schemathesis.BaseSchema, gateway: Gateway, prepare: Callable[[Case], None] = lambda _: None
) -> dict[str, Counter[int]]:
    """Every operation of `schema` against `gateway`; fails with every 5xx found, else says what answered."""
    schema.hook(served_model_mostly(gateway.model))
    statuses: dict[str, Counter[int]] = {}
    found = []
    for result in schema.get_all_operations():
        operation = result.ok()
        try:
            statuses[operation.label] = fuzz_operation(operation, gateway, prepare)
        except Exception as exc:
            found.append(f"{operation.label}: {exc}")
    assert not found, "\n\n".join(found)
    return statuses


def fuzz_operation(
    operation: schemathesis.APIOperation, gateway: Gateway, prepare: Callable[[Case], None]
) -> Counter[int]:
    """One Hypothesis run of valid and invalid requests to `operation`; the statuses of the answers."""
    seen: Counter[int] = Counter()
    valid, invalid = (operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE))

    @settings(FUZZ, max_examples=gateway.examples)
    @given(case=valid | invalid)
    def never_5xx(case: Case) -> None:
        prepare(case)
        try:
            response = case.call_and_validate(headers=gateway.headers, checks=[not_a_server_error], timeout=120)
        except FailureGroup as failed:  # a BaseExceptionGroup, which Hypothesis would neither catch nor shrink
            raise AssertionError(str(failed)) from None
        except requests.Timeout:  # no shrinking: say what was sent
            raise AssertionError(f"no answer within 120 s: {case.as_curl_command(headers=gateway.headers)}") from None
        seen[response.status_code] += 1

    never_5xx()
    return seen


def served_model_mostly(model: str) -> Callable[[HookContext, Any], st.SearchStrategy[Any]]:
    """A hook: three bodies in four name the served model, so they get past the model check to the work."""

    def flatmap_body(context: HookContext, body: Any) -> st.SearchStrategy[Any]:
        if not isinstance(body, dict) or "model" not in body:
            return st.just(body)
        served = {**body, "model": model}
        return st.sampled_from([served, served, served, body])

    return flatmap_body


def within_rules(case: Case) -> None:
    """What gateway.protocol's validators check beyond the schema, made to hold for a valid (positive) body, so
    that most of those reach the engine rather than a 400."""
    body = case.body
    if case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE or not isinstance(body, dict):
        return
    # Bodies allow fields they do not name (as OpenAI's do): an admin body may carry "messages": 0.5.
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and message.get("content") is None:
            message["content"] = "hi"
    stop = body.get("stop")
    if stop == "" or (isinstance(stop, list) and "" in stop):
        del body["stop"]
    if not body.get("stream"):
        body.pop("stream_options", None)
    if body.get("top_logprobs"):
        body["logprobs"] = True
    if body.get("echo"):
        body.pop("logprobs", None)
    if body.get("prompt") in ("", []):
        body["prompt"] = "hi"
    body.pop("suffix", None)
    body.pop("best_of", None)


def bound_generation(case: Case) -> None:
    """At most MAX_TOKENS new tokens a choice and MAX_CHOICES choices: a larger bound is lowered, a missing one
    added; an invalid one is left for the gateway to refuse."""
    body = case.body
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        try:
            number = float(body[field])  # pydantic reads 9000.0 and "9000" as 9000 too
        except (KeyError, TypeError, ValueError):
            continue
        if not number <= MAX_TOKENS:
            body[field] = MAX_TOKENS
    for field in ("n", "best_of"):
        if isinstance(body.get(field), int) and body[field] > MAX_CHOICES:
            body[field] = MAX_CHOICES
    if case.path.endswith("/responses"):
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


# --- the gateway over the real model ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(VARIANTS))
def engine_gateway(
    request: pytest.FixtureRequest, engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    values, headers = VARIANTS[request.param]
    # Only the gateway's own settings count here: the engine, its window and its KV store are the session's.
    config = Settings(semantic_cache={"enabled": False}, cache_dir=tmp_path_factory.mktemp("fuzz-engine"), **values)
    with serving(config, engine) as url:
        yield Gateway(url, headers, engine.loaded.name, EXAMPLES[request.param])


# Its Hypothesis run over the model: 90 s in a process of its own, 180-300 s beside another test file (`make test`
# runs two); past pytest's 300 s the timeout lands inside an example, which Hypothesis then calls flaky.
@pytest.mark.timeout(900)
def test_the_gateway_over_the_model_never_answers_5xx(engine_gateway: Gateway) -> None:
    schema = schemathesis.openapi.from_url(engine_gateway.url + "/openapi.json", config=CONFIG)

    def prepare(case: Case) -> None:
        within_rules(case)
        bound_generation(case)

    statuses = fuzz(schema, engine_gateway, prepare)
    for label in GENERATING:  # not only refusals: some requests were run on the model
        assert statuses[label][200] > 0, f"{label}: {dict(statuses[label])}"


# --- proxy mode ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serve_upstream(models=(STUB_MODEL,)) as url:
        yield url


@pytest.fixture(scope="module", params=list(VARIANTS))
def proxy_gateway(
    request: pytest.FixtureRequest, upstream: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    values, headers = VARIANTS[request.param]
    upstreams = [{"base_url": upstream, "models": [STUB_MODEL]}]
    cache = tmp_path_factory.mktemp("fuzz-proxy")
    config = Settings(proxy={"upstreams": upstreams}, semantic_cache={"enabled": False}, cache_dir=cache, **values)
    with serving(config, None) as url:  # no engine: proxy mode
        yield Gateway(url, headers, STUB_MODEL, EXAMPLES[request.param])


def test_the_gateway_in_proxy_mode_never_answers_5xx(proxy_gateway: Gateway) -> None:
    schema = schemathesis.openapi.from_url(proxy_gateway.url + "/openapi.json", config=CONFIG)
    statuses = fuzz(schema, proxy_gateway)
    for label in GENERATING:  # not only refusals: some requests were answered by the upstream
        assert statuses[label][200] > 0, f"{label}: {dict(statuses[label])}"
