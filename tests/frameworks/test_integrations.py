"""LangChain and LlamaIndex over the real server: retrieved documents reach kvgate as `documents`,
so a second question over them reuses their KV. Real retrievers over MiniLM embeddings."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.messages import HumanMessage
from langchain_core.vectorstores import InMemoryVectorStore
from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatStartEvent
from llama_index.core.schema import TextNode
from pydantic import PrivateAttr

from kvgate.integrations.langchain import ChatKVGate, create_kvgate_retrieval_chain
from kvgate.integrations.llamaindex import KVGateLLM, KVGateQueryEngine
from kvgate.semantic_cache.embedder import MiniLM

# Invented facts, a set per test, so each test's first question finds no document KV cached yet.
RIVERS = [
    "The town of Varnholt lies on the river Esk and is known for its glass bells.",
    "Mirela Dossantine was the first mayor of Varnholt and built its lighthouse in 1821.",
    "The island of Quessary exports blue salt and has no trees.",
    "Tobin Arkwell is a clockmaker from Quessary who repairs the compasses of ships.",
    "The Harrowmere festival celebrates the autumn return of the copper geese.",
]
LAKES = [
    "Lake Oravend is frozen nine months a year; its fishermen cut holes with silver saws.",
    "The city of Pellastro was founded by twin sisters who painted every roof green.",
    "Professor Ilka Venderhoff discovered the singing moss of the Corrow Hills.",
    "The Corrow Hills are home to white goats that graze only at night.",
]
BRIDGE = [
    "The Brindlecoat mountains are crossed by one rope bridge, built by the weaver Astrid Fennimore.",
    "Fennimore's rope bridge is mended every spring with yarn dyed in saffron.",
]
FERRY = ["The ferry to Ostrelle leaves at dawn and carries only bicycles and bees."]
SHORT = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def minilm() -> MiniLM:
    return MiniLM()


class MiniLMEmbeddings(Embeddings):
    """kvgate's MiniLM as LangChain embeddings."""

    def __init__(self, model: MiniLM) -> None:
        self.model = model

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.model.embed(list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


class MiniLMEmbedding(BaseEmbedding):
    """kvgate's MiniLM as a LlamaIndex embedding model."""

    _model: MiniLM = PrivateAttr()

    def __init__(self, model: MiniLM) -> None:
        super().__init__(model_name=model.name)
        self._model = model

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._model.embed(texts).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embedding(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


class SeenMessages(BaseCallbackHandler):
    """What LangChain handed the chat model: its messages and invocation params."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[Any], dict[str, Any]]] = []

    def on_chat_model_start(self, serialized: Any, messages: list[list[Any]], **kwargs: Any) -> None:
        self.calls.append((messages[0], kwargs.get("invocation_params") or {}))


def reused(message: Any) -> int:
    return message.response_metadata["kvgate"]["reused_tokens"]


def without_id(reuse: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reuse.items() if k != "request_id"}


def test_langchain_retrieval_chain_sends_documents_and_reuses_their_kv(base_url, model_name, minilm) -> None:
    store = InMemoryVectorStore(embedding=MiniLMEmbeddings(minilm))
    store.add_documents([Document(page_content=text) for text in RIVERS])
    llm = ChatKVGate(base_url=base_url, model=model_name, **SHORT)
    chain = create_kvgate_retrieval_chain(store.as_retriever(search_kwargs={"k": 2}), llm)
    seen = SeenMessages()

    first = chain.invoke({"input": "What is Varnholt known for?"}, {"callbacks": [seen]})
    second = chain.invoke({"input": "Which river does Varnholt lie on?"}, {"callbacks": [seen]})

    for out, question in ((first, "What is Varnholt known for?"), (second, "Which river does Varnholt lie on?")):
        assert set(out) == {"input", "context", "answer"} and out["input"] == question
        assert len(out["context"]) == 2 and RIVERS[0] in [d.page_content for d in out["context"]]
        assert out["answer"].content
    # The model got the question alone, the retrieved texts as kvgate documents.
    for (messages, params), out in zip(seen.calls, (first, second), strict=True):
        assert [type(m) for m in messages] == [HumanMessage] and messages[0].content == out["input"]
        assert [d.page_content for d in params["documents"]] == [d.page_content for d in out["context"]]
    assert reused(first["answer"]) == 0  # read for the first time
    assert reused(second["answer"]) > 0  # only documents sent as documents are reused
    usage = second["answer"].usage_metadata
    assert usage["input_token_details"]["cache_read"] == reused(second["answer"])
    assert usage["input_tokens"] > reused(second["answer"]) and usage["output_tokens"] > 0


def test_chat_kvgate_bound_documents_stream_as_invoke(base_url, model_name) -> None:
    llm = ChatKVGate(base_url=base_url, model=model_name, **SHORT)
    bound = llm.bind(documents=[Document(page_content=BRIDGE[0]), BRIDGE[1]])
    question = "Who built the rope bridge?"
    plain = llm.invoke(question)
    cold, warm = bound.invoke(question), bound.invoke(question)
    assert reused(plain) == reused(cold) == 0 and reused(warm) > 0
    assert warm.usage_metadata["input_tokens"] > plain.usage_metadata["input_tokens"] + 20  # the documents

    chunks = list(bound.stream(question))
    assert sum(bool(c.content) for c in chunks) > 1
    joined = sum(chunks[1:], chunks[0])
    # Same cached documents, temperature 0: the same words, the same reuse.
    assert joined.content == warm.content
    assert without_id(joined.response_metadata["kvgate"]) == without_id(warm.response_metadata["kvgate"])
    assert joined.usage_metadata == warm.usage_metadata


def test_chat_kvgate_async_chain_and_stream(base_url, model_name) -> None:
    docs = [Document(page_content=text) for text in FERRY]
    llm = ChatKVGate(base_url=base_url, model=model_name, **SHORT)
    chain = create_kvgate_retrieval_chain(lambda question: docs, llm)
    question = {"input": "When does the ferry leave?"}

    async def stream() -> list[Any]:
        return [c async for c in llm.astream(question["input"], documents=docs)]

    # Each asyncio.run is a new event loop: the model follows it.
    first, second = asyncio.run(chain.ainvoke(question)), asyncio.run(chain.ainvoke(question))
    chunks = asyncio.run(stream())
    assert reused(first["answer"]) == 0 and reused(second["answer"]) > 0 and second["context"] == docs
    joined = sum(chunks[1:], chunks[0])
    assert joined.content == second["answer"].content and reused(joined) == reused(second["answer"])


class SeenChats(BaseEventHandler):
    """What LlamaIndex handed the LLM: each chat's messages and kwargs."""

    calls: list[LLMChatStartEvent] = []

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatStartEvent):
            self.calls.append(event)


@pytest.fixture
def offline_settings(monkeypatch: pytest.MonkeyPatch, base_url, model_name, minilm) -> KVGateLLM:
    """LlamaIndex's global LLM and embedding model: kvgate and MiniLM, never a network default."""
    llm = KVGateLLM(base_url=base_url, model=model_name, **SHORT)
    monkeypatch.setattr(Settings, "_llm", llm)
    monkeypatch.setattr(Settings, "_embed_model", MiniLMEmbedding(minilm))
    return llm


def test_llamaindex_query_engine_sends_nodes_and_reuses_their_kv(offline_settings) -> None:
    index = VectorStoreIndex([TextNode(text=text) for text in LAKES])
    retriever = index.as_retriever(similarity_top_k=2)
    engine = KVGateQueryEngine(retriever=retriever, llm=offline_settings)
    seen = SeenChats()
    get_dispatcher().add_event_handler(seen)
    try:
        first = engine.query("What is Pellastro known for?")
        second = engine.query("Who founded Pellastro?")
    finally:
        get_dispatcher().event_handlers.remove(seen)

    asked = (("What is Pellastro known for?", first), ("Who founded Pellastro?", second))
    for (question, response), event in zip(asked, seen.calls, strict=True):
        assert [n.node.node_id for n in response.source_nodes] == [n.node.node_id for n in retriever.retrieve(question)]
        assert LAKES[1] in [n.node.get_content() for n in response.source_nodes] and response.response
        # The LLM got the question alone, the retrieved nodes as kvgate documents.
        assert [(m.role.value, m.content) for m in event.messages] == [("user", question)]
        assert event.additional_kwargs["documents"] == response.source_nodes
    assert first.metadata["kvgate"]["reused_tokens"] == 0
    assert second.metadata["kvgate"]["reused_tokens"] > 0
    assert second.metadata["usage"]["prompt_tokens"] > second.metadata["kvgate"]["reused_tokens"]


def test_kvgate_llm_sends_a_node_as_its_text_and_streams_as_it_chats(offline_settings) -> None:
    llm, text = offline_settings, BRIDGE[0] + " (LlamaIndex)"
    docs, messages = [TextNode(text=text)], [ChatMessage(role="user", content="Who built the rope bridge?")]
    cold = llm.chat(messages, documents=[text])
    warm = llm.chat(messages, documents=docs)  # the node goes as its text, whose KV is now cached
    assert cold.additional_kwargs["kvgate"]["reused_tokens"] == 0 < warm.additional_kwargs["kvgate"]["reused_tokens"]
    assert cold.additional_kwargs["prompt_tokens"] == warm.additional_kwargs["prompt_tokens"]

    pieces = list(llm.stream_chat(messages, documents=docs))
    assert "".join(p.delta for p in pieces) == pieces[-1].message.content == warm.message.content
    assert without_id(pieces[-1].additional_kwargs["kvgate"]) == without_id(warm.additional_kwargs["kvgate"])
    assert llm.complete("Who built the rope bridge?", documents=docs).text == warm.message.content

    async def stream() -> list[Any]:
        return [p async for p in await llm.astream_chat(messages, documents=docs)]

    replies = asyncio.run(llm.achat(messages, documents=docs)), asyncio.run(stream())[-1]  # two event loops
    assert [r.message.content for r in replies] == [warm.message.content] * 2


def test_importing_kvgate_imports_no_framework() -> None:
    code = "import sys, kvgate, kvgate.client, kvgate.integrations; print(sorted(m for m in sys.modules"
    code += " if m.split('.')[0] in ('langchain_core', 'llama_index')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
