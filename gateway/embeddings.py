"""/v1/embeddings in runtime mode: the semantic cache's embedding model (semantic_cache/embedder.py),
answered as OpenAI and vLLM answer it.

- One name: the embedder's (`all-MiniLM-L6-v2` by default). The Hugging Face id
  `sentence-transformers/all-MiniLM-L6-v2` is not an alias, so that /v1/models, GET /v1/models/{id},
  key scopes and the reply's `model` agree on one name (vLLM, too, answers only its served names).
- Loaded on the first request that needs it, not at start-up.
- `input`: a string or up to 2048 strings, none empty. Token-id arrays are refused: they are ids of
  another tokenizer (LangChain's OpenAIEmbeddings sends tiktoken ids unless check_embedding_ctx_length
  is false), and embedding them as MiniLM ids would answer wrongly without an error.
- An input longer than the embedder reads (MiniLM: 256 tokens, its special tokens included) is a 400,
  never truncated. Tokens are counted by the embedder's tokenizer, special tokens included (as vLLM);
  an embedder without a `tokenizer` counts words and has no limit.
- Requests that arrive while a forward runs are embedded together in the next one (`Batcher`)."""

from __future__ import annotations

import asyncio
import base64
import importlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError, field_validator

from kvgate.gateway.backend import Call, Outcome, Reply
from kvgate.gateway.errors import APIError, bad_request, from_validation
from kvgate.gateway.protocol import Body
from kvgate.gateway.render import dumps
from kvgate.gateway.settings import Settings
from kvgate.semantic_cache.embedder import Embedder, MiniLM, make_embedder

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
JSON = {"content-type": "application/json"}


class EmbeddingRequest(Body):
    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list):
            raise ValueError("must be a string or a list of strings")
        if not texts:
            raise ValueError("must not be an empty list")
        if len(texts) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request, got {len(texts)}")
        for i, text in enumerate(texts):
            if type(text) is int or (isinstance(text, list) and all(type(t) is int for t in text)):
                raise ValueError(
                    "token ids are not accepted: they would be another tokenizer's ids; send the text"
                    " (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)"
                )
            if not isinstance(text, str):
                raise ValueError(f"input[{i}] must be a string")
            if not text:
                raise ValueError("must not be empty" if isinstance(value, str) else f"input[{i}] is empty")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


def embedder_name(spec: str) -> str:
    """The name an embedder spec serves under, without loading the model: `minilm`'s, or a custom
    class's `name` attribute (its class name when it has none at class level)."""
    if spec == "minilm":
        return MiniLM.name
    module, _, attr = spec.partition(":")
    kind = getattr(importlib.import_module(module), attr)
    name = getattr(kind, "name", None)
    return name if isinstance(name, str) else attr


@dataclass
class EmbeddingJob:
    texts: list[str]
    done: asyncio.Future[np.ndarray]


class Batcher:
    """One forward at a time; the requests that arrive while it runs go together into the next, up to
    `batch` texts (a larger request runs alone). No waiting window: a request alone goes at once.
    The worker task runs only while there is work, on the loop of the requests it serves."""

    def __init__(self, embed: Callable[[list[str]], np.ndarray], batch: int) -> None:
        self.embed, self.batch = embed, batch
        self.jobs: deque[EmbeddingJob] = deque()  # bounded by the requests Embeddings lets in
        self.worker: asyncio.Task[None] | None = None
        self.forwards = 0

    async def __call__(self, texts: list[str]) -> np.ndarray:
        job = EmbeddingJob(texts, asyncio.get_running_loop().create_future())
        self.jobs.append(job)
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self.drain())
        return await job.done  # a caller that goes cancels its future: the worker skips it

    async def drain(self) -> None:
        while self.jobs:
            batch = self.take()
            if batch:
                await self.forward(batch)

    def take(self) -> list[EmbeddingJob]:
        batch, size = [], 0
        while self.jobs and (not batch or size + len(self.jobs[0].texts) <= self.batch):
            job = self.jobs.popleft()
            if not job.done.done():
                batch.append(job)
                size += len(job.texts)
        return batch

    async def forward(self, batch: list[EmbeddingJob]) -> None:
        self.forwards += 1
        try:
            vectors = await asyncio.to_thread(self.embed, [t for job in batch for t in job.texts])
        except Exception as exc:
            for job in batch:
                if not job.done.done():
                    job.done.set_exception(exc)
            return
        start = 0
        for job in batch:
            if not job.done.done():
                job.done.set_result(vectors[start : start + len(job.texts)])
            start += len(job.texts)


