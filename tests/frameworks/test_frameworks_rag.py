"""A LangChain RAG chain against kvgate's default server, with no kvgate field: a retriever's documents
pasted into the prompt ("stuff"), as LangChain's own chains do. A second question that retrieves the same
documents in another order reuses them, found by their content (runtime/chunks.py), and LangChain reads
what was reused where it reads any provider's prompt cache (`usage_metadata`)."""

from __future__ import annotations

from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_openai import ChatOpenAI

from tests.helpers.corpus import musique_rows

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question from the context. Be brief."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ]
)
QUESTIONS = ["Who is the mayor?", "Which town trades in salt?", "Where was the college founded?", "Who was born there?"]


def test_a_rag_chain_reuses_the_documents_it_pasted_in_another_order(prefix_base_url, model_name, loaded) -> None:
    passages = musique_rows(1, seed=301)[0]["passages"][:4]
    # The retrieval is not what is tested: a fake embedding ranks the four passages in some order per question.
    store = InMemoryVectorStore.from_documents([Document(p) for p in passages], DeterministicFakeEmbedding(size=32))
    retriever = store.as_retriever(search_kwargs={"k": 4})
    llm = ChatOpenAI(
        base_url=f"{prefix_base_url}/v1", api_key="unused", model=model_name, max_tokens=8, temperature=0, max_retries=0
    )
    replies: list[AIMessage] = []
    chain = (
        {
            "context": retriever | RunnableLambda(lambda docs: "\n\n".join(d.page_content for d in docs)),
            "question": RunnablePassthrough(),
        }
        | PROMPT
        | llm
        | RunnableLambda(lambda m: replies.append(m) or m)
        | StrOutputParser()
    )
    orders = {q: [d.page_content for d in retriever.invoke(q)] for q in QUESTIONS}
    first = QUESTIONS[0]
    second = next(q for q in QUESTIONS[1:] if orders[q] != orders[first])  # another order: no prefix holds it
    assert sorted(orders[second]) == sorted(orders[first])

    chain.invoke(first)
    chain.invoke(second)
    cache_read = [m.usage_metadata["input_token_details"].get("cache_read", 0) for m in replies]
    pasted = sum(len(loaded.tokenizer.encode(p, add_special_tokens=False)) for p in passages)
    assert cache_read[0] < 40  # new, but for the template's opening
    assert cache_read[1] >= 0.8 * pasted, (cache_read, pasted)  # reused; what blend recomputed is not counted
