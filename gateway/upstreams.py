"""Upstreams: OpenAI-compatible servers kvgate forwards to (vLLM, SGLang, a hosted API, or its own
runtime workers). One pooled aiohttp client (its HTTP parser is C: a third of httpx's cost per request,
measured, on the path every proxied request takes); retries with backoff on connect errors, 5xx and
429 until the first byte of a response arrives; then the next upstream serving the model."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import anyio

from kvgate.gateway.admission import ConcurrencyGate
from kvgate.gateway.errors import APIError
from kvgate.gateway.routing import Ring

log = logging.getLogger("kvgate.proxy")
RETRYABLE = {429, 500, 502, 503, 504}
# A try that an upstream failed (`kvgate_upstream_errors_total{error}`): retried, or the next upstream tried.
ERRORS = ("timeout", "unreachable", *(str(status) for status in sorted(RETRYABLE)))
SECRET_HEADER = "x-kvgate-worker-secret"  # what a runtime worker asks of every request: its front's secret


@dataclass(frozen=True)
class Upstream:
    name: str
    base_url: str
    models: dict[str, str]  # the name clients use -> the upstream's name for it; "*" passes any name
    api_key: str | None = None  # sent as the bearer token; None: no authorization header
    max_in_flight: int = 64  # beyond this, requests wait at the gateway in program order
    worker: bool = False  # one of kvgate's own runtime workers (trusted with documents and kvgate's options)
    fallback: bool = False  # tried only after the other upstreams serving the model, in the order configured
    secret: str | None = field(default=None, repr=False)  # a worker's: sent with every request to it

    def serves(self, model: str) -> bool:
        return model in self.models or "*" in self.models

    def model_name(self, model: str) -> str:
        return self.models.get(model, model)

    def credentials(self) -> dict[str, str]:
        """What proves this gateway to the upstream: its API key; to a worker, its front's secret."""
        found = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return found | ({SECRET_HEADER: self.secret} if self.secret else {})


@dataclass(frozen=True)
class ProxyConfig:
    upstreams: tuple[Upstream, ...]
    retries: int = 2  # per upstream, after the first try
    backoff_s: float = 0.1  # doubled each retry, with jitter; a 429's Retry-After is honoured up to max_backoff_s
    max_backoff_s: float = 2.0
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 60.0  # until the response's first body bytes (a prefill may be long)
    read_timeout_s: float = 300.0  # between two reads of a streamed body
    spill_at: int = 4  # in-flight requests at the preferred worker from which a request spills over


class UpstreamFailed(Exception):
    """The connection to an upstream failed: refused, reset, or an answer that is not HTTP."""


class UpstreamTimeout(UpstreamFailed):
    """An upstream took longer than a timeout allows."""


@dataclass
class OpenedStream:
    """An upstream's answer whose status, headers and first body bytes have arrived. It holds a slot of
    the upstream's gate until closed."""

    upstream: Upstream
    response: aiohttp.ClientResponse = field(repr=False)
    status: int
    headers: dict[str, str]  # names in lower case
    first: bytes
    chunks: AsyncIterator[bytes] = field(repr=False)  # the rest of the body
    gate: ConcurrencyGate = field(repr=False)
    closed: bool = False

    async def close(self) -> None:
        """Once, whatever happened: the connection closed (a worker sees the client leave), the slot
        freed. Shielded: a client gone cancels everything around it."""
        if self.closed:
            return
        self.closed = True
        try:
            with anyio.CancelScope(shield=True):
                let_go(self.response)
        finally:
            self.gate.release()


def let_go(response: aiohttp.ClientResponse) -> None:
    """Back to the pool when read to its end; else its connection is closed (a worker sees the client leave)."""
    if response.content.at_eof():
        response.release()
    else:
        response.close()


