"""The public surface: what `kvgate` exports is this list, no more; each name is what it says; and
importing kvgate (a client, a proxy front) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import kvgate

PUBLIC = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncChatStream",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "ChatCompletion",
    "ChatStream",
    "Client",
    "ConflictError",
    "Document",
    "InternalServerError",
    "KVGateError",
    "LLM",
    "LLMStream",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "Reuse",
    "Settings",
    "UnprocessableEntityError",
    "__version__",
]


def test_all_is_pinned() -> None:
    assert sorted(kvgate.__all__) == sorted(PUBLIC)


def test_every_public_name_resolves() -> None:
    for name in PUBLIC:
        assert getattr(kvgate, name) is not None, name
    assert issubclass(kvgate.NotFoundError, kvgate.APIStatusError)
    assert issubclass(kvgate.APIStatusError, kvgate.KVGateError)
    assert issubclass(kvgate.APITimeoutError, kvgate.APIConnectionError)
    assert kvgate.Settings().operations.port == 8000


def test_importing_kvgate_loads_no_torch() -> None:
    code = "import sys, kvgate; print(sorted(m for m in ('torch', 'transformers', 'hnswlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_proxy_front_loads_no_torch() -> None:
    """The gateway over upstreams, with no model and no semantic cache of its own, is a light process."""
    code = """
import sys
from kvgate.gateway.app import create_app
from kvgate.gateway.backend import make_backend
from kvgate.gateway.settings import Settings
settings = Settings(proxy={"upstreams": [{"base_url": "http://127.0.0.1:9"}]}, semantic_cache={"enabled": False})
create_app(settings, make_backend(settings))
print(sorted(m for m in ("torch", "transformers", "hnswlib") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
