"""`kvgate serve`: the gateway over the in-process runtime, runtime workers or upstreams. A front over
upstreams imports no torch: it loads nothing but the gateway.

SIGTERM (or SIGINT): the server stops accepting, requests in flight may finish for `operations.shutdown_grace_s`,
then the engine or the runtime workers are stopped, and the process exits 0. Before it serves, the
same signals stop whatever was started so far."""

from __future__ import annotations

import signal
from types import FrameType

from kvgate.gateway import tracing
from kvgate.gateway.settings import Settings
from kvgate.runtime.config import model_path


class Stopped(BaseException):
    """A SIGTERM or SIGINT that uvicorn is not handling (before it serves, or the one it raises again
    once it has drained): it unwinds through every `finally` (not an Exception: nothing catches it)."""


def stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


def serve_forever(settings: Settings) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopped)
    if settings.operations.exit_with_pid is not None:
        from kvgate.gateway.workers import exit_with

        exit_with(settings.operations.exit_with_pid)
    try:
        run(settings)
    except Stopped:
        pass
    return 0


def http_protocol() -> str | type:
    """uvicorn's httptools protocol over a corked transport (gateway/transport.py); without httptools,
    uvicorn's choice."""
    try:
        from kvgate.gateway.transport import CorkedHttpTools
    except ImportError:
        return "auto"
    return CorkedHttpTools


def run(settings: Settings) -> None:
    proxy_only = bool(settings.proxy.upstreams) and not settings.proxy.workers
    if not proxy_only:
        model_path(settings.engine.model)  # a wrong path is told at once, not after seconds of imports
    tracing.check(settings)  # and tracing asked for without its packages
    import uvicorn

    from kvgate.gateway.app import create_app
    from kvgate.gateway.backend import make_backend

    def serve(app: object) -> None:
        uvicorn.run(
            app,  # type: ignore[arg-type]
            http=http_protocol(),
            host=settings.operations.host,
            port=settings.operations.port,
            log_level=settings.operations.log_level,
            proxy_headers=False,  # X-Forwarded-For is believed from `security.trusted_proxies` only (gateway/keys.py)
            timeout_graceful_shutdown=settings.operations.shutdown_grace_s,  # type: ignore[arg-type]  # a float waits as well
        )

    if proxy_only:
        serve(create_app(settings, make_backend(settings)))
        return
    from kvgate.runtime.loader import resolve

    resolve(settings.engine_config(), progress=True)  # convert once, with a progress bar, before loading
    if settings.proxy.workers:
        from kvgate.gateway.workers import running

        with running(settings, settings.proxy.workers) as workers:
            serve(create_app(settings, make_backend(settings, workers=workers)))
        return
    from kvgate.runtime.engine import Engine

    engine = Engine(settings.engine_config())
    try:
        serve(create_app(settings, make_backend(settings, engine)))
    finally:
        engine.shutdown()
