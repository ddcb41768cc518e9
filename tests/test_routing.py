"""gateway/routing.py: the consistent-hash ring over runtime workers, and spill-over."""

from __future__ import annotations

from collections import Counter

from kvgate.gateway.routing import Ring

KEYS = [f"text:{i}" for i in range(2000)]


def test_keys_spread_over_the_workers_and_stay_put():
    ring = Ring(["w0", "w1", "w2"])
    spread = Counter(ring.owner(k) for k in KEYS)
    assert set(spread) == {"w0", "w1", "w2"} and min(spread.values()) > len(KEYS) / 3 * 0.6
    assert [Ring(["w0", "w1", "w2"]).owner(k) for k in KEYS] == [ring.owner(k) for k in KEYS]


def test_a_new_worker_takes_keys_only_from_the_others_share():
    before, after = Ring(["w0", "w1", "w2"]), Ring(["w0", "w1", "w2", "w3"])
    moved = [k for k in KEYS if before.owner(k) != after.owner(k)]
    assert all(after.owner(k) == "w3" for k in moved)  # nothing moves between the old workers
    assert len(moved) < len(KEYS) * 0.4


def test_the_worker_holding_most_documents_is_preferred():
    ring = Ring(["w0", "w1"])
    keys = [k for k in KEYS if ring.owner(k) == "w1"][:2] + [k for k in KEYS if ring.owner(k) == "w0"][:1]
    assert ring.preferred(keys) == "w1"
    assert ring.preferred([]) is None


def test_a_busy_worker_spills_to_the_least_loaded():
    ring = Ring(["w0", "w1", "w2"])
    key = next(k for k in KEYS if ring.owner(k) == "w0")
    load = {"w0": 0, "w1": 3, "w2": 1}
    assert ring.order([key], load.__getitem__, spill_at=2) == ["w0", "w2", "w1"]
    load["w0"] = 2
    assert ring.order([key], load.__getitem__, spill_at=2) == ["w2", "w0", "w1"]
    assert ring.order([], load.__getitem__, spill_at=2)[0] == "w2"  # nothing to hold: the least loaded
