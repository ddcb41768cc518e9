"""Tracing's switch and the spans the engine's stages make (the spans as an OTLP receiver gets them:
tests/server/test_tracing.py): off, the app has no tracing at all; on without the `otel` extra, start-up says
what to install; a request's stages become consecutive spans, a blend's only where one ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvgate.gateway import serve, tracing
from kvgate.gateway.app import create_app
from kvgate.gateway.backend import make_backend
from kvgate.gateway.cli import user_errors
from kvgate.gateway.settings import Settings
from kvgate.gateway.workers import worker_settings
from kvgate.runtime.reuse_report import ReuseReport
from kvgate.runtime.stages import Stages


def front(tmp_path: Path, traced: bool) -> Settings:
    """A proxy front (no model to load): the app is made, nothing is served."""
    upstreams = [{"name": "up", "base_url": "http://127.0.0.1:9/v1", "models": ["m"]}]
    return Settings(
        proxy={"upstreams": upstreams},
        operations={"tracing": traced},
        semantic_cache={"enabled": False},
        cache_dir=tmp_path,
    )


def middlewares(settings: Settings) -> list[str]:
    return [m.cls.__name__ for m in create_app(settings, make_backend(settings)).user_middleware]  # type: ignore[attr-defined]


def test_tracing_is_off_by_default_and_then_the_app_has_no_tracing_middleware(tmp_path: Path) -> None:
    assert Settings().operations.tracing is False
    assert "Traced" not in middlewares(front(tmp_path, traced=False))
    assert "Traced" in middlewares(front(tmp_path, traced=True))


def test_tracing_asked_for_without_opentelemetrys_sdk_stops_start_up_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK is installed here: a None in sys.modules is how a package that is not installed imports (a fake).
    monkeypatch.delitem(sys.modules, "kvgate.gateway.otel", raising=False)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    settings = front(tmp_path, traced=True)
    with pytest.raises(tracing.TracingUnavailable, match=r"pip install 'kvgate\[otel\]'"):
        serve.run(settings)  # before anything is loaded or served
    with pytest.raises(tracing.TracingUnavailable):
        create_app(settings, make_backend(settings))
    assert tracing.TracingUnavailable in user_errors()  # `kvgate serve` says it in a line, exit 2
    assert "Traced" not in middlewares(front(tmp_path, traced=False))  # off, kvgate needs none of it


REPORT = ReuseReport("blend", (), reused=60, recomputed=15)
USAGE = {"prompt_tokens": 100, "completion_tokens": 4}


def test_a_requests_stages_are_consecutive_spans_each_from_where_the_one_before_ended() -> None:
    stages = Stages(1.0, 1.5, 1.6, 2.0, 2.5, 3.0, (("memory", 2, 1000), ("disk", 1, 500)))
    spans = tracing.engine_spans(stages, REPORT, USAGE)
    assert [(name, start, end) for name, start, end, _ in spans] == [
        ("kvgate.admission", 1.0, 1.5),
        ("kvgate.kv_load", 1.5, 1.6),
        ("kvgate.blend", 1.6, 2.0),
        ("kvgate.prefill", 2.0, 2.5),
        ("kvgate.decode", 2.5, 3.0),
    ]
    load = {
        "kvgate.kv.tiers": ["memory", "disk"],
        "kvgate.kv.entries": 3,
        "kvgate.kv.bytes": 1500,
        "kvgate.kv.tokens": 75,
    }
    assert spans[1][3] == load
    assert spans[3][3]["kvgate.prefill.computed_tokens"] == 40 and spans[4][3]["gen_ai.usage.output_tokens"] == 4


def test_without_a_blend_the_prefill_follows_the_kv_read_and_an_unadmitted_request_has_no_spans() -> None:
    plain = tracing.engine_spans(Stages(1.0, 1.5, 1.6, None, 2.5, 3.0), ReuseReport(), USAGE)
    assert [name for name, *_ in plain] == ["kvgate.admission", "kvgate.kv_load", "kvgate.prefill", "kvgate.decode"]
    assert plain[2][1:3] == (1.6, 2.5)
    assert tracing.engine_spans(Stages(1.0, None, None, None, None, 1.2), REPORT, USAGE) == []


def test_runtime_workers_trace_as_their_front_does(tmp_path: Path) -> None:
    # each traces its own part, a child of the front's span (its OTEL_* variables are the front's: launch)
    assert worker_settings(front(tmp_path, traced=True), 0, 8001, "s" * 32)["operations"]["tracing"] is True  # type: ignore[index]
