"""A small, fast OpenAI-compatible server: the upstream that kvgate's proxy mode forwards to, in tests and benchmarks.

Answers are `--words` words ("w0 w1 ..."). `POST /_script` queues failures (status codes, a slow first byte, a
connection dropped mid-stream, slow chunks) that the next completion requests take one each; `GET /_stats` says what
arrived last; `POST /_reset` forgets both. Run it with `python -m benchmarks.upstream --port P`, or in a subprocess
with `serve_upstream()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import kvgate
from kvgate.gateway.readiness import free_port, wait_ready

_RAW_SEND = "upstream.raw_send"  # scope key: the server's own `send`, through which its transport can be reached
_ERROR_KINDS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}
_ERROR_KINDS |= {429: "rate_limit_exceeded", 500: "server_error", 503: "service_unavailable"}


class _Dropped(Exception):
    """Raised to cut a connection when the server's transport cannot be reached."""


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body).encode(), status, headers, "application/json")


def _error(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    kind = _ERROR_KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return _json({"error": {"message": message, "type": kind, "param": None, "code": code}}, status, headers)


async def _drop(scope: Scope, receive: Receive) -> None:
    """Close the connection under the response, flushing what was written, then wait until the server sees it."""
    transport = getattr(getattr(scope.get(_RAW_SEND), "__self__", None), "transport", None)
    if transport is None:  # not uvicorn's protocol: an exception makes the server abort the response instead
        raise _Dropped("scripted drop")
    transport.close()
    with contextlib.suppress(TimeoutError):  # uvicorn answers 'http.disconnect' once the connection is lost
        async with asyncio.timeout(5):
            while (await receive())["type"] != "http.disconnect":
                pass


class _Drop(Response):
    """No answer at all: the connection closes without a status line."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _drop(scope, receive)


class _Stream(Response):
    """Server-sent events, optionally paced (`chunk_delay_s`) or cut after `drop_after` events (no [DONE])."""

    def __init__(self, events: list[bytes], chunk_delay_s: float = 0.0, drop_after: int | None = None) -> None:
        super().__init__(status_code=200, headers={"cache-control": "no-cache"}, media_type="text/event-stream")
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked, not empty
        self.events, self.chunk_delay_s, self.drop_after = events, chunk_delay_s, drop_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, event in enumerate(self.events[: self.drop_after]):
            if i and self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        if self.drop_after is not None:
            await _drop(scope, receive)
            return
        if self.chunk_delay_s:
            await asyncio.sleep(self.chunk_delay_s)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Upstream:
    """The server's state: its models, answer length, key, failure script and what the last request carried."""

    def __init__(self, models: Sequence[str], words: int = 8, api_key: str | None = None) -> None:
        self.models, self.words, self.api_key = tuple(models), words, api_key
        self.created = int(time.time())
        self.script: deque[dict[str, Any]] = deque()
        self.requests = 0
        self.last_headers: dict[str, str] = {}
        self.last_body: Any = None
        self.last_raw = ""  # the last body's bytes as they came (a proxy that re-serialised them shows)

    def app(self) -> ASGIApp:
        routes = [
            Route("/health", self.health),
            Route("/v1/models", self.list_models),
            Route("/v1/models/{model:path}", self.get_model),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/_script", self.add_script, methods=["POST"]),
            Route("/_stats", self.stats),
            Route("/_reset", self.reset, methods=["POST"]),
        ]
        inner = Starlette(routes=routes)

        async def keep_raw_send(scope: Scope, receive: Receive, send: Send) -> None:
            scope[_RAW_SEND] = send
            await inner(scope, receive, send)

        return keep_raw_send

    def _unauthorized(self, request: Request) -> Response | None:
        if self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return _error(401, "Incorrect API key provided.", "invalid_api_key")

    def _card(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": self.created, "owned_by": "kvgate-upstream"}

    async def health(self, request: Request) -> Response:
        return _json({"status": "ok"})

    async def list_models(self, request: Request) -> Response:
        denied = self._unauthorized(request)
        return denied or _json({"object": "list", "data": [self._card(m) for m in self.models]})

    async def get_model(self, request: Request) -> Response:
        model = request.path_params["model"]
        if denied := self._unauthorized(request):
            return denied
        if model not in self.models:
            return _error(404, f"The model `{model}` does not exist.", "model_not_found")
        return _json(self._card(model))

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        self.requests += 1
        self.last_headers, self.last_body = dict(request.headers), None
        if denied := self._unauthorized(request):
            return denied
        raw = await request.body()
        self.last_raw = raw.decode(errors="replace")
        try:
            body = self.last_body = json.loads(raw)
        except ValueError as exc:
            return _error(400, f"Invalid JSON body: {exc}")
        if not isinstance(body, dict):
            return _error(400, "The body must be a JSON object.")
        prompt = body.get("messages") if chat else body.get("prompt")
        if prompt is None or (chat and not isinstance(prompt, list)):
            return _error(400, "'messages' must be a list." if chat else "'prompt' is required.")
        if not isinstance(body.get("stream", False), bool | None):
            return _error(400, "'stream' must be a boolean.")
        if not isinstance(body.get("stream_options", {}), dict | None):
            return _error(400, "'stream_options' must be an object.")
        model = body.get("model")
        if model not in self.models:
            return _error(404, f"The model `{model}` does not exist.", "model_not_found")
        action = self.script.popleft() if self.script else {}
        if action.get("delay_s"):
            await asyncio.sleep(float(action["delay_s"]))
        if "status" in action:
            retry = action.get("retry_after")
            headers = None if retry is None else {"retry-after": str(retry)}
            return _error(int(action["status"]), f"Scripted failure {action['status']}.", None, headers)
        drop_after = None if action.get("drop_after") is None else int(action["drop_after"])
        words = [f"w{i} " for i in range(self.words)]
        n_prompt = max(1, len(json.dumps(prompt)) // 4)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": self.words, "total_tokens": n_prompt + self.words}
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time())}
        head["model"] = model
        if not body.get("stream"):
            if drop_after is not None:
                return _Drop()
            text = "".join(words)
            if chat:
                message = {"role": "assistant", "content": text}
                choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
            obj = "chat.completion" if chat else "text_completion"
            return _json({**head, "object": obj, "choices": [choice], "usage": usage})
        kind = "chat.completion.chunk" if chat else "text_completion"
        events = []
        for i, word in enumerate(words or [""]):
            finish = "stop" if i == max(0, self.words - 1) else None
            if chat:
                delta = {"role": "assistant", "content": word} if i == 0 else {"content": word}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": word, "logprobs": None, "finish_reason": finish}
            events.append(_sse({**head, "object": kind, "choices": [choice]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(_sse({**head, "object": kind, "choices": [], "usage": usage}))
        return _Stream(events, float(action.get("chunk_delay_s") or 0.0), drop_after)

    async def add_script(self, request: Request) -> Response:
        try:
            actions = json.loads(await request.body())["actions"]
        except (ValueError, KeyError, TypeError):
            return _error(400, 'The body must be {"actions": [...]}.')
        if not isinstance(actions, list) or not all(isinstance(a, dict) for a in actions):
            return _error(400, "'actions' must be a list of objects.")
        self.script.extend(actions)
        return _json({"queued": len(self.script)})

    async def stats(self, request: Request) -> Response:
        seen = {"last_headers": self.last_headers, "last_body": self.last_body, "last_raw": self.last_raw}
        return _json({"requests": self.requests, **seen})

    async def reset(self, request: Request) -> Response:
        self.script.clear()
        self.requests, self.last_headers, self.last_body, self.last_raw = 0, {}, None, ""
        return _json({"status": "ok"})


@contextmanager
def serve_upstream(models: Sequence[str] = ("stub-a",), words: int = 8, api_key: str | None = None) -> Iterator[str]:
    """The upstream in a subprocess on a free loopback port; yields its base URL (no /v1)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvgate.bench.upstream", "--port", str(port), "--models", ",".join(models)]
    cmd += ["--words", str(words)] + (["--api-key", api_key] if api_key is not None else [])
    root = str(Path(kvgate.__file__).resolve().parent.parent)  # where `kvgate` imports from, whatever the layout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/health", proc, 30, name=f"the upstream on port {port}", every_s=0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--models", default="stub-a", help="comma-separated model names")
    parser.add_argument("--words", type=int, default=8, help="words in every answer")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    app = Upstream(models, max(0, args.words), args.api_key).app()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
