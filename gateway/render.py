"""OpenAI's response shapes: usage, logprobs, the fields every chunk shares, SSE framing."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.runtime.sampling import TokenLogprob
    from kvgate.runtime.tokens import TokenBytes

FINGERPRINT = "kvgate-0.1"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # no proxy may buffer or keep a stream
DONE = "[DONE]"  # a stream's last data
Data = dict[str, Any] | str  # a stream event's data: an object, or DONE
EVENT_END = re.compile(rb"\r?\n\r?\n")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_head(kind: str, request_id: str, model: str) -> dict[str, Any]:
    """The fields every response and chunk of one request share; kind is chatcmpl or cmpl."""
    return {
        "id": f"{kind}-{request_id}",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": FINGERPRINT,
    }


def finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf


def chat_logprobs(tb: TokenBytes, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tb.text(token_id), "logprob": finite(logprob), "bytes": list(tb(token_id))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]} for lp in logprobs
        ]
    }


def completion_logprobs(tb: TokenBytes, logprobs: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Logprobs of text completions; text_offset counts on from `offset`, each token's own text."""
    tokens, offsets, tops = [], [], []
    for lp in logprobs:
        tokens.append(tb.text(lp.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
        # As vLLM: the sampled token is among its top logprobs even when it is not in the top k.
        tops.append({**{tb.text(t): finite(p) for t, p in lp.top}, tokens[-1]: finite(lp.logprob)})
    return {
        "tokens": tokens,
        "token_logprobs": [finite(lp.logprob) for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def encoded(chunks: AsyncIterator[Data]) -> AsyncIterator[bytes]:
    """Objects as their SSE events."""
    async for chunk in chunks:
        yield sse(chunk).encode()


async def sse_data(events: AsyncIterator[bytes]) -> AsyncIterator[Data]:
    """The data of each SSE event, parsed (DONE for [DONE]), however the bytes were cut."""
    buffer = b""
    async for chunk in events:
        buffer += chunk
        *complete, buffer = EVENT_END.split(buffer)
        for event in complete:
            if (data := data_of(event)) is not None:
                yield data
    if (data := data_of(buffer)) is not None:
        yield data


def data_of(event: bytes) -> Data | None:
    lines = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    text = b"\n".join(lines)
    if text.strip() == DONE.encode():
        return DONE
    try:
        data = json.loads(text)
    except ValueError:
        return {"error": {"message": "the chat stream sent an event that is not JSON"}}
    return data if isinstance(data, dict) else None
