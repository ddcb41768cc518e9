"""gateway/outgoing.py: what an upstream that is not kvgate gets. Documents are pasted in the prompt in
kvgate's one document form (runtime/document_text.py), so the engine's own prefix cache hits on them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgate.bench.upstream import serve_upstream
from tests.helpers import loopback
from tests.helpers.servers import serving
from tests.server.test_proxy import front, requests_seen


@pytest.fixture
def upstreams() -> Iterator[tuple[str]]:
    with serve_upstream(models=("stub-a",)) as a:
        yield (a,)


def test_documents_reach_another_engine_pasted_in_kvgates_one_form(tmp_path, upstreams):
    """An engine that is not kvgate reads the documents in the prompt, in front of the first user message,
    always in one form: the same documents in the same order make the same prefix for its prefix cache."""
    (a,) = upstreams
    system = {"role": "system", "content": "Be brief."}
    body = {"model": "stub-a", "messages": [system, {"role": "user", "content": "Where?"}]}
    with serving(front(tmp_path, a), None) as url:
        documents = [{"text": "Doc one."}, {"text": "Doc two."}]
        loopback.post(url + "/v1/chat/completions", json={**body, "documents": documents}).raise_for_status()
        sent = loopback.get(a + "/_stats").json()["last_body"]
        pasted = "<document>\nDoc one.\n</document>\n\n<document>\nDoc two.\n</document>\n\nWhere?"
        assert "documents" not in sent and sent["messages"] == [system, {"role": "user", "content": pasted}]
        for documents, param in (([{"id": "doc-1"}], "documents.0.id"), ([{"text": 3}], "documents.0")):
            r = loopback.post(url + "/v1/chat/completions", json={**body, "documents": documents})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # Messages the documents cannot be pasted into (found by test_fuzz: they were a 500)
        for messages, param in (
            ([system, {"role": "user", "content": 2.5}], "messages.1.content"),
            (["hi"], "messages.0"),
        ):
            r = loopback.post(
                url + "/v1/chat/completions", json={**body, "messages": messages, "documents": [{"text": "Doc."}]}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert requests_seen(a) == 1  # refused here, never sent
