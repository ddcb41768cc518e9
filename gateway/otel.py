"""kvgate's traces in OpenTelemetry (the `otel` extra; the rest of the gateway sees gateway/tracing.py only).

A tracer provider of the app's own (never the process's global one: several apps may share a process), configured
as OpenTelemetry's SDK is anywhere, by the standard variables: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or
OTEL_EXPORTER_OTLP_ENDPOINT), OTEL_EXPORTER_OTLP_HEADERS, OTEL_SERVICE_NAME (else `kvgate`),
OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, OTEL_BSP_* (the batches),
OTEL_PROPAGATORS, OTEL_SDK_DISABLED. Spans leave in batches over OTLP/HTTP (protobuf), off the request's path.

The middleware makes each request's server span, a child of the caller's `traceparent` when it sent one."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.gateway import tracing
from kvgate.gateway.tracing import Attributes

UNTRACED = frozenset({"/health", "/ready", "/metrics"})  # probes, polled all day: no trace is worth theirs


class Tracing:
    """The app's tracer provider: made with the app, shut down with it (its last spans exported first)."""

    def __init__(self) -> None:
        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "kvgate"}))
        self.provider = TracerProvider(resource=resource)  # its sampler as OTEL_TRACES_SAMPLER says
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("kvgate")

    def install(self, app: Any) -> None:
        """The middleware, on `app` (a FastAPI app)."""
        app.add_middleware(Traced, tracer=self.tracer)

    def shutdown(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """One request's trace: its server span, and the spans of its stages made under it with their own times."""

    __slots__ = ("tracer", "span", "context")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self.tracer, self.span, self.context = tracer, span, set_span_in_context(span)

    def note(self, attributes: Attributes) -> None:
        self.span.set_attributes(attributes)

    def stage(self, name: str, start: float, end: float, attributes: Attributes) -> None:
        if not self.span.get_span_context().trace_flags.sampled:
            return
        now_ns, now = time.time_ns(), time.monotonic()
        began = now_ns - int((now - start) * 1e9)
        child = self.tracer.start_span(name, self.context, attributes=attributes, start_time=began)
        child.end(end_time=now_ns - int((now - end) * 1e9))

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, self.context)
        return carrier


class Traced:
    """Each request's server span: method and route, status, the caller's key (its id) or tenant (hashed), and
    what the routes note (the model, what reuse did); the current trace while the request is served."""

    def __init__(self, app: ASGIApp, tracer: Tracer) -> None:
        self.app, self.tracer = app, tracer
        self.fields = {name.encode() for name in propagate.get_global_textmap().fields}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED:
            return await self.app(scope, receive, send)
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in self.fields}
        method = scope["method"]
        attributes = {"http.request.method": method, "url.path": scope["path"]}
        span = self.tracer.start_span(method, propagate.extract(carrier), SpanKind.SERVER, attributes)
        token = tracing.CURRENT.set(RequestTrace(self.tracer, span))
        status = 500

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        except Exception as exc:
            span.record_exception(exc)
            raise
        finally:
            tracing.CURRENT.reset(token)
            ended(span, scope, status)


def ended(span: Span, scope: Scope, status: int) -> None:
    """The server span's last attributes, as the request left them; then it ends."""
    route = getattr(scope.get("route"), "path", None)
    if route is not None:
        span.update_name(f"{scope['method']} {route}")
        span.set_attribute("http.route", route)
    state = scope.get("state", {})
    if (key := state.get("key")) is not None:
        span.set_attribute("kvgate.api_key", key.id)  # an id, never the key
    if isinstance(tenant := state.get("tenant"), str):
        span.set_attribute("kvgate.tenant", hashlib.sha256(tenant.encode()).hexdigest()[:16])
    if isinstance(request_id := state.get("request_id"), str):
        span.set_attribute("kvgate.request_id", request_id)
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()
