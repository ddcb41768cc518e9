"""`kvgate serve`: the gateway over the in-process runtime, runtime workers or upstreams."""

from __future__ import annotations

from kvgate.gateway.settings import Settings


def serve_forever(settings: Settings) -> int:
    """In-process runtime; or a front over upstreams (proxy mode) or over runtime workers."""
    import uvicorn
    from kvgate.gateway.app import create_app
    from kvgate.gateway.workers import running
    from kvgate.runtime.engine import Engine
    from kvgate.runtime.loader import resolve

    def serve(app: object) -> None:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)  # type: ignore[arg-type]

    if settings.upstreams and not settings.workers:
        serve(create_app(settings, None))
        return 0
    resolve(settings.engine_config(), progress=True)  # convert once, with a progress bar, before loading
    if settings.workers:
        with running(settings, settings.workers) as workers:
            serve(create_app(settings, None, workers))
        return 0
    engine = Engine(settings.engine_config())
    try:
        serve(create_app(settings, engine))
    finally:
        engine.shutdown()
    return 0
