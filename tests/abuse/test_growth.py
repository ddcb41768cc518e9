"""What callers can grow has a bound: the programs remembered, tool durations learnt per tenant,
the documents' tokens kept to recompute them, the exact-prefix boundaries found again."""

from __future__ import annotations

import torch

from kvgate.agents import AgentConfig, PinPolicy, Programs
from kvgate.agents.predictor import ANY, Predictor
from kvgate.chunk_cache import ChunkStore, MemoryTier
from kvgate.runtime.engine import Engine
from kvgate.runtime.prefix import Blocks
from kvgate.runtime.reuse import Remembered
from tests.unit.test_chunk_cache import Clock
from tests.unit.test_programs import CALL, RESULT, FixedCosts, keep


def test_programs_past_the_bound_are_forgotten_oldest_first_and_their_pins_released() -> None:
    clock = Clock()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)])
    config = AgentConfig(pins=PinPolicy("fixed", fixed_ttl_s=60.0), max_programs=3)
    programs = Programs(config, store, FixedCosts(), clock=clock)
    first = programs.begin("p0", "t", [{"role": "user", "content": "go"}], 10)
    keep(store, first, 10, clock.now)
    programs.end("t", first)
    assert programs.stats()["pinned"] == 1
    for i in range(1, 6):  # a caller naming a new program each request
        programs.begin(f"p{i}", "t", [{"role": "user", "content": "go"}], 10)
    assert len(programs.programs) == 3 and ("t", "p0") not in programs.programs
    programs.expire()
    assert store.tiers[0].stats()["pinned"] == 0  # its pin went with it


def test_tool_durations_are_kept_per_tenant_for_a_bounded_number_of_tenants_and_tools() -> None:
    clock = Clock()
    store = ChunkStore([MemoryTier(budget_bytes=1 << 20, clock=clock)])
    programs = Programs(AgentConfig(max_tenants=4), store, FixedCosts(), clock=clock)
    for tenant in range(10):
        turn = programs.begin("p", f"t{tenant}", [{"role": "user", "content": "go"}], 10)
        programs.end(f"t{tenant}", turn)
        clock.now += 1.0
        programs.begin("p", f"t{tenant}", [CALL, RESULT], 10)
    assert len(programs.predictors) == 4 and programs.stats()["tenants_predicted"] == 4

    predictor = Predictor(max_tools=8)
    for i in range(100):
        predictor.observe([f"tool-{i}"], 1.0)
        predictor.called((f"tool-{i}",), (f"tool-{i + 1}",))
    assert len(predictor.tools) <= 9 and ANY in predictor.tools  # the pooled guess is never evicted
    assert len(predictor.follows) <= 8
    assert predictor.observed("tool-99") == 1 and predictor.observed("tool-0") == 0


def test_documents_tokens_are_remembered_up_to_a_token_budget() -> None:
    remembered = Remembered(capacity=1000)
    for i in range(50):
        remembered.add(f"doc-{i}", list(range(i, i + 100)))
    assert remembered.tokens <= 1000 and len(remembered) == 10
    assert remembered.get("doc-49") == tuple(range(49, 149)) and remembered.get("doc-0") is None
    remembered.add("huge", list(range(5000)))  # larger than the whole budget: not kept, nothing evicted
    assert remembered.get("huge") is None and len(remembered) == 10
    assert remembered.pop("doc-49") and remembered.tokens == 900


def test_prefix_blocks_branches_are_bounded(engine: Engine) -> None:
    """Forty tenants' prompts: the index of stored branches keeps its bound (the entries themselves are
    the chunk store's, within its byte budget)."""
    blocks = Blocks(engine.reuser.store, engine.model_fp, engine.reuser.tokenizer_fp, size=4, max_branches=16)
    kv = engine.reuser.new_kv()
    rows = torch.zeros(kv.num_layers, kv.kv_heads, 7, kv.head_dim)
    kv.extend(rows, rows)
    for i in range(40):
        blocks.keep(kv, [1, 2, 3, 100 + i, 5, 6, 7], tenant=f"growth-{i}")
        assert blocks.branches <= 16
