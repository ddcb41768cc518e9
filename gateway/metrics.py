"""`GET /metrics` in Prometheus text: snake_case names in base units, `_total` on counters. Request
counts, latency, time to first token and refusals come from a middleware; tokens, reuse and the engine's stages
(queue, prefill, time per output token) from the routes;
cache tiers, pins and queues are read from their owners at scrape time (nothing on the hot path)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.gateway.errors import REASONS
from kvgate.runtime.reuse_report import ReuseReport
from kvgate.runtime.stages import Stages

disable_created_metrics()  # the *_created series double the output and say little
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Time per output token: a CPU's small model decodes in a few ms a token, a GPU's in tens of ms under load.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
MAX_VALUES = 64  # distinct values of a label a caller names (a model in proxy mode with "*"); then OTHER
OTHER = "other"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Capped:
    """A label's values as they come, up to `limit` distinct ones; any new one after that is OTHER, so
    that callers cannot grow the series without bound."""

    def __init__(self, limit: int = MAX_VALUES) -> None:
        self.limit, self.seen = limit, set[str]()

    def __call__(self, value: str) -> str:
        if value in self.seen:
            return value
        if len(self.seen) >= self.limit:
            return OTHER
        self.seen.add(value)
        return value


class Metrics:
    """One registry per app, so that several apps in one process (tests) do not collide."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open files (on Linux)
        self.model = Capped()
        self.requests = Counter("kvgate_requests", "HTTP requests", ["route", "method", "status"], registry=r)
        self.latency = Histogram(
            "kvgate_request_duration_seconds", "request latency", ["route"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "streamed responses: time to the first event",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.refused = Counter("kvgate_refused", "requests refused, by reason", ["reason"], registry=r)
        for reason in REASONS:  # each series from the start, at 0
            self.refused.labels(reason)
        self.queue_time = Histogram(
            "kvgate_request_queue_time_seconds",
            "engine: a request's wait from its arrival to its admission",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "kvgate_request_prefill_time_seconds",
            "engine: admission to the first token (reading KV, blending, prefill)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvgate_time_per_output_token_seconds",
            "answers of 2 tokens or more: (last token - first token) / (tokens - 1)",
            ["route"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "prompt tokens", ["model"], registry=r)
        self.completion_tokens = Counter("kvgate_completion_tokens", "completion tokens", ["model"], registry=r)
        self.lookups = Counter(
            "kvgate_cache_lookups", "cache lookups by layer and result", ["layer", "result"], registry=r
        )
        self.reused = Counter(
            "kvgate_reused_prompt_tokens", "prompt tokens whose KV was reused, by how", ["mode"], registry=r
        )
        self.recomputed = Counter(
            "kvgate_recomputed_prompt_tokens", "reused prompt tokens computed again (blend)", registry=r
        )
        self.recompute_ratio = Histogram(
            "kvgate_recompute_ratio",
            "per request with reused KV: recomputed / reused tokens",
            buckets=RATIO_BUCKETS,
            registry=r,
        )

    def usage(self, model: str, counted: dict[str, Any]) -> None:
        prompt, completion = counted.get("prompt_tokens") or 0, counted.get("completion_tokens") or 0
        if not prompt and not completion:  # nothing answered: no series for a name that served nothing
            return
        self.prompt_tokens.labels(self.model(model)).inc(prompt)
        self.completion_tokens.labels(self.model(model)).inc(completion)

    def reuse(self, report: ReuseReport) -> None:
        if report.reused <= 0:
            return
        self.reused.labels(report.mode or "unknown").inc(report.reused)
        self.recomputed.inc(report.recomputed)
        self.recompute_ratio.observe(report.recomputed / report.reused)

    def stages(self, scope: Scope, stages: Stages | None) -> None:
        """A generated answer's stages in the engine (its first choice's), by its request's route: queue, prefill,
        time per output token."""
        if stages is None or stages.admitted is None:
            return
        route = route_of(scope)
        self.queue_time.labels(route).observe(stages.admitted - stages.arrived)
        if stages.first_token is None:
            return
        self.prefill_time.labels(route).observe(stages.first_token - stages.admitted)
        if stages.generated > 1:
            self.tpot.labels(route).observe((stages.ended - stages.first_token) / (stages.generated - 1))

    def watch(self, read: Callable[[], Iterator[Metric]]) -> None:
        """Add metrics read at scrape time."""
        self.registry.register(Reader(read))

    def text(self) -> bytes:
        return generate_latest(self.registry)


def merged(own: bytes, others: dict[str, str]) -> bytes:
    """This process's metrics with other processes' (a front's workers), each of their samples
    labelled with its process's name; families of the same name become one."""
    families: dict[str, Metric] = {f.name: f for f in text_string_to_metric_families(own.decode())}
    for name, text in others.items():
        for family in text_string_to_metric_families(text):
            samples = [s._replace(labels={**s.labels, "worker": name}) for s in family.samples]
            if family.name in families:
                families[family.name].samples.extend(samples)
            else:
                family.samples = samples
                families[family.name] = family
    registry = CollectorRegistry()
    registry.register(Reader(lambda: iter(families.values())))
    return generate_latest(registry)


class Reader(Collector):
    def __init__(self, read: Callable[[], Iterator[Metric]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        return self.read()


def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def fidelity_metrics(
    model: str, gate: Iterable[tuple[str, dict[str, float]]], due: int, dropped: int
) -> Iterator[Metric]:
    """The quality gate's shadow checks per reuse mode: how far reuse moved first tokens, and the
    recompute ratio each mode is served at now (1: full prefill, reuse withheld)."""
    kinds = {
        "checks": (CounterMetricFamily, "kvgate_shadow_checks", "reused requests checked against full prefill"),
        "kl": (GaugeMetricFamily, "kvgate_reuse_fidelity_kl", "mean first-token KL(full || reuse) of the checks"),
        "top1": (GaugeMetricFamily, "kvgate_reuse_fidelity_top1", "share of checks whose first token agreed"),
        "answer": (
            GaugeMetricFamily,
            "kvgate_reuse_fidelity_answer",
            "mean share of the answer's first 32 tokens full prefill's greedy choice repeats before they differ",
        ),
        "window_kl": (
            GaugeMetricFamily,
            "kvgate_reuse_fidelity_window_kl",
            "mean KL, latest checks of the ratio served",
        ),
        "window_top1": (GaugeMetricFamily, "kvgate_reuse_fidelity_window_top1", "top-1 agreement of those checks"),
        "ratio": (GaugeMetricFamily, "kvgate_reuse_gate_ratio", "highest recompute ratio served (1: full prefill)"),
        "ladders": (GaugeMetricFamily, "kvgate_reuse_gate_ladders", "ladders: the mode's, and KVCOMM's per shape"),
        "withheld": (GaugeMetricFamily, "kvgate_reuse_gate_withheld", "ladders serving full prefill: reuse withheld"),
    }
    families = {key: kind(name, doc, labels=["model", "mode"]) for key, (kind, name, doc) in kinds.items()}
    for mode, stats in gate:
        for name, family in families.items():
            family.add_metric([model, mode], stats[name])
    yield from families.values()
    yield counter("kvgate_shadow_due", "shadow checks due (shadow_rate of the gated requests served)", due)
    yield counter("kvgate_shadow_dropped", "shadow checks dropped: too many were waiting", dropped)


def calibration_metrics(model: str, state: str, states: Iterable[str], checks: int) -> Iterator[Metric]:
    """Where blends' recompute ratio comes from (runtime/quality.py `STATES`): 1 for the state the server is
    in, 0 for the others; and the shadow checks of the ratio calibrating online (or opened by them)."""
    family = GaugeMetricFamily(
        "kvgate_blend_calibration",
        "blends' ratio from: table, operator, shadow (opened online); calibrating, unmet, off: full prefill",
        labels=["model", "state"],
    )
    for name in states:
        family.add_metric([model, name], float(name == state))
    yield family
    yield gauge(
        "kvgate_blend_calibration_checks",
        "shadow checks of the ratio being calibrated online, or of the one they opened",
        checks,
        {"model": model},
    )


def semantic_metrics(stats: Callable[[], dict[str, Any]]) -> Iterator[Metric]:
    """The semantic cache's error bound per category: verdicts, the score served from (above 1: only
    the same question), and the operator's rate."""
    verdicts = CounterMetricFamily(
        "kvgate_semantic_verdicts", "answers judged against a cached one", labels=["category", "verdict"]
    )
    threshold = GaugeMetricFamily(
        "kvgate_semantic_threshold", "verifier score served from (above 1: the same question only)", labels=["category"]
    )
    rate = GaugeMetricFamily("kvgate_semantic_max_error_rate", "the wrong hits accepted", labels=["category"])
    for name, category in stats()["categories"].items():
        verdicts.add_metric([name, "right"], category["right"])
        verdicts.add_metric([name, "wrong"], category["wrong"])
        threshold.add_metric([name], category["threshold"])
        rate.add_metric([name], category["max_error_rate"])
    yield from (verdicts, threshold, rate)


def tier_metrics(tiers: list[dict[str, Any]]) -> Iterator[Metric]:
    """The chunk store's tiers: document KV hits, misses, entries and bytes per tier."""
    names = {
        "hits": ("kvgate_document_kv_hits", "document KV found in a tier", CounterMetricFamily),
        "misses": ("kvgate_document_kv_misses", "document KV not found in a tier", CounterMetricFamily),
        "evictions": ("kvgate_document_kv_evictions", "entries evicted from a tier", CounterMetricFamily),
        "entries": ("kvgate_document_kv_entries", "entries held by a tier", GaugeMetricFamily),
        "bytes": ("kvgate_document_kv_bytes", "bytes held by a tier", GaugeMetricFamily),
        "budget_bytes": ("kvgate_document_kv_budget_bytes", "the bytes a tier may hold", GaugeMetricFamily),
        "pinned": ("kvgate_pinned_entries", "entries pinned in a tier", GaugeMetricFamily),
    }
    for stat, (name, doc, kind) in names.items():
        family = kind(name, doc, labels=["tier"])
        for tier in tiers:
            if stat in tier:
                family.add_metric([tier["tier"]], tier[stat])
        yield family


class Observe:
    """The middleware: requests by route and status, latency, and first-event time of streams."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status, streamed, first = 500, False, None
        state = scope.setdefault("state", {})  # where an error's refusal is noted (gateway/errors.py `note`)

        async def sent(message: Message) -> None:
            nonlocal status, streamed, first
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers", []))
                streamed = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and first is None and message.get("body"):
                first = time.perf_counter() - started
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = route_of(scope)
            method = scope["method"] if scope["method"] in METHODS else OTHER
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
            if streamed and first is not None:
                self.metrics.ttft.labels(route).observe(first)
            if (reason := state.get("refused")) is not None:
                self.metrics.refused.labels(reason).inc()


def route_of(scope: Scope) -> str:
    """The route's path template (bounded by the app), or "unmatched"."""
    return getattr(scope.get("route"), "path", "unmatched")
