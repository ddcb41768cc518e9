"""LangChain over kvgate: `ChatKVGate`, a chat model, and `create_kvgate_retrieval_chain`, whose
retrieved documents reach kvgate as `documents` (their KV reused), never pasted into the prompt.

    llm = ChatKVGate(base_url="http://127.0.0.1:8000", max_tokens=64, temperature=0)
    chain = create_kvgate_retrieval_chain(vectorstore.as_retriever(), llm)
    out = chain.invoke({"input": "Where is Varnholt?"})  # {"input", "context", "answer"}
    out["answer"].content, out["answer"].response_metadata["kvgate"]["reused_tokens"]
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from operator import itemgetter
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    UsageMetadata,
    convert_to_openai_messages,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from kvgate.client import AsyncClient, Client
from kvgate.types import Reuse

__all__ = ["ChatKVGate", "create_kvgate_retrieval_chain"]


class ChatKVGate(BaseChatModel):
    """A kvgate model as a LangChain chat model.

    Per call (`invoke(..., documents=[...])` or `.bind(documents=[...])`): `documents` (texts,
    LangChain `Document`s, or kvgate's {"text"}/{"id"} dicts), `program`, `reuse`,
    `recompute_ratio`, `semantic_cache`, and any OpenAI field. The reply's
    `response_metadata["kvgate"]` is what kvgate reused (`kvgate.types.Reuse` as a dict) and its
    `usage_metadata` the token counts (`input_token_details.cache_read`: reused tokens).
    """

    model_config = ConfigDict(protected_namespaces=())

    base_url: str = "http://127.0.0.1:8000"
    api_key: SecretStr | None = None
    model: str | None = None
    """None: the server's first model."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    reuse: str | None = None
    """kvgate's reuse mode: blend (the server's default), naive, prefix or full."""
    recompute_ratio: float | None = None
    semantic_cache: bool | None = None
    """kvgate's semantic cache for these requests (None: the server's setting)."""
    timeout: float = 600.0
    default_headers: dict[str, str] | None = None
    stream_usage: bool = True
    """Ask for token usage at the end of streams."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Other OpenAI fields sent with every request."""

    _client: Client | None = PrivateAttr(default=None)
    _aclient: AsyncClient | None = PrivateAttr(default=None)
    _aloop: asyncio.AbstractEventLoop | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "kvgate"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_url": self.base_url, **self._defaults()}

    def _connection(self) -> dict[str, Any]:
        key = self.api_key.get_secret_value() if self.api_key else None
        return {"base_url": self.base_url, "api_key": key, "timeout": self.timeout, "headers": self.default_headers}

    def _sync(self) -> Client:
        if self._client is None:
            self._client = Client(**self._connection())
        return self._client

    def _async(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aloop is not loop:  # httpx's async pool lives in one event loop
            self._aclient, self._aloop = AsyncClient(**self._connection()), loop
        return self._aclient

    def _defaults(self) -> dict[str, Any]:
        fields = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        fields |= {"top_p": self.top_p, "seed": self.seed, "stop": self.stop, "reuse": self.reuse}
        fields |= {"recompute_ratio": self.recompute_ratio, "cache": self.semantic_cache}
        return {k: v for k, v in fields.items() if v is not None} | self.model_kwargs

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], stream: bool
    ) -> dict[str, Any]:
        """`client.chat`'s arguments: the fields, then this call's kwargs over them."""
        call = dict(kwargs)
        if "semantic_cache" in call:
            call["cache"] = call.pop("semantic_cache")
        if call.get("documents") is not None:
            call["documents"] = [_document(d) for d in call["documents"]]
        if stop is not None:
            call["stop"] = stop
        if stream:
            call["stream"] = True
            if self.stream_usage:
                call.setdefault("stream_options", {"include_usage": True})
        return {"messages": convert_to_openai_messages(messages), **self._defaults(), **call}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        reply = self._sync().chat(**self._request(messages, stop, kwargs, stream=False))
        return _result(reply.text, reply.model, reply.finish_reason, reply.usage, reply.reuse)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        reply = await self._async().chat(**self._request(messages, stop, kwargs, stream=False))
        return _result(reply.text, reply.model, reply.finish_reason, reply.usage, reply.reuse)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        model = ""
        with self._sync().chat(**self._request(messages, stop, kwargs, stream=True)) as stream:
            for raw in stream:
                model = model or raw.get("model", "")
                if (chunk := _delta(raw)) is not None:
                    if run_manager:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        yield _last(model, stream.finish_reason, stream.usage, stream.reuse)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        model = ""
        async with await self._async().chat(**self._request(messages, stop, kwargs, stream=True)) as stream:
            async for raw in stream:
                model = model or raw.get("model", "")
                if (chunk := _delta(raw)) is not None:
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        yield _last(model, stream.finish_reason, stream.usage, stream.reuse)


