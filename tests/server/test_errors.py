"""Bad input gets OpenAI's error body and the right status; the server keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from kvgate.gateway.app import create_app
from kvgate.gateway.backend import make_backend
from kvgate.gateway.errors import internal
from kvgate.runtime.errors import DocumentNotFound, EngineError, PromptTooLong, ServerError, TemplateError
from tests.helpers import loopback
from tests.helpers.servers import free_port


def post(base_url: str, path: str, **kw) -> httpx.Response:
    return loopback.post(f"{base_url}{path}", timeout=60, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json") and r.headers["x-request-id"]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def chat(model: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def test_malformed_json(base_url) -> None:
    r = post(
        base_url,
        "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert error_of(r, 400)["type"] == "invalid_request_error"


def test_body_not_an_object(base_url) -> None:
    error_of(post(base_url, "/v1/chat/completions", json=[1, 2]), 400)


@pytest.mark.parametrize("missing", ["model", "messages"])
def test_missing_fields(base_url, model_name, missing) -> None:
    body = chat(model_name)
    del body[missing]
    assert error_of(post(base_url, "/v1/chat/completions", json=body), 400)["param"] == missing


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", "many"),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("top_logprobs", 21),
        ("logit_bias", {"99999999": 1}),
        ("logit_bias", {"5": 500}),
        ("stop", [""]),
        ("stream_options", {"include_usage": True}),
        ("messages", []),
        ("stop_token_ids", [-1]),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("logit_bias", {"²": 1}),
        ("logit_bias", {"": 500}),
        ("stream", "maybe"),
        ("stream_options", 5),
    ],
)
def test_invalid_values(base_url, model_name, field, value) -> None:
    error = error_of(post(base_url, "/v1/chat/completions", json=chat(model_name, **{field: value})), 400)
    assert field in (error["param"] or "") or field in error["message"]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "wizard", "content": "Hi"},
        {"role": "user"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
    ],
)
def test_invalid_messages(base_url, model_name, message) -> None:
    error = error_of(post(base_url, "/v1/chat/completions", json=chat(model_name, messages=[message])), 400)
    assert error["param"].startswith("messages")


def test_empty_body_says_so(base_url) -> None:
    r = post(base_url, "/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    error = error_of(r, 400)
    assert error["message"] == "the request body is missing; send a JSON object" and error["param"] is None


def test_seed_range_and_tiny_temperature(base_url, model_name) -> None:
    for seed in (2**63 - 1, -(2**63)):  # the per-choice offset wraps within int64
        r = post(base_url, "/v1/chat/completions", json=chat(model_name, seed=seed, n=3))
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    tiny = post(base_url, "/v1/chat/completions", json=chat(model_name, temperature=1e-40, max_tokens=8))
    greedy = post(base_url, "/v1/chat/completions", json=chat(model_name, temperature=0, max_tokens=8))
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_tool_call_arguments_are_json_text_or_an_object(base_url, model_name) -> None:
    """Text that is not JSON (an answer cut short, sent back by a framework) is rendered as the text it
    is, as OpenAI takes it; anything but text or an object is a 400."""

    def call(arguments: object) -> dict:
        tool_call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
        return chat(model_name, messages=messages)

    assert post(base_url, "/v1/chat/completions", json=call('{"city": "Paris"}')).status_code == 200
    assert post(base_url, "/v1/chat/completions", json=call('{"city": "Par')).status_code == 200
    error = error_of(post(base_url, "/v1/chat/completions", json=call(["Paris"])), 400)
    assert error["param"] == "messages.1.tool_calls.0.function.arguments"


def test_completion_specific_checks(base_url, model_name) -> None:
    base = {"model": model_name, "prompt": "Hi", "max_tokens": 2}
    for extra in (
        {"logprobs": 21},
        {"suffix": "x"},
        {"prompt": []},
        {"prompt": [10**9]},
        {"best_of": 3},
        {"echo": True, "logprobs": 1},
    ):
        error_of(post(base_url, "/v1/completions", json={**base, **extra}), 400)


def test_prompt_longer_than_the_context_window(base_url, model_name, engine) -> None:
    long = "word " * (engine.max_model_len + 10)
    error = error_of(
        post(base_url, "/v1/chat/completions", json=chat(model_name, messages=[{"role": "user", "content": long}])), 400
    )
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    error = error_of(
        post(
            base_url, "/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": engine.max_model_len}
        ),
        400,
    )
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


@pytest.mark.parametrize(
    ("error", "status", "code", "param"),
    [
        (PromptTooLong("too long").at("prompt"), 400, "context_length_exceeded", "prompt"),
        (TemplateError("no template"), 400, "invalid_messages", "messages"),
        (DocumentNotFound("doc-x", 2), 404, "document_not_found", "documents.2.id"),
        (DocumentNotFound("doc-x"), 404, "document_not_found", "id"),
        (EngineError("generation failed: boom"), 500, "internal_error", None),
        (KeyError("a bug"), 500, "internal_error", None),
    ],
)
def test_every_layers_errors_say_how_a_client_sees_them(error, status, code, param) -> None:
    """One base (runtime/errors.py): the engine, planner and template raise it, the gateway renders it as it says."""
    shown = internal(error)
    assert (shown.status, shown.code, shown.param) == (status, code, param)
    assert isinstance(error, ServerError) or "KeyError" in shown.message


def test_unknown_model_is_404(base_url, client) -> None:
    error = error_of(post(base_url, "/v1/chat/completions", json=chat("gpt-17")), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_oversized_body_is_413(base_url, model_name, settings) -> None:
    huge = chat(model_name, messages=[{"role": "user", "content": "x" * (settings.security.max_body_bytes + 1)}])
    assert error_of(post(base_url, "/v1/chat/completions", json=huge), 413)["code"] == "request_too_large"

    def chunks():  # no content-length: the limit must hold for a streamed body too
        for _ in range(settings.security.max_body_bytes // 65536 + 2):
            yield b"x" * 65536

    r = post(base_url, "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    error_of(r, 413)


def test_unknown_route_and_method(base_url) -> None:
    error_of(loopback.get(f"{base_url}/v1/nothing"), 404)
    error_of(loopback.get(f"{base_url}/v1/chat/completions"), 405)


def test_sdk_raises_typed_errors_and_server_keeps_serving(client, model_name) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], temperature=9)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    ok = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert ok.choices[0].message.content is not None


@pytest.fixture(scope="module")
def failing_url(settings, engine) -> Iterator[str]:
    """A second real server whose app also has routes failing as a bug and as the engine would."""
    app = create_app(settings, make_backend(settings, engine))

    @app.get("/bug")
    async def bug() -> None:
        raise KeyError("no such thing")

    @app.get("/engine-failure")
    async def engine_failure() -> None:
        raise EngineError("generation failed: RuntimeError: probability tensor contains `inf`, `nan` or element < 0")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_unhandled_errors_are_openai_500s_with_the_request_id(failing_url) -> None:
    r = loopback.get(f"{failing_url}/bug", headers={"x-request-id": "trace-500"})
    error = error_of(r, 500)
    assert r.headers["x-request-id"] == "trace-500"
    assert error["type"] == "server_error" and error["code"] == "internal_error" and "KeyError" in error["message"]
    error = error_of(loopback.get(f"{failing_url}/engine-failure"), 500)
    assert "probability tensor contains" in error["message"] and error["code"] == "internal_error"  # as the engine said
    assert loopback.get(f"{failing_url}/health").status_code == 200
