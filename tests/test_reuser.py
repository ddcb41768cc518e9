"""runtime/reuse.py's Reuser: exact prefix KV (`store_prefix`, `attach_prefix`) kept findable at each piece
boundary, per tenant, within a bound, and only the very KV full prefill computes ever attached; the model check
every lookup makes; a document's tokens remembered past its KV."""

from __future__ import annotations

import pytest
import torch

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


def test_the_longest_stored_prefix_is_attached_up_to_the_last_boundary(reuser: Reuser, pieces) -> None:
    head, vell, ost, q1, q2 = pieces
    earlier = prefilled(reuser, flat([head, vell, ost, q1]))
    reuser.store_prefix(earlier, [head, vell, ost, q1], "t")
    n = len(head) + len(vell) + len(ost)
    kv = reuser.new_kv()
    assert reuser.attach_prefix(kv, [head, vell, ost, q2], "t") == len(kv) == n  # all but the last piece
    assert torch.equal(kv.keys[5][:, :n], earlier.keys[5][:, :n])
    assert torch.equal(kv.values[0][:, :n], earlier.values[0][:, :n])
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, q2], "t") == len(head) + len(vell)  # an earlier boundary
    assert reuser.attach_prefix(reuser.new_kv(), [head, ost, vell, q2], "t") == len(head)
    assert reuser.attach_prefix(reuser.new_kv(), [vell, head, q2], "t") == 0
    # Never the whole prompt: the last token's logits have to be computed.
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, ost], "t") == len(head) + len(vell)


def test_a_prefix_is_its_tenants_only(reuser: Reuser, pieces) -> None:
    head, vell, _, q1, q2 = pieces
    reuser.store_prefix(prefilled(reuser, flat([head, vell, q1])), [head, vell, q1], "tenant-a")
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, q2], "tenant-b") == 0
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, q2], "") == 0
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, q2], "tenant-a") == len(head) + len(vell)
    # Stored under the tenant's prefix key: apart from its documents' keys and from every other tenant's.
    assert reuser.key(head + vell, "prefix:tenant-a") in reuser.store
    assert reuser.key(head + vell, "prefix:tenant-b") not in reuser.store
    assert reuser.key(head + vell, "tenant-a") not in reuser.store


def test_nothing_is_stored_without_a_prefix_or_without_its_kv(reuser: Reuser, pieces) -> None:
    head, vell, ost, q1, _ = pieces
    reuser.store_prefix(prefilled(reuser, flat([head, q1])), [flat([head, q1])], "t")  # one piece: no prefix
    reuser.store_prefix(prefilled(reuser, head), [head, vell, q1], "t")  # a KV shorter than the prefix
    assert len(reuser.prefixes) == 0 and len(reuser.store.tiers[0]) == 0
    exact = prefilled(reuser, flat([head, vell, ost]))  # exactly the prefix of [head, vell, ost, q1]: enough
    reuser.store_prefix(exact, [head, vell, ost, q1], "t")
    assert reuser.key(flat([head, vell, ost]), "prefix:t") in reuser.store and len(reuser.prefixes) == 3


def test_an_evicted_prefix_is_forgotten_and_never_attached(reuser: Reuser, pieces) -> None:
    head, vell, _, q1, q2 = pieces
    reuser.store_prefix(prefilled(reuser, flat([head, vell, q1])), [head, vell, q1], "t")
    for _ in range(2):  # found, and found again: a hit keeps the way to it
        assert reuser.attach_prefix(reuser.new_kv(), [head, vell, q2], "t") == len(head) + len(vell)
    assert reuser.store.delete(reuser.key(head + vell, "prefix:t"))
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, q2], "t") == 0
    assert reuser.key(head + vell, "prefix:t") not in reuser.prefixes  # the way to the evicted entry is gone too


def test_an_entry_of_another_model_under_a_key_is_a_miss(reuser: Reuser, pieces) -> None:
    """A tier shared with another deployment could hold one: keys include the model's fingerprint, the entry says
    which model computed it, and a lookup believes the entry."""
    head, vell, _, q1, q2 = pieces
    reuser.store_prefix(prefilled(reuser, flat([head, vell, q1])), [head, vell, q1], "t")
    key = reuser.key(head + vell, "prefix:t")
    real = reuser.store.get(key, reuser.model_fp)
    assert real is not None
    forged = ChunkKV(key, real.token_ids, real.keys, real.values, model=fingerprint("another model"))
    reuser.store.delete(key)
    reuser.store.put(forged)
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, q2], "t") == 0

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


def test_the_prefix_map_keeps_the_latest_boundaries_within_its_bound(loaded: LoadedModel, pieces) -> None:
    reuser = make(loaded, max_prefixes=3)
    head, vell, ost, q1, q2 = pieces
    reuser.store_prefix(prefilled(reuser, flat([head, vell, ost, q1])), [head, vell, ost, q1], "t")  # 3 boundaries
    reuser.store_prefix(prefilled(reuser, flat([q2, ost, q1])), [q2, ost, q1], "t")  # 2 more, the latest
    assert len(reuser.prefixes) == 3
    assert reuser.attach_prefix(reuser.new_kv(), [q2, ost, head], "t") == len(q2) + len(ost)
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, ost, q2], "t") == len(head) + len(vell) + len(ost)
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, q2], "t") == 0  # the oldest boundaries went first
    # Stored again, a prompt's boundaries are the latest: the other prompt's two go.
    reuser.store_prefix(prefilled(reuser, flat([head, vell, ost, q1])), [head, vell, ost, q1], "t")
    assert reuser.attach_prefix(reuser.new_kv(), [head, vell, ost, q2], "t") == len(head) + len(vell) + len(ost)
    assert reuser.attach_prefix(reuser.new_kv(), [q2, ost, head], "t") == 0


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
