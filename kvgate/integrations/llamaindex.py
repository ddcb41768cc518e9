"""LlamaIndex over kvgate: `KVGateLLM`, an LLM, and `KVGateQueryEngine`, whose retrieved nodes
reach kvgate as `documents` (their KV reused), never pasted into the prompt.

    llm = KVGateLLM(base_url="http://127.0.0.1:8000", max_tokens=64, temperature=0)
    engine = KVGateQueryEngine(retriever=index.as_retriever(similarity_top_k=3), llm=llm)
    response = engine.query("Where is Varnholt?")
    response.response, response.source_nodes, response.metadata["kvgate"]["reused_tokens"]
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.base.response.schema import Response
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW, DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from kvgate.client import AsyncChatStream, AsyncClient, ChatStream, Client
from kvgate.types import Reuse

__all__ = ["KVGateLLM", "KVGateQueryEngine"]


class KVGateLLM(LLM):
    """A kvgate model as a LlamaIndex LLM (a chat model; `complete` sends the prompt as a user turn).

    Per call (`chat(messages, documents=[...])`): `documents` (texts, nodes, or kvgate's
    {"text"}/{"id"} dicts; a node as the LLM sees it), `program`, `reuse`, `recompute_ratio`,
    `semantic_cache`, and any OpenAI field. Responses' `additional_kwargs["kvgate"]` is what
    kvgate reused (`kvgate.types.Reuse` as a dict), beside the token counts; `raw` the OpenAI JSON.
    """

    base_url: str = Field(default="http://127.0.0.1:8000", description="kvgate's address")
    api_key: str | None = Field(default=None, exclude=True)
    model: str | None = Field(default=None, description="None: the server's first model")
    max_tokens: int | None = None
    temperature: float | None = None
    reuse: str | None = Field(default=None, description="blend (the server's default), naive, prefix or full")
    recompute_ratio: float | None = None
    semantic_cache: bool | None = None
    timeout: float = 600.0
    context_window: int = DEFAULT_CONTEXT_WINDOW
    additional_kwargs: dict[str, Any] = Field(default_factory=dict, description="other OpenAI fields")

    _client: Client | None = PrivateAttr(default=None)
    _aclient: AsyncClient | None = PrivateAttr(default=None)
    _aloop: asyncio.AbstractEventLoop | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "KVGateLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
            is_chat_model=True,
            model_name=self.model or "",
        )

    def _sync(self) -> Client:
        if self._client is None:
            self._client = Client(self.base_url, self.api_key, timeout=self.timeout)
        return self._client

    def _async(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aloop is not loop:  # httpx's async pool lives in one event loop
            self._aclient, self._aloop = AsyncClient(self.base_url, self.api_key, timeout=self.timeout), loop
        return self._aclient

    def _request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], stream: bool) -> dict[str, Any]:
        """`client.chat`'s arguments: the fields, then this call's kwargs over them."""
        fields = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        fields |= {"reuse": self.reuse, "recompute_ratio": self.recompute_ratio, "cache": self.semantic_cache}
        fields = {k: v for k, v in fields.items() if v is not None} | self.additional_kwargs
        call = dict(kwargs)
        if "semantic_cache" in call:
            call["cache"] = call.pop("semantic_cache")
        if call.get("documents") is not None:
            call["documents"] = [_document(d) for d in call["documents"]]
        if stream:
            call |= {"stream": True, "stream_options": {"include_usage": True}}
        sent = [{"role": m.role.value, "content": m.content or ""} for m in messages]
        return {"messages": sent, **fields, **call}

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        reply = self._sync().chat(**self._request(messages, kwargs, stream=False))
        return _response(reply.text, reply.raw, reply.usage, reply.reuse)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        reply = await self._async().chat(**self._request(messages, kwargs, stream=False))
        return _response(reply.text, reply.raw, reply.usage, reply.reuse)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream: ChatStream = self._sync().chat(**self._request(messages, kwargs, stream=True))

        def gen() -> ChatResponseGen:
            with stream:
                for raw in stream:
                    yield _response(stream.text, raw, stream.usage, stream.reuse, delta=True)

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream: AsyncChatStream = await self._async().chat(**self._request(messages, kwargs, stream=True))

        async def gen() -> ChatResponseAsyncGen:
            async with stream:
                async for raw in stream:
                    yield _response(stream.text, raw, stream.usage, stream.reuse, delta=True)

        return gen()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_to_completion_decorator(self.chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)


def _document(doc: NodeWithScore | BaseNode | str | Mapping[str, Any]) -> str | Mapping[str, Any]:
    if isinstance(doc, NodeWithScore):
        doc = doc.node
    return doc.get_content(metadata_mode=MetadataMode.LLM) if isinstance(doc, BaseNode) else doc


def _response(
    text: str, raw: Mapping[str, Any], usage: Mapping[str, Any] | None, reuse: Reuse, delta: bool = False
) -> ChatResponse:
    """A reply, or (`delta`) a stream chunk of one with the text so far."""
    counts = {k: v for k, v in (usage or {}).items() if isinstance(v, int)}
    piece = ((raw.get("choices") or [{}])[0].get("delta") or {}).get("content") or "" if delta else None
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
        delta=piece,
        raw=dict(raw),
        additional_kwargs={**counts, "kvgate": dataclasses.asdict(reuse)},
    )


class KVGateQueryEngine(CustomQueryEngine):
    """Retrieve, then ask kvgate: the retrieved nodes go as kvgate `documents`, the query as the user
    message (after `system_prompt`, if any). The `Response`'s `source_nodes` are the retrieved
    nodes, its `metadata["kvgate"]` what kvgate reused and `metadata["usage"]` the token counts."""

    retriever: BaseRetriever
    llm: KVGateLLM
    system_prompt: str | None = None

    def _messages(self, query: str) -> list[ChatMessage]:
        system = [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt)] if self.system_prompt else []
        return [*system, ChatMessage(role=MessageRole.USER, content=query)]

    def custom_query(self, query_str: str) -> Response:
        nodes = self.retriever.retrieve(query_str)
        return _answer(self.llm.chat(self._messages(query_str), documents=nodes), nodes)

    async def acustom_query(self, query_str: str) -> Response:
        nodes = await self.retriever.aretrieve(query_str)
        return _answer(await self.llm.achat(self._messages(query_str), documents=nodes), nodes)


def _answer(reply: ChatResponse, nodes: list[NodeWithScore]) -> Response:
    extra = dict(reply.additional_kwargs)
    reuse = extra.pop("kvgate")
    return Response(response=reply.message.content, source_nodes=nodes, metadata={"kvgate": reuse, "usage": extra})
