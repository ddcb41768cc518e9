"""runtime/prefix.py's Blocks: a prompt's exact KV kept in chained blocks and found again by any later
prompt of the same tenant that begins with the same tokens, down to the token where the two part; never
the last token, never another tenant's, never another model's, never an evicted block; the index bounded."""

from __future__ import annotations

import pytest
import torch

from kvgate.chunk_cache import ChunkKV, ChunkStore, fingerprint
from kvgate.chunk_cache.memory_tier import MemoryTier
from kvgate.runtime.documents import document_ids
from kvgate.runtime.kv import BLOCK
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.prefix import Blocks
from tests.helpers.kv import new_kv, prefilled

TEXTS = (
    "You answer questions about the river towns. Be brief, and say so when you do not know.",
    "Vellmoor lies on the river Ashen; its mayor is Oriel Thatchwood.",
    "Ostford trades in salt and rope, and its ferry stops at night.",
    "Who is the mayor of Vellmoor?",
    "Which town trades in salt?",
)
SIZE = 8  # small blocks: every prompt here spans several


def make(store: ChunkStore | None = None, **kw) -> Blocks:
    return Blocks(store or ChunkStore.from_config(), fingerprint("model"), fingerprint("tokenizer"), size=SIZE, **kw)


@pytest.fixture(scope="module")
def pieces(loaded: LoadedModel) -> list[list[int]]:
    return [document_ids(loaded.tokenizer, t) for t in TEXTS]


def test_a_later_prompt_reads_the_exact_kv_of_the_tokens_it_shares_down_to_the_token(loaded, pieces) -> None:
    head, vell, ost, q1, q2 = pieces
    earlier_ids = head + vell + ost + q1
    earlier = prefilled(loaded, earlier_ids)
    blocks = make()
    assert blocks.keep(earlier, earlier_ids, "t") == len(earlier_ids) - len(earlier_ids) % SIZE
    later_ids = head + vell + ost + q2
    shared = next(i for i, (a, b) in enumerate(zip(earlier_ids, later_ids)) if a != b)
    assert shared % SIZE != 0  # the prompts part inside a block: found all the same
    kv = new_kv(loaded)
    assert blocks.attach(kv, later_ids, "t").tokens == len(kv) == shared
    assert torch.equal(kv.layer(5)[0][:, :shared], earlier.layer(5)[0][:, :shared])
    assert torch.equal(kv.layer(29)[1][:, :shared], earlier.layer(29)[1][:, :shared])
    # What follows, computed over it, is what full prefill computes.
    forward(loaded.model, [Run(kv, later_ids[shared:], shared)])
    truth = prefilled(loaded, later_ids)
    assert torch.allclose(kv.layer(29)[0][:, : len(later_ids)], truth.layer(29)[0][:, : len(later_ids)], atol=1e-4)


def test_a_repeat_reads_all_but_its_last_token(loaded, pieces) -> None:
    ids = [t for p in pieces[:3] for t in p]
    blocks = make()
    blocks.keep(prefilled(loaded, ids), ids, "t")
    assert blocks.attach(new_kv(loaded), ids, "t").tokens == len(ids) - 1  # its logits start the answer
    assert blocks.attach(new_kv(loaded), ids[:20], "t").tokens == 19  # a shorter prompt too
    assert blocks.attach(new_kv(loaded), ids[:1], "t").tokens == 0


def test_a_prompt_finds_only_its_tenants_blocks(loaded, pieces) -> None:
    head, vell, _, q1, q2 = pieces
    blocks = make()
    blocks.keep(prefilled(loaded, head + vell + q1), head + vell + q1, "tenant-a")
    assert blocks.attach(new_kv(loaded), head + vell + q2, "tenant-b").tokens == 0
    assert blocks.attach(new_kv(loaded), head + vell + q2, "").tokens == 0
    assert blocks.attach(new_kv(loaded), head + vell + q2, "tenant-a").tokens >= len(head + vell)
    assert blocks.root("tenant-a") != blocks.root("tenant-b")


def test_a_chain_of_another_namespace_is_apart_in_one_store(loaded, pieces) -> None:
    """A blend's KV is kept as blocks of a namespace of its own (runtime/caching.py): the exact chain never
    reads them, whatever the tenant is called."""
    ids = [t for p in pieces[:3] for t in p]
    store = ChunkStore.from_config()
    exact, blended = make(store), make(store, namespace="blended")
    blended.keep(prefilled(loaded, ids), ids, "t")
    assert exact.attach(new_kv(loaded), ids, "t").tokens == 0
    assert exact.attach(new_kv(loaded), ids, "blended:t").tokens == 0
    assert blended.attach(new_kv(loaded), ids, "t").tokens == len(ids) - 1
    assert exact.root("blended:t") != blended.root("t") and exact.root("ed:t") != blended.root("t")