async def chunks_of(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive; its failures as UpstreamFailed (or UpstreamTimeout). A body cut
    short still yields every byte that arrived before the cut."""
    try:
        while chunk := await response.content.readany():
            yield chunk
    except TimeoutError as exc:
        raise UpstreamTimeout("the upstream stopped sending") from exc
    except aiohttp.ClientError as exc:
        if rest := received(response.content):
            yield rest
        raise UpstreamFailed(type(exc).__name__) from exc


def received(content: aiohttp.StreamReader) -> bytes:
    """What the reader holds unread. aiohttp raises a cut body's error before the bytes it had already
    received (readany checks the error first), so a stream's last whole events would be lost; its
    private read bypasses that check (b"" if a later aiohttp lacks it)."""
    try:
        return content._read_nowait(-1)
    except Exception:
        return b""


def retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: not worth parsing for a wait capped at seconds


class UpstreamPool:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.upstreams = {u.name: u for u in config.upstreams}
        self.gates = {u.name: ConcurrencyGate(u.max_in_flight) for u in config.upstreams}
        self.ring = Ring([u.name for u in config.upstreams if u.worker])
        self._session: aiohttp.ClientSession | None = None
        self.answered: Counter[tuple[str, str]] = Counter()  # (upstream, status) of the answers passed on
        self.errors = {(u.name, error): 0 for u in config.upstreams for error in ERRORS}

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made at first use: an aiohttp session belongs to the running event loop."""
        if self._session is None:
            timeout = aiohttp.ClientTimeout(connect=self.config.connect_timeout_s, sock_read=self.config.read_timeout_s)
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)  # gates bound what is in flight
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, skip_auto_headers=("user-agent",)
            )
        return self._session

    def models(self) -> list[str]:
        return sorted({m for u in self.config.upstreams for m in u.models if m != "*"})

    def serving(self, model: str | None) -> list[Upstream]:
        """Upstreams serving `model` (None: any), in the order configured."""
        return [u for u in self.config.upstreams if model is None or u.serves(model)]

    def load(self, name: str) -> int:
        """Requests this front has in flight at an upstream, or waiting for it."""
        return self.gates[name].load

    def workers(self, affinity: Sequence[str]) -> list[Upstream]:
        """kvgate's runtime workers, best first: the one its documents' text hashes to, unless busy."""
        if not self.ring.names:
            return []
        ordered = self.ring.order(affinity, self.load, self.config.spill_at)
        return [self.upstreams[n] for n in ordered]

    async def open(
        self,
        order: Sequence[Upstream],
        path: str,
        body: Callable[[Upstream], bytes],
        headers: Callable[[Upstream], dict[str, str]],
        method: str = "POST",
        rank: float | None = None,
        stream: bool = False,
    ) -> OpenedStream:
        """Send to the first upstream that answers, waiting at its gate in `rank` order. An error status
        not worth retrying (or the last one left) is returned as the answer. Raises APIError 502/504 when
        none answered at all. A stream's first bytes must come within the first-byte timeout; a whole
        answer only comes once generated, so it has the read timeout."""
        if not order:
            raise APIError(404, "no upstream serves this model", "model", "model_not_found")
        failure = APIError(502, "no upstream answered", code="upstream_unreachable")
        rank = time.monotonic() if rank is None else rank
        for upstream in order:
            gate = self.gates[upstream.name]
            await gate.acquire(rank)
            handed = False
            try:
                for attempt in range(self.config.retries + 1):
                    last_try = attempt == self.config.retries
                    wait = self.delay(attempt)
                    try:
                        response, first, rest = await self.send(
                            upstream, method, path, body(upstream), headers(upstream), stream
                        )
                    except UpstreamTimeout:
                        failure = APIError(504, f"upstream {upstream.name} timed out", code="upstream_timeout")
                        log.warning("upstream %s: timed out (try %d)", upstream.name, attempt + 1)
                        self.errors[upstream.name, "timeout"] += 1
                    except UpstreamFailed as exc:
                        failure = APIError(502, f"upstream {upstream.name} is unreachable", code="upstream_unreachable")
                        log.warning("upstream %s: %s (try %d)", upstream.name, exc, attempt + 1)
                        self.errors[upstream.name, "unreachable"] += 1
                    else:
                        status = response.status
                        said = {k.lower(): v for k, v in response.headers.items()}
                        after = retry_after(said.get("retry-after"))
                        too_late = after is not None and after > self.config.max_backoff_s
                        if status not in RETRYABLE or (upstream is order[-1] and (last_try or too_late)):
                            handed = True  # the answer holds the slot now
                            self.answered[upstream.name, str(status)] += 1
                            return OpenedStream(upstream, response, status, said, first, rest, gate)
                        let_go(response)
                        log.warning("upstream %s: status %d (try %d)", upstream.name, status, attempt + 1)
                        self.errors[upstream.name, str(status)] += 1
                        if too_late:
                            break  # its limit lifts too late: the next upstream now
                        wait = max(wait, after or 0.0)
                    if not last_try:  # the next upstream is tried at once
                        await asyncio.sleep(wait)
            finally:
                if not handed:
                    gate.release()
        raise failure

    def delay(self, attempt: int) -> float:
        return min(self.config.backoff_s * 2**attempt, self.config.max_backoff_s) * random.uniform(0.5, 1.0)

    async def send(
        self, upstream: Upstream, method: str, path: str, body: bytes, headers: dict[str, str], stream: bool
    ) -> tuple[aiohttp.ClientResponse, bytes, AsyncIterator[bytes]]:
        """The upstream's response, its first body bytes (a failure before them may be retried), the rest."""
        sent = {**headers, "content-type": "application/json", "accept-encoding": "identity", **upstream.credentials()}
        deadline = self.config.first_byte_timeout_s if stream else None
        try:
            async with asyncio.timeout(deadline):  # no task per call, unlike wait_for
                response = await self.session.request(method, upstream.base_url + path, data=body or None, headers=sent)
                chunks = chunks_of(response)
                try:
                    first = await anext(chunks, b"")
                except BaseException:
                    response.close()
                    raise
        except TimeoutError as exc:
            raise UpstreamTimeout("no answer in time") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamFailed(type(exc).__name__) from exc
        return response, first, chunks

    async def reachable(self, timeout_s: float = 2.0) -> dict[str, bool]:
        """Whether each upstream answers `GET /v1/models` (any status: the server is up; its body is
        never read)."""
        limit = aiohttp.ClientTimeout(total=timeout_s)

        async def probe(u: Upstream) -> bool:
            try:
                async with self.session.get(u.base_url + "/v1/models", headers=u.credentials(), timeout=limit):
                    return True
            except (aiohttp.ClientError, TimeoutError):
                return False

        found = await asyncio.gather(*(probe(u) for u in self.config.upstreams))
        return dict(zip(self.upstreams, found))

    async def scrape(self, upstreams: Sequence[Upstream], timeout_s: float = 2.0) -> dict[str, str]:
        """The `/metrics` text of each upstream that answers in time."""
        limit = aiohttp.ClientTimeout(total=timeout_s)

        async def one(u: Upstream) -> str | None:
            try:
                async with self.session.get(u.base_url + "/metrics", headers=u.credentials(), timeout=limit) as r:
                    return await r.text() if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                return None

        found = await asyncio.gather(*(one(u) for u in upstreams))
        return {u.name: text for u, text in zip(upstreams, found) if text is not None}

    async def scrape_named(self, names: Sequence[str], timeout_s: float) -> dict[str, str]:
        return await self.scrape([self.upstreams[n] for n in names], timeout_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
