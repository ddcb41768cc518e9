"""runtime/caching.py, runtime/reuse.py: new documents of a tenant's prompt are prefilled in full
(the first answer exact) and their KV kept as that context computed it, for later prompts to reuse."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.planner import Chat, Planner
from kvgate.runtime.rope import shift
from tests.unit.test_quality import DOCS, ask


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    # No prefix blocks: a later prompt over the same documents in the same order would read them exactly,
    # and what is tested here is the documents' own KV, blended at an operator's ratio (uncalibrated, an
    # engine blends only where its shadow checks opened a ratio: tests/server/test_calibrating.py).
    cache_dir = tmp_path_factory.mktemp("in-context")
    engine = Engine(EngineConfig(cache_dir=cache_dir, prefix_caching=False, recompute_ratio=0.15), loaded)
    yield engine
    engine.shutdown()


def test_new_documents_are_prefilled_in_full_and_kept_as_computed_in_context(engine: Engine) -> None:
    planner = Planner(engine.reuser)
    first = ask(engine, planner, "Who kept the lamp?", scope="tenant-a")
    assert first.report.mode == "full" and "documents new to the cache" in str(first.report)
    assert first.report.reused == 0

    # Each document's entry is its rows of the first prompt's KV, keys moved back to position 0.
    documents = [{"text": d} for d in DOCS]
    ask_again = Chat([{"role": "user", "content": "Who kept the lamp?"}], documents=documents, scope="tenant-a")
    ids, plan = planner.chat(ask_again)
    assert plan is not None
    kv = engine.reuser.new_kv()
    forward(engine.model, [Run(kv, ids, 0)])
    offset = len(plan.pieces[0]) + len(plan.pieces[1])  # the second document
    second = plan.pieces[2]
    entry = engine.reuser.store.get(engine.reuser.key(second, "tenant-a"))
    assert entry is not None
    rows = slice(offset, offset + len(second))
    assert torch.allclose(entry.values[7], kv.layer(7)[1][:, rows], atol=1e-5)
    assert torch.allclose(entry.keys[7], shift(engine.model, kv.layer(7)[0][:, rows], -offset), atol=1e-3)

    again = ask(engine, planner, "Where does the ferry dock?", scope="tenant-a")
    assert again.report.mode == "blend" and again.report.reused > 0


def test_without_a_scope_new_documents_are_computed_alone(engine: Engine) -> None:
    """Shared across tenants, KV must not carry another tenant's context: computed alone, blended."""
    first = ask(engine, Planner(engine.reuser), "Who built the lighthouse?")
    assert first.report.mode == "blend" and "new to the cache" not in str(first.report)
