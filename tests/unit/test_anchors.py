"""The anchor pool alone, on hand-made KV: the mix, the gate, eviction. (The real model's spans,
through the pool, are in test_spans.py.)"""

from __future__ import annotations

import pytest
import torch

from kvgate.agents.anchors import AnchorConfig, AnchorPool, aligned
from kvgate.chunk_cache import ChunkKV

SHAPE = (2, 1, 4)  # layers, kv heads, head dim


def span(key: str, tokens: int, seed: int, scale: float = 1.0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    layers, heads, dim = SHAPE
    keys = scale * torch.randn(layers, heads, tokens, dim, generator=g)
    values = scale * torch.randn(layers, heads, tokens, dim, generator=g)
    return ChunkKV(key, tuple(range(tokens)), keys, values)


def deviation(tokens: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    layers, heads, dim = SHAPE
    return torch.full((layers, heads, tokens, dim), fill), torch.full((layers, heads, tokens, dim), -fill)


def test_the_same_span_gets_back_exactly_the_deviation_it_showed() -> None:
    pool = AnchorPool()
    source = span("a", 5, seed=1)
    keys, values = torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)
    pool.observe("wrote:solver", "checker", source, keys, values)
    got = pool.estimate("wrote:solver", "checker", source)
    assert got is not None
    assert torch.equal(got[0], keys) and torch.equal(got[1], values)


def test_an_estimate_is_for_the_same_slot_and_reader_only() -> None:
    pool = AnchorPool()
    source = span("a", 5, seed=1)
    pool.observe("wrote:solver", "checker", source, *deviation(5, 1.0))
    assert pool.estimate("wrote:solver", "judge", source) is None
    assert pool.estimate("said:solver", "checker", source) is None
    assert pool.stats()["gated"] == 2


def test_nearer_anchors_weigh_more() -> None:
    pool = AnchorPool(AnchorConfig(max_distance=10.0, temperature=0.05))
    near, far = span("near", 4, seed=1), span("far", 4, seed=2, scale=3.0)
    pool.observe("s", "r", near, *deviation(4, 1.0))
    pool.observe("s", "r", far, *deviation(4, -1.0))
    new = ChunkKV("new", near.token_ids, near.keys * 1.01, near.values * 1.01)
    keys, _ = pool.estimate("s", "r", new)
    assert 0.9 < float(keys.mean()) <= 1.0


def test_the_gate_closes_when_no_anchor_is_near() -> None:
    pool = AnchorPool(AnchorConfig(max_distance=0.5))
    pool.observe("s", "r", span("a", 4, seed=1), *deviation(4, 1.0))
    assert pool.estimate("s", "r", span("b", 4, seed=2, scale=5.0)) is None
    assert pool.estimate("s", "r", span("a", 4, seed=1)) is not None


def test_a_longer_span_takes_the_anchors_last_token_past_its_end() -> None:
    dev = torch.arange(3.0).view(1, 1, 3, 1)
    assert aligned(dev, 5).flatten().tolist() == [0, 1, 2, 2, 2]
    assert aligned(dev, 2).flatten().tolist() == [0, 1]


def test_a_full_pool_evicts_its_least_used_anchor() -> None:
    pool = AnchorPool(AnchorConfig(max_anchors=2))
    a, b, c = (span(k, 4, seed=i) for i, k in enumerate("abc"))
    pool.observe("s", "r", a, *deviation(4, 1.0))
    pool.observe("s", "r", b, *deviation(4, 1.0))
    for _ in range(3):
        pool.estimate("s", "r", a)  # a is used; b never is
    pool.observe("s", "r", c, *deviation(4, 1.0))
    assert {anchor.content for anchor in pool.anchors.values()} == {"a", "c"}
    assert pool.stats()["evicted"] == 1 and len(pool) == 2
    # Another reader's deviation of a known span joins its anchor: nothing is evicted.
    pool.observe("s", "judge", a, *deviation(4, 2.0))
    assert len(pool) == 2 and pool.stats()["evicted"] == 1


def test_the_newest_anchors_are_spared_while_older_ones_can_go() -> None:
    """A pool's new anchors have had no chance to be used: a full pool evicts an old one instead,
    however little it was used, so the anchors of one dense prefill do not evict each other."""
    pool = AnchorPool(AnchorConfig(max_anchors=8))
    assert pool.config.grace == 2
    old = [span(f"old{i}", 4, seed=i) for i in range(8)]
    for a in old:
        pool.observe("s", "r", a, *deviation(4, 1.0))
    for a in old:
        pool.estimate("s", "r", a)
    new = [span(f"new{i}", 4, seed=10 + i) for i in range(2)]
    for a in new:
        pool.observe("s", "r", a, *deviation(4, 1.0))
    assert {"new0", "new1"} <= {a.content for a in pool.anchors.values()}
    assert len(pool) == 8 and pool.stats()["evicted"] == 2


def test_the_pool_keeps_to_its_byte_budget() -> None:
    one = 2 * 2 * 4 * 4 * 4  # K and V, [2 layers, 1 head, 4 tokens, 4 dims] of float32
    pool = AnchorPool(AnchorConfig(max_anchors=100, max_bytes=3 * one))
    for i in range(5):
        pool.observe("s", "r", span(str(i), 4, seed=i), *deviation(4, 1.0))
        assert pool.nbytes <= 3 * one
    assert len(pool) == 3 and pool.stats()["evicted"] == 2


def test_a_replaced_source_takes_its_anchors_with_it() -> None:
    pool = AnchorPool()
    a, b = span("a", 4, seed=1), span("b", 4, seed=2)
    pool.observe("s", "r", a, *deviation(4, 1.0))
    pool.observe("t", "r", a, *deviation(4, 1.0))
    pool.observe("s", "r", b, *deviation(4, 1.0))
    pool.forget("a")
    assert {anchor.content for anchor in pool.anchors.values()} == {"b"}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        AnchorConfig(max_anchors=0)
    with pytest.raises(ValueError):
        AnchorConfig(temperature=0)
    with pytest.raises(ValueError):
        AnchorConfig(max_bytes=0)
