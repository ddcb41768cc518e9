"""A real uvicorn server on a free loopback port, for tests that need more than the shared one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from kvgate.gateway.app import create_app
from kvgate.gateway.backend import Backend, make_backend
from kvgate.gateway.readiness import free_port
from kvgate.gateway.serve import http_protocol
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstreams import Upstream
from kvgate.runtime.engine import Engine
from tests.helpers.waiting import wait_until


@contextmanager
def serving(
    settings: Settings, engine: Engine | None, workers: tuple[Upstream, ...] = (), backend: Backend | None = None
) -> Iterator[str]:
    """The gateway over `engine` (None: over upstreams, or `proxy.workers`; or over `backend` when given) on
    loopback; yields its base URL."""
    port = free_port()
    app = create_app(settings, backend or make_backend(settings, engine, workers))
    # proxy_headers off and the corked transport, as `kvgate serve` runs it: X-Forwarded-For is the app's
    # to believe or not; each answer's headers and body leave in one write
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", proxy_headers=False, http=http_protocol()
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "uvicorn did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
