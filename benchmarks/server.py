"""The gateway on a free loopback port, with its own engine or in front of upstreams, for benchmarks that
go through HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from kvgate.gateway.app import create_app
from kvgate.gateway.backend import make_backend
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel


@contextmanager
def gateway(settings: Settings, loaded: LoadedModel | None = None) -> Iterator[tuple[str, str]]:
    """The gateway on a free loopback port; yields its base URL and the served model's name."""
    with gateway_engine(settings, loaded) as (url, name, _):
        yield url, name


@contextmanager
def gateway_engine(settings: Settings, loaded: LoadedModel | None = None) -> Iterator[tuple[str, str, Engine]]:
    """`gateway`, and its engine (to see what the engine does between requests)."""
    engine = Engine(settings.engine_config(), loaded)
    try:
        with serving(create_app(settings, make_backend(settings, engine))) as url:
            yield f"{url}/v1", settings.engine.served_model_name or engine.loaded.name, engine
    finally:
        engine.shutdown()


@contextmanager
def front(settings: Settings) -> Iterator[str]:
    """A front over `settings.proxy.upstreams` (no model of its own); yields its base URL (without /v1)."""
    with serving(create_app(settings, make_backend(settings, None))) as url:
        yield url


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