def test_a_prompt_that_differs_early_finds_nothing_after(loaded, pieces) -> None:
    head, vell, ost, q1, _ = pieces
    blocks = make()
    blocks.keep(prefilled(loaded, head + vell + q1), head + vell + q1, "t")
    # Documents begin alike ("<document>"): what they share is found, not a token more.
    assert blocks.attach(new_kv(loaded), vell + head + q1, "t").tokens == common(head, vell) < SIZE
    # Same tokens later, another token first: a block names its whole context, so none is found.
    assert blocks.attach(new_kv(loaded), [head[1]] + head[1:] + vell + q1, "t").tokens == 0
    assert blocks.attach(new_kv(loaded), head + ost + q1, "t").tokens == common(head + vell, head + ost)


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_an_evicted_block_ends_the_chain_and_is_forgotten(loaded, pieces) -> None:
    head, vell, _, q1, q2 = pieces
    ids = head + vell + q1
    blocks = make()
    blocks.keep(prefilled(loaded, ids), ids, "t")
    second = blocks.key(blocks.key(blocks.root("t"), tuple(ids[:SIZE]), "t"), tuple(ids[SIZE : 2 * SIZE]), "t")
    assert blocks.store.delete(second)
    assert blocks.attach(new_kv(loaded), head + vell + q2, "t").tokens == SIZE  # only the first block is left
    parent = blocks.key(blocks.root("t"), tuple(ids[:SIZE]), "t")
    assert second not in blocks.children.get(parent, {})  # the way to it is gone too


def test_a_block_of_another_model_under_its_key_is_a_miss(loaded, pieces) -> None:
    """A tier shared with another deployment could hold one: the entry says which model computed it."""
    head, vell, _, q1, _ = pieces
    ids = head + vell + q1
    blocks = make()
    blocks.keep(prefilled(loaded, ids), ids, "t")
    key = blocks.key(blocks.root("t"), tuple(ids[:SIZE]), "t")
    real = blocks.store.get(key, blocks.model_fp)
    assert real is not None
    blocks.store.delete(key)
    blocks.store.put(ChunkKV(key, real.token_ids, real.keys, real.values, model=fingerprint("another model")))
    assert blocks.attach(new_kv(loaded), ids, "t").tokens == 0


def test_blocks_are_evicted_by_value_within_the_tiers_budget(loaded, pieces) -> None:
    ids = [t for p in pieces for t in p]
    kv = prefilled(loaded, ids)
    block_bytes = 2 * kv.num_layers * kv.kv_heads * kv.head_dim * SIZE * 4
    store = ChunkStore([MemoryTier(3 * block_bytes)])
    blocks = make(store)
    blocks.keep(kv, ids, "t")
    assert store.tiers[0].nbytes <= 3 * block_bytes and len(store.tiers[0]) == 3
    assert blocks.attach(new_kv(loaded), ids, "t").tokens < 3 * SIZE  # the chain broke where blocks went


def test_the_index_of_branches_is_bounded(loaded, pieces) -> None:
    blocks = make(max_branches=5)
    for i, p in enumerate(pieces):
        ids = [i] + p
        blocks.keep(prefilled(loaded, ids), ids, "t")
        assert blocks.branches <= 5 and sum(map(len, blocks.children.values())) == blocks.branches
    last = [4] + pieces[4]
    assert blocks.attach(new_kv(loaded), last, "t").tokens == len(last) - 1  # the latest are kept


def test_keep_stores_only_from_where_it_left_off(loaded, pieces) -> None:
    ids = [t for p in pieces[:3] for t in p]
    kv = prefilled(loaded, ids)
    blocks = make()
    start = blocks.keep(kv, ids[:30], "t")
    assert start == 24
    puts = blocks.store.tiers[0].stats()["puts"]
    blocks.keep(kv, ids, "t", start)
    assert blocks.store.tiers[0].stats()["puts"] - puts == -(-(len(ids) - 24) // SIZE)
    assert blocks.attach(new_kv(loaded), ids, "t").tokens == len(ids) - 1


def test_whole_stored_blocks_are_read_by_reference_and_never_written_through(loaded, pieces) -> None:
    """Blocks of the KV's own size (runtime/kv.py BLOCK): a later prompt's cache holds the stored tensors
    themselves, no copy; a write there copies the block first, the stored one unchanged."""
    ids = [t for _ in range(3) for p in pieces for t in p]
    assert len(ids) > 2 * BLOCK
    blocks = Blocks(ChunkStore.from_config(), fingerprint("model"), fingerprint("tokenizer"))
    blocks.keep(prefilled(loaded, ids), ids, "t")
    first = blocks.store.get(blocks.key(blocks.root("t"), tuple(ids[:BLOCK]), "t"), fingerprint("model"))
    assert first is not None
    kv = new_kv(loaded)
    blocks.attach(kv, ids, "t")
    assert kv.blocks[0].keys.data_ptr() == first.keys.data_ptr() and not kv.blocks[0].own
    stored = first.keys.clone()
    kv.truncate(BLOCK // 2)
    forward(loaded.model, [Run(kv, ids[BLOCK // 2 : BLOCK + 3], BLOCK // 2)])
    assert torch.equal(first.keys, stored) and kv.blocks[0].keys.data_ptr() != first.keys.data_ptr()
