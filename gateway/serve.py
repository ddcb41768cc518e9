"""`kvgate serve`: the gateway over the in-process runtime, runtime workers or upstreams. A front over
upstreams imports no torch: it loads nothing but the gateway."""

from __future__ import annotations

from kvgate.gateway.settings import Settings


def serve_forever(settings: Settings) -> int:
    import uvicorn

    from kvgate.gateway.app import create_app
    from kvgate.gateway.backend import make_backend

    def serve(app: object) -> None:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)  # type: ignore[arg-type]

    if settings.upstreams and not settings.workers:
        serve(create_app(settings, make_backend(settings)))
        return 0
    from kvgate.runtime.loader import resolve

    resolve(settings.engine_config(), progress=True)  # convert once, with a progress bar, before loading
    if settings.workers:
        from kvgate.gateway.workers import running

        with running(settings, settings.workers) as workers:
            serve(create_app(settings, make_backend(settings, workers=workers)))
        return 0
    from kvgate.runtime.engine import Engine

    engine = Engine(settings.engine_config())
    try:
        serve(create_app(settings, make_backend(settings, engine)))
    finally:
        engine.shutdown()
    return 0
