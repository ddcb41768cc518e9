"""A real OTLP/HTTP trace receiver on loopback, as a collector's: `POST /v1/traces` with an
`ExportTraceServiceRequest` (protobuf, opentelemetry-proto's own messages), answered as OTLP says; every span kept."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.helpers.waiting import wait_until


@dataclass(frozen=True)
class Received:
    """One span as it arrived: ids in hex (`parent` "" for a root), times in ns since the epoch."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def value(any_value: AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind is not None else None


def spans_of(request: ExportTraceServiceRequest) -> Iterator[Received]:
    for resource_spans in request.resource_spans:
        service = {a.key: value(a.value) for a in resource_spans.resource.attributes}.get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                attributes = {a.key: value(a.value) for a in s.attributes}
                ids = (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                yield Received(service, s.name, *ids, s.kind, s.start_time_unix_nano, s.end_time_unix_nano, attributes)


class Receiver:
    """The receiver's spans so far, and a wait for those of one trace."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.spans: list[Received] = []
        self.lock = threading.Lock()

    def took(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            self.spans.extend(spans_of(request))

    def trace(self, trace_id: str, names: list[str], within_s: float = 10) -> list[Received]:
        """The spans of `trace_id`, once those named have all arrived (a name twice: two spans of that name)."""

        def missing() -> list[str]:
            with self.lock:
                got = [s.name for s in self.spans if s.trace_id == trace_id]
            return [n for n in set(names) if got.count(n) < names.count(n)]

        wait_until(lambda: not missing(), within_s, f"spans {missing()} did not arrive")
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


class Server(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.receiver = Receiver(f"http://127.0.0.1:{self.server_address[1]}/v1/traces")


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A receiver on a free loopback port; yields it (its `url` is the traces endpoint)."""
    server = Server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802  (http.server's name)
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        assert isinstance(self.server, Server)
        self.server.receiver.took(ExportTraceServiceRequest.FromString(body))
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: pytest keeps the output of a failure
