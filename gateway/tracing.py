"""Tracing as the rest of the gateway sees it (`operations.tracing`): the trace of the request being served, if any
(a context variable the tracing middleware sets, gateway/otel.py), the stages recorded on it as spans, the W3C
headers that carry it to another server, and the spans the engine's record of a request's stages makes.

OpenTelemetry is imported by gateway/otel.py alone, and only when tracing is on (the `otel` extra): off, there is
no middleware and each hook here reads one context variable. The engine knows nothing of tracing: its thread stamps
the end of each stage of a request (runtime/stages.py), and the spans are made here from those times once the
request has settled, so that no span crosses a thread and the engine's step loop does no tracing work."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from kvgate.runtime.reuse_report import ReuseReport
from kvgate.runtime.stages import Stages

if TYPE_CHECKING:
    from kvgate.gateway.otel import Tracing
    from kvgate.gateway.settings import Settings

Value = str | bool | int | float | Sequence[str]
Attributes = Mapping[str, Value]
Span = tuple[str, float, float, dict[str, Value]]  # name, start, end (time.monotonic()), attributes


class TracingUnavailable(RuntimeError):
    """Tracing is asked for and OpenTelemetry's SDK is not installed."""


class Trace(Protocol):
    """One request's trace."""

    def note(self, attributes: Attributes) -> None:
        """Attributes of the request's own span."""

    def stage(self, name: str, start: float, end: float, attributes: Attributes) -> None:
        """A span of one of the request's stages, from `start` to `end` (time.monotonic())."""

    def headers(self) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming the request's span: a call to another server continues it."""


CURRENT: ContextVar[Trace | None] = ContextVar("kvgate_trace", default=None)


def start(settings: Settings) -> Tracing | None:
    """The app's tracing where `operations.tracing` is on; TracingUnavailable without the `otel` extra."""
    return provider()() if settings.operations.tracing else None


def check(settings: Settings) -> None:
    """TracingUnavailable where `operations.tracing` is on without the `otel` extra (at start-up, told at once)."""
    if settings.operations.tracing:
        provider()


def provider() -> type[Tracing]:
    try:
        from kvgate.gateway.otel import Tracing
    except ImportError as exc:
        raise TracingUnavailable(
            f"operations.tracing is on, but OpenTelemetry's SDK cannot be imported ({exc}); "
            "install it with: pip install 'kvgate[otel]'"
        ) from exc
    return Tracing


def note(attributes: Attributes) -> None:
    if (trace := CURRENT.get()) is not None:
        trace.note(attributes)


def stage(name: str, start: float, attributes: Attributes | None = None) -> None:
    """A stage of the request being served, from `start` (time.monotonic()) to now."""
    if (trace := CURRENT.get()) is not None:
        trace.stage(name, start, time.monotonic(), attributes or {})


def headers() -> dict[str, str]:
    """The headers that continue the trace of the request being served in another server ({} untraced)."""
    trace = CURRENT.get()
    return trace.headers() if trace is not None else {}


def settled(report: ReuseReport, usage: Mapping[str, Any], stages: Stages | None) -> None:
    """A generation's end: what reuse did, on the request's span; the engine's stages, as spans of their own."""
    if (trace := CURRENT.get()) is None:
        return
    trace.note(reuse_attributes(report))
    for name, begun, ended, attributes in engine_spans(stages, report, usage) if stages is not None else ():
        trace.stage(name, begun, ended, attributes)


def reuse_attributes(report: ReuseReport) -> dict[str, Value]:
    """What reuse did, as the x-kvgate-* headers say it (gateway/choices.py `reuse_headers`)."""
    found: dict[str, Value] = {
        "kvgate.reuse.reused_tokens": report.reused,
        "kvgate.reuse.recomputed_tokens": report.recomputed,
    }
    if said := str(report):
        found["kvgate.reuse"] = said
    if report.fidelity is not None:
        found["kvgate.reuse.fidelity"] = str(report.fidelity)
    return found


def engine_spans(stages: Stages, report: ReuseReport, usage: Mapping[str, Any]) -> list[Span]:
    """The spans of a request's stages in the engine, each from where the one before it ended: the wait for
    admission, the KV read, the blend (where one ran), the prefill to the first token, the decode."""
    s = stages
    if s.admitted is None:
        return []
    spans: list[Span] = [("kvgate.admission", s.arrived, s.admitted, {})]
    if s.loaded is None:
        return spans
    spans.append(("kvgate.kv_load", s.admitted, s.loaded, kv_attributes(s, report)))
    if s.reused is not None:
        spans.append(("kvgate.blend", s.loaded, s.reused, blend_attributes(report)))
    if s.first_token is None:
        return spans
    prompt = usage.get("prompt_tokens") or 0
    prefill: dict[str, Value] = {
        "kvgate.prefill.computed_tokens": max(prompt - report.reused, 0),
        "kvgate.prefill.reused_tokens": report.reused,
        "gen_ai.usage.input_tokens": prompt,
    }
    spans.append(("kvgate.prefill", s.reused or s.loaded, s.first_token, prefill))
    decode: dict[str, Value] = {"gen_ai.usage.output_tokens": usage.get("completion_tokens") or 0}
    spans.append(("kvgate.decode", s.first_token, s.ended, decode))
    return spans


def kv_attributes(stages: Stages, report: ReuseReport) -> dict[str, Value]:
    """The stored KV a prompt read: the tiers its reads hit, the entries and their bytes, the prompt tokens it
    covers (those kept and those a blend computed again)."""
    return {
        "kvgate.kv.tiers": [tier for tier, _, _ in stages.tiers],
        "kvgate.kv.entries": sum(entries for _, entries, _ in stages.tiers),
        "kvgate.kv.bytes": sum(nbytes for _, _, nbytes in stages.tiers),
        "kvgate.kv.tokens": report.reused + report.recomputed,
    }


def blend_attributes(report: ReuseReport) -> dict[str, Value]:
    """A blend: its mode, the reused tokens it selected to compute again and those it kept, its ratio, fidelity."""
    read = report.reused + report.recomputed
    ratio = report.fidelity.ratio if report.fidelity is not None else None
    found: dict[str, Value] = {
        "kvgate.reuse.mode": report.mode,
        "kvgate.blend.selected_tokens": report.recomputed,
        "kvgate.blend.kept_tokens": report.reused,
        "kvgate.blend.recompute_ratio": ratio if ratio is not None else report.recomputed / read if read else 0.0,
    }
    if report.fidelity is not None:
        found["kvgate.reuse.fidelity"] = str(report.fidelity)
    return found