class Embeddings:
    """The embedding model as /v1/models and /v1/embeddings see it. At most `max_requests` embedding
    requests are in flight (tokenizing, waiting or in a forward); more get a 503 at once."""

    def __init__(self, settings: Settings, *, max_requests: int = 64, batch: int = 256) -> None:
        self.settings = settings
        self.name = embedder_name(settings.semantic_cache.embedder)
        self.max_requests = max_requests
        self.in_flight = 0
        self.embedder: Embedder | None = None
        self.loading = threading.Lock()
        self.batcher = Batcher(lambda texts: self.load().embed(texts), batch)

    def serves(self, model: str) -> bool:
        return model == self.name

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": self.name, "object": "model", "created": created, "owned_by": "kvgate"}]

    def load(self) -> Embedder:
        with self.loading:
            if self.embedder is None:
                self.embedder = make_embedder(self.settings.semantic_cache.embedder)
            return self.embedder

    async def answer(self, call: Call) -> Reply:
        if not self.serves(call.model):
            raise bad_request(f"`{call.model}` is not an embedding model; use `{self.name}`", "model", "invalid_model")
        try:
            body = EmbeddingRequest.model_validate(call.body)
        except ValidationError as exc:  # as routes.validated says it (not imported: routes is above backends)
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            raise from_validation(RequestValidationError(errors)) from None
        if self.in_flight >= self.max_requests:
            said = f"{self.max_requests} embedding requests are in flight already; retry shortly"
            raise APIError(503, said, code="overloaded", headers={"retry-after": "1"})
        self.in_flight += 1
        try:
            return await self.embed(body)
        finally:
            self.in_flight -= 1

    async def embed(self, body: EmbeddingRequest) -> Reply:
        try:
            embedder = await asyncio.to_thread(self.load)
        except (ImportError, OSError, ValueError, TypeError) as exc:
            said = f"the embedding model could not be loaded: {exc}"
            raise APIError(503, said, code="embedder_unavailable") from exc
        if body.dimensions is not None and body.dimensions != embedder.dim:
            said = f"`{self.name}` has {embedder.dim} dimensions and cannot shorten them; omit 'dimensions'"
            raise bad_request(said, "dimensions", "invalid_value")
        texts = body.texts
        counts = await asyncio.to_thread(count_tokens, embedder, texts)
        limit = getattr(embedder, "max_length", None)
        over = next((i for i, n in enumerate(counts) if limit is not None and n > limit), None)
        if over is not None:
            said = (
                f"input[{over}] has {counts[over]} tokens; `{self.name}` reads at most {limit} tokens per input"
                " (its special tokens included). Shorten or split it."
            )
            raise bad_request(said, "input", "context_length_exceeded")
        vectors = await self.batcher(texts)
        tokens = sum(counts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        content = await asyncio.to_thread(render, vectors, body.encoding_format, self.name, usage)
        return Reply(headers=JSON, content=content, settled=Outcome(usage=usage, done=True))


def count_tokens(embedder: Embedder, texts: list[str]) -> list[int]:
    """Tokens as the embedder's model reads them (special tokens included); words without a tokenizer."""
    tokenize = getattr(embedder, "tokens", None) or getattr(embedder, "tokenizer", None)
    if tokenize is None:
        return [len(text.split()) for text in texts]
    ids = tokenize(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    return [len(row) for row in ids]


def render(vectors: np.ndarray, encoding: str, model: str, usage: dict[str, int]) -> bytes:
    """OpenAI's embedding list; base64 is the raw little-endian float32 row, as the openai SDK decodes it."""
    rows = np.asarray(vectors, dtype="<f4")
    if encoding == "base64":
        data: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        data = rows.tolist()
    items = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(data)]
    return dumps({"object": "list", "data": items, "model": model, "usage": usage})
