"""/v1/embeddings in runtime mode: the semantic cache's embedding model, OpenAI-shaped.

Placeholder seam (being written): `Embeddings(settings).answer(call)` returns the Reply."""

from __future__ import annotations

from typing import Any

from kvgate.gateway.backend import Call, Reply
from kvgate.gateway.errors import APIError
from kvgate.gateway.settings import Settings


class Embeddings:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def serves(self, model: str) -> bool:
        return False

    def cards(self, created: int) -> list[dict[str, Any]]:
        return []

    async def answer(self, call: Call) -> Reply:
        raise APIError(404, "/v1/embeddings is not served yet", code="unsupported_route")
