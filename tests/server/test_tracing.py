"""OpenTelemetry traces (`operations.tracing`): a real OTLP/HTTP receiver on loopback (tests/helpers/otlp.py) gets,
through the SDK's own exporter, a span for each stage of a request, under the span of the request, which is the
child of the caller's `traceparent`; a request kvgate proxies carries the trace on to its upstream."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from tests.helpers.otlp import Received, Receiver, receiving
from tests.helpers.raw_upstream import HELLO, RawUpstream, completion, json_answer
from tests.helpers.servers import serving

QUESTION = "Where was the author of The Lantern Road educated?"
DOCS = [
    "The Lantern Road is a novel about a ferry town on the river Ashen, written by Oriel Thatchwood (traced).",
    "Oriel Thatchwood was a writer and cartographer. She was educated at Quenmere College in Vellmoor (traced).",
]
CHAT = "POST /v1/chat/completions"
STAGES = ["kvgate.admission", "kvgate.kv_load", "kvgate.blend", "kvgate.prefill", "kvgate.decode"]
SERVER, CLIENT_KIND = 2, 3  # OTLP's SpanKind values: SPAN_KIND_SERVER, SPAN_KIND_CLIENT
EPSILON_NS = 1_000_000  # each span's times are converted from the monotonic clock on their own: a jitter of µs


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """The receiver, and the OTEL_* variables that send every traced app's spans there (read as each app starts):
    batches every 20 ms, so that a test waits little for its spans."""
    with receiving() as found, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", found.url)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
        env.setenv("OTEL_SERVICE_NAME", "kvgate-traced")
        yield found


@pytest.fixture(scope="module")
def traced(
    receiver: Receiver, prefix_settings: Settings, prefix_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A traced server over the session's engine with prefix caching (as every server has by default), its
    semantic cache on."""
    path = tmp_path_factory.mktemp("traced") / "semantic.sqlite3"
    semantic = {"enabled": True, "path": path, "verify_rate": 0.0}  # a would-be hit is a hit: none answered again
    update = {"operations": {"tracing": True}, "semantic_cache": semantic}
    with serving(prefix_settings.model_copy(update=update), prefix_engine) as url:
        yield url


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def parent() -> tuple[str, str, dict[str, str]]:
    """A caller's trace: its trace id, its span's id, and the headers that carry them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "caller=1"}


def named(spans: list[Received], name: str) -> Received:
    (found,) = [s for s in spans if s.name == name]
    return found


def ask_with_documents(url: str, model: str, headers: dict[str, str]):
    return sdk(url).chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=4,
        extra_body={"documents": [{"text": d} for d in DOCS], "kvgate": {"reuse": "blend", "recompute_ratio": 0.2}},
        extra_headers=headers,
    )


def test_a_documents_request_has_a_span_per_stage_under_the_callers_trace(
    traced: str, receiver: Receiver, model_name: str
) -> None:
    ask_with_documents(traced, model_name, {"cache-control": "no-store"})  # its documents' KV computed and kept
    trace_id, caller, headers = parent()
    raw = ask_with_documents(traced, model_name, headers)  # read back and blended
    answer = raw.parse()
    spans = receiver.trace(trace_id, [CHAT, "kvgate.semantic_lookup", "kvgate.prompt", *STAGES])
    request = named(spans, CHAT)
    assert (request.parent, request.kind, request.service) == (caller, SERVER, "kvgate-traced")
    said = request.attributes
    assert said["http.route"] == "/v1/chat/completions" and said["http.response.status_code"] == 200
    assert said["gen_ai.request.model"] == model_name
    assert len(said["kvgate.tenant"]) == 16 and said["kvgate.request_id"] == raw.headers["x-request-id"]
    assert said["kvgate.reuse.reused_tokens"] == int(raw.headers["x-kvgate-reused-tokens"]) > 0
    assert said["kvgate.reuse.fidelity"] == raw.headers["x-kvgate-fidelity"]
    children = [s for s in spans if s is not request]
    assert {s.parent for s in children} == {request.span_id}
    assert all(request.start_ns <= s.start_ns <= s.end_ns <= request.end_ns for s in children)

    lookup = named(spans, "kvgate.semantic_lookup").attributes
    assert lookup == {"kvgate.cache": "miss", "kvgate.cache.category": raw.headers["x-kvgate-cache-category"]}
    stages = [named(spans, name) for name in STAGES]
    for before, after in zip(stages, stages[1:]):  # one after the other, each from where the one before ended
        assert abs(after.start_ns - before.end_ns) < EPSILON_NS, (before.name, after.name)
    load, blend, prefill, decode = (s.attributes for s in stages[1:])
    reused, recomputed = int(raw.headers["x-kvgate-reused-tokens"]), int(raw.headers["x-kvgate-recomputed-tokens"])
    assert "memory" in load["kvgate.kv.tiers"] and load["kvgate.kv.entries"] >= len(DOCS)
    assert load["kvgate.kv.tokens"] == reused + recomputed and load["kvgate.kv.bytes"] > 0
    assert blend["kvgate.reuse.mode"] == raw.headers["x-kvgate-reuse"] == "blend"
    assert blend["kvgate.blend.selected_tokens"] == recomputed > 0 and blend["kvgate.blend.recompute_ratio"] == 0.2
    assert blend["kvgate.reuse.fidelity"] == raw.headers["x-kvgate-fidelity"]
    prompt = answer.usage.prompt_tokens
    assert (prefill["kvgate.prefill.reused_tokens"], prefill["kvgate.prefill.computed_tokens"]) == (
        reused,
        prompt - reused,
    )
    assert decode["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens

    # Asked again: the semantic cache answers, and the trace says so, with nothing generated.
    trace_id, caller, headers = parent()
    assert ask_with_documents(traced, model_name, headers).headers["x-kvgate-cache"] == "hit"
    spans = receiver.trace(trace_id, [CHAT, "kvgate.semantic_lookup"])
    assert named(spans, "kvgate.semantic_lookup").attributes["kvgate.cache"] == "hit"
    assert {s.name for s in spans} == {CHAT, "kvgate.semantic_lookup"}  # the stages' spans end before the request's


def test_a_stream_through_a_front_continues_the_trace_in_the_kvgate_behind_it(
    traced: str, receiver: Receiver, model_name: str, tmp_path: Path
) -> None:
    upstream = {"name": "runtime", "base_url": f"{traced}/v1", "models": [model_name]}
    settings = Settings(
        proxy={"upstreams": [upstream]}, operations={"tracing": True}, semantic_cache={"enabled": False}
    )
    trace_id, caller, headers = parent()
    with serving(settings, None) as front:
        ask = [{"role": "user", "content": "Name a colour."}]
        streamed = sdk(front).chat.completions.create(
            model=model_name, messages=ask, max_tokens=2, extra_headers=headers, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        spans = receiver.trace(trace_id, [CHAT, CHAT, "kvgate.upstream", "kvgate.decode"])
    front_span = next(s for s in spans if s.name == CHAT and s.parent == caller)
    behind = next(s for s in spans if s.name == CHAT and s is not front_span)
    assert behind.parent == front_span.span_id  # the front's traceparent named its request's span
    assert named(spans, "kvgate.upstream").parent == front_span.span_id
    assert named(spans, "kvgate.upstream").attributes["kvgate.upstream"] == "runtime"
    assert named(spans, "kvgate.decode").parent == behind.span_id


def test_a_raw_upstream_gets_the_traceparent_and_tracestate(receiver: Receiver, tmp_path: Path) -> None:
    upstream = RawUpstream(lambda seen: json_answer(completion("hi")))
    trace_id, caller, headers = parent()
    with upstream:
        upstreams = [{"name": "raw", "base_url": upstream.url + "/v1", "models": ["stub-a"]}]
        settings = Settings(proxy={"upstreams": upstreams}, operations={"tracing": True}, cache_dir=tmp_path)
        with serving(settings.model_copy(update={"semantic_cache": {"enabled": False}}), None) as front:
            sdk(front).chat.completions.create(model="stub-a", messages=HELLO, extra_headers=headers)
            untraced = sdk(front).chat.completions.create(model="stub-a", messages=HELLO)
    (front_span,) = [s for s in receiver.trace(trace_id, [CHAT]) if s.name == CHAT]
    sent, alone = (seen.headers for seen in upstream.seen)
    assert sent["traceparent"] == f"00-{trace_id}-{front_span.span_id}-01"
    assert sent["tracestate"] == "caller=1"
    # A caller that sent none: the front's request starts a trace, and the upstream is in it too.
    assert alone["traceparent"].split("-")[1] not in (trace_id, "0" * 32) and untraced.choices