def _document(doc: Document | str | Mapping[str, Any]) -> str | Mapping[str, Any]:
    return doc.page_content if isinstance(doc, Document) else doc


def _usage(usage: Mapping[str, Any] | None) -> UsageMetadata | None:
    if not usage:
        return None
    counts = UsageMetadata(
        input_tokens=int(usage.get("prompt_tokens", 0)),
        output_tokens=int(usage.get("completion_tokens", 0)),
        total_tokens=int(usage.get("total_tokens", 0)),
    )
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        counts["input_token_details"] = {"cache_read": int(cached)}
    return counts


def _metadata(model: str, finish_reason: str | None, reuse: Reuse) -> dict[str, Any]:
    return {"model_name": model, "finish_reason": finish_reason, "kvgate": dataclasses.asdict(reuse)}


def _result(text: str, model: str, finish: str | None, usage: Mapping[str, Any], reuse: Reuse) -> ChatResult:
    message = AIMessage(content=text, response_metadata=_metadata(model, finish, reuse), usage_metadata=_usage(usage))
    return ChatResult(generations=[ChatGeneration(message=message)])


def _delta(raw: Mapping[str, Any]) -> ChatGenerationChunk | None:
    """A stream chunk's text, if it has any."""
    choices = raw.get("choices") or [{}]
    text = (choices[0].get("delta") or {}).get("content")
    return ChatGenerationChunk(message=AIMessageChunk(content=text)) if text else None


def _last(model: str, finish: str | None, usage: Mapping[str, Any] | None, reuse: Reuse) -> ChatGenerationChunk:
    """The stream's closing chunk: its metadata, once (chunks' metadata add up when joined)."""
    meta = _metadata(model, finish, reuse)
    return ChatGenerationChunk(
        message=AIMessageChunk(content="", response_metadata=meta, usage_metadata=_usage(usage)),
        generation_info={"finish_reason": finish},
    )


def create_kvgate_retrieval_chain(
    retriever: Runnable[str, list[Document]] | Callable[[str], list[Document]],
    llm: Runnable[LanguageModelInput, BaseMessage],
    prompt: BasePromptTemplate | None = None,
) -> Runnable[dict[str, Any], dict[str, Any]]:
    """LangChain's retrieval chain with kvgate documents: `{"input": question, ...}` in,
    `{"input", "context", "answer"}` out, as `create_retrieval_chain` answers.

    The retriever (a LangChain retriever, or a function) runs on `input`; `llm` (a `ChatKVGate`,
    bound or not) gets `prompt` (default: the question as the user message; it may use any key of
    the input, such as a chat history) with the retrieved documents as kvgate `documents`.
    `answer` is the model's `AIMessage`, so `answer.response_metadata["kvgate"]` says what was
    reused; `context` the `Document`s.
    """
    prompt = prompt or ChatPromptTemplate.from_messages([("human", "{input}")])

    def answer(inputs: dict[str, Any]) -> Runnable:
        return prompt | llm.bind(documents=inputs["context"])  # invoked (or streamed) on `inputs`

    retrieve = (RunnableLambda(itemgetter("input")) | retriever).with_config(run_name="retrieve_documents")
    chain = RunnablePassthrough.assign(context=retrieve).assign(answer=RunnableLambda(answer, name="answer"))
    return chain.with_config(run_name="kvgate_retrieval_chain")
