"""kvgate inside RAG frameworks: retrieved documents reach kvgate as `documents`, so their KV is
reused from one question to the next instead of pasted into every prompt.

- `kvgate.integrations.langchain`: `ChatKVGate` (a LangChain chat model) and
  `create_kvgate_retrieval_chain` (retriever -> kvgate, shaped like LangChain's retrieval chain);
  needs `langchain-core` (`pip install kvgate[langchain]`).
- `kvgate.integrations.llamaindex`: `KVGateLLM` (a LlamaIndex LLM) and `KVGateQueryEngine`
  (retriever -> kvgate); needs `llama-index-core` (`pip install kvgate[llamaindex]`).

Neither framework is imported until its module is.
"""
