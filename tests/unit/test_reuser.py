"""runtime/reuse.py's Reuser: the model check every lookup makes; a document's tokens remembered past its KV;
a document missing at blend time kept in its tenant's scope. (Exact prefixes: tests/unit/test_prefix.py.)"""

from __future__ import annotations

import pytest

from kvgate.chunk_cache import ChunkKV, ChunkStore, fingerprint
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.documents import document_ids
from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.reuse import Reuser

TEXTS = (
    "You answer questions about the river towns.",
    "Vellmoor lies on the river Ashen; its mayor is Oriel Thatchwood.",
    "Ostford trades in salt and rope, and its ferry stops at night.",
    "Who is the mayor of Vellmoor?",
    "Which town trades in salt?",
)


def make(loaded: LoadedModel, **kw) -> Reuser:
    return Reuser(loaded.model, loaded.tokenizer, ChunkStore.from_config(), fingerprint("test"), BlendConfig(), **kw)


@pytest.fixture
def reuser(loaded: LoadedModel) -> Reuser:
    return make(loaded)


@pytest.fixture(scope="module")
def pieces(loaded: LoadedModel) -> list[list[int]]:
    return [document_ids(loaded.tokenizer, t) for t in TEXTS]


def prefilled(reuser: Reuser, ids: list[int]) -> KVCache:
    kv = reuser.new_kv()
    forward(reuser.model, [Run(kv, ids, 0)])
    return kv


def flat(pieces: list[list[int]]) -> list[int]:
    return [t for p in pieces for t in p]


def test_an_entry_of_another_model_under_a_key_is_a_miss(reuser: Reuser, pieces) -> None:
    """A tier shared with another deployment could hold one: keys include the model's fingerprint, the entry says
    which model computed it, and a lookup believes the entry."""
    _, vell, _, _, q2 = pieces
    doc_key = reuser.key(vell, "t")
    entry = reuser.document(vell, "t")[0]
    reuser.store.delete(doc_key)
    reuser.store.put(ChunkKV(doc_key, entry.token_ids, entry.keys, entry.values, model=fingerprint("another model")))
    assert reuser.cached(vell, "t")[1] is False  # computed again, not found
    reuser.store.delete(doc_key)
    reuser.store.put(ChunkKV(doc_key, entry.token_ids, entry.keys, entry.values, model=fingerprint("another model")))
    assert reuser.document(vell, "t")[1] is False
    other = reuser.key(q2, "t")  # never seen by this reuser: only the store could tell its tokens
    reuser.store.put(ChunkKV(other, tuple(q2), entry.keys[:, :, : len(q2)], entry.values[:, :, : len(q2)], model="x"))
    assert reuser.tokens_of(other) is None


def test_a_document_remembered_is_known_by_key_after_its_kv_is_gone(reuser: Reuser, pieces) -> None:
    _, vell, ost, _, _ = pieces
    reuser.document(ost, "t")  # not asked to remember
    assert reuser.known.get(reuser.key(ost, "t")) is None
    reuser.document(vell, "t", remember=True)
    key = reuser.key(vell, "t")
    assert reuser.store.delete(key)
    assert reuser.tokens_of(key) == tuple(vell)


def test_a_document_missing_at_blend_time_is_computed_and_kept_in_its_tenants_scope(reuser: Reuser, pieces) -> None:
    _, vell, _, _, _ = pieces
    entry, found = reuser.cached(vell, "tenant-a")
    assert not found and entry.token_ids == tuple(vell)
    assert reuser.key(vell, "tenant-a") in reuser.store and reuser.key(vell, "") not in reuser.store
    assert reuser.cached(vell, "tenant-a")[1] is True and reuser.cached(vell, "tenant-b")[1] is False
