"""A model with no calibration table (another dtype than the one kvgate ships a table for, another model)
never blends at a ratio nothing measured: it reads what it can read exactly, prefills the rest, and
calibrates online from shadow checks (the blend it would serve, computed on spare capacity and compared
with the full prefill it served), opening the lowest ratio whose checks meet the targets; `/ready`,
`/metrics` and `x-kvgate-reuse` say where it stands. A ratio a client asks for is run as asked."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import openai
import pytest

from kvgate.bench.gate import ask
from kvgate.runtime.calibration import find, model_fingerprint
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.planner import Planner
from kvgate.runtime.quality import FULL, STATES, QualityConfig, QualityGate, Standing, shape_key
from kvgate.runtime.reuse_report import Fidelity
from tests.helpers import loopback
from tests.helpers.corpus import musique_rows
from tests.helpers.servers import serving
from tests.helpers.waiting import wait_until
from tests.server.test_metrics import scrape, value
from tests.unit.test_quality import DOCS

CONFIG = QualityConfig(shadow_rate=0.25, window=4, min_checks=2, ratios=(0.3, 0.5))
GOOD, BAD = (0.001, True), (0.4, False)


def online(config: QualityConfig = CONFIG) -> QualityGate:
    """The gate of an engine with no calibration: its blends are calibrated online (runtime/caching.py)."""
    return QualityGate(config, {"blend": 0.15, "kvcomm": 0.0}, online={"blend"})


def test_an_uncalibrated_blend_is_full_prefill_until_its_checks_open_the_lowest_ratio() -> None:
    gate = online()
    assert gate.serve("blend") == (FULL, "uncalibrated: calibrating online (0/2 shadow checks of a 15% blend)")
    assert gate.calibrating("blend") == gate.probe("blend") == 0.15  # the checks compute the blend withheld
    assert [gate.due("blend") for _ in range(4)] == [True, True, False, False]  # each request to min_checks, then 25%
    gate.record("blend", 0.15, *GOOD)
    note = "uncalibrated: calibrating online (1/2 shadow checks of a 15% blend)"
    assert gate.standing("blend") == Standing("calibrating", probe=0.15, checks=1, needed=2, note=note)
    gate.record("blend", 0.15, *GOOD)
    assert gate.serve("blend") == (0.15, "") and gate.calibrating("blend") is None
    assert gate.measured("blend", 0.15) == (0.001, 1.0, None, 2)  # its fidelity: the checks that opened it
    assert gate.standing("blend") == Standing("shadow", ratio=0.15, checks=2, needed=2)
    assert gate.serve("kvcomm") == (0.0, "") and gate.standing("kvcomm") is None  # a calibrated mode as before


def test_a_ratio_whose_checks_miss_passes_the_probe_up_and_no_ratio_is_served_unmeasured() -> None:
    gate = online()
    gate.record("blend", 0.15, *BAD)  # no perfect check to come could bring 15% within the targets
    ratio, why = gate.serve("blend")
    assert ratio == FULL and why.startswith("uncalibrated: calibrating online (0/2 shadow checks of a 30% blend; ")
    assert "over the last 1 shadow checks at 15% recompute" in why
    assert gate.due("blend")  # the new ratio's checks come at every request again
    gate.record("blend", 0.3, *GOOD)
    gate.record("blend", 0.15, *GOOD)  # a check of the ratio left: the totals only
    assert gate.serve("blend")[0] == FULL
    gate.record("blend", 0.3, *GOOD)
    assert gate.serve("blend") == (0.3, "")
    for _ in range(3 * CONFIG.window):  # never down to 15%, which no check met (a calibrated ladder steps down)
        gate.record("blend", 0.3, *GOOD)
    assert gate.serve("blend") == (0.3, "")
    gate.record("blend", 0.3, *BAD)  # mean KL over the window (3 x 0.001 + 0.4) / 4: over 0.05
    ratio, why = gate.serve("blend")
    assert ratio == FULL and gate.probe("blend") == 0.5 and "of a 50% blend; first-token KL 0.101" in why
    gate.record("blend", 0.5, *BAD)
    standing = gate.standing("blend")
    assert standing is not None and standing.state == "unmet" and not standing.calibrated and standing.probe == 0.5
    ratio, why = gate.serve("blend")
    assert ratio == FULL and why.startswith("uncalibrated: no recompute ratio up to 50% met the fidelity target")
    assert [gate.due("blend") for _ in range(4)] == [False, False, False, True]  # checked on, at the rate
    for _ in range(CONFIG.min_checks):  # checks that meet the targets later open the largest
        gate.record("blend", 0.5, *GOOD)
    assert gate.serve("blend") == (0.5, "")


def test_with_no_shadow_checks_an_uncalibrated_blend_is_never_served_and_says_so() -> None:
    unchecked = replace(CONFIG, shadow_rate=0.0)
    gate = online(unchecked)
    ratio, why = gate.serve("blend")
    assert ratio == FULL and "no shadow checks to calibrate online (quality.shadow_rate 0)" in why
    standing = gate.standing("blend")
    assert standing is not None and standing.state == "off" and not any(gate.due("blend") for _ in range(10))
    shape = shape_key("blend", "agent-critic")  # chunks found in an agent's prompt: withheld too
    ratio, why = gate.serve(shape)
    assert ratio == FULL and "no shadow checks" in why
    assert QualityGate(unchecked, {"blend": 0.15}).serve(shape) == (0.15, "")  # a calibrated mode's shapes: as before


def test_kvgate_ships_the_default_models_table_in_bfloat16_too(settings, tmp_path) -> None:
    """`dtype: auto` picks bfloat16 on a CPU with AVX512-BF16 or AMX and on GPUs, and a table is per fingerprint
    (dtype included): the default model's bfloat16 one ships beside float32's (tests/unit/test_calibration.py), for
    the server's selection and documents' KV, so a fresh server there starts calibrated too."""
    bf16 = load(replace(settings.engine_config(), dtype="bfloat16"))  # loaded in bf16 on any CPU: no forward pass
    assert str(bf16.model.dtype) == "torch.bfloat16"
    shipped = find(tmp_path, model_fingerprint(bf16), select=settings.caches.blend_select)
    assert shipped is not None and set(shipped.table) == {"2", "4", "6"}, shipped
    assert (shipped.select, shipped.document_kv) == (settings.caches.blend_select, "context")


# ---- on a real engine, and a real server ----------------------------------------------------------


@pytest.fixture(scope="module")
def strict(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Planner]]:
    # No table in the run's cache, no operator's ratio: calibrated online, against a KL no blend meets. No
    # prefix blocks: each request's documents are a blend's to reuse, whatever order came before.
    quality = QualityConfig(shadow_rate=1.0, target_kl=1e-6, window=4, min_checks=2, ratios=(0.5,))
    config = EngineConfig(
        cache_dir=tmp_path_factory.mktemp("strict"), quality=quality, prefix_caching=False, blend_select="deviation"
    )
    engine = Engine(config, loaded)
    yield engine, Planner(engine.reuser)
    engine.shutdown()


def test_checks_that_miss_keep_an_uncalibrated_engine_from_blending(strict) -> None:
    engine, planner = strict
    assert engine.calibration is None and engine.caches.standing().state == "calibrating"
    served = [ask(engine, planner, f"Question {i}: who kept the lamp?", DOCS[:: 1 - 2 * (i % 2)]) for i in range(3)]
    assert [str(r.report).split(" (")[0] for r in served] == [
        "full; uncalibrated: calibrating online",
        "full; uncalibrated: calibrating online",  # of a 50% blend: 15% missed
        "full; uncalibrated: no recompute ratio up to 50% met the fidelity target in shadow checks",
    ]
    assert "of a 50% blend; first-token KL" in str(served[1].report)
    assert all(r.report.reused == r.report.recomputed == 0 and r.report.fidelity is None for r in served)
    assert dict(engine.gate.stats())["blend"]["checks"] == 3  # each compared the blend with the full prefill served
    assert engine.caches.standing().state == "unmet"
    asked = ask(engine, planner, "Who kept the lamp, again?", DOCS, ratio=0.3)  # a ratio asked: run as asked
    assert (
        asked.report.mode == "blend"
        and not asked.report.notes
        and asked.report.reused > 0
        and asked.report.fidelity == Fidelity("unmeasured", 0.3)
    )
    due = engine.gate.due_count
    tiny = ask(engine, planner, "Hi?", ["Tiny."])  # a blend slower than full prefill would open nothing: unchecked
    assert str(tiny.report).startswith("full; reuse would be slower than full prefill") and engine.gate.due_count == due


SYSTEM = (  # over one prefix block (64 tokens): what a reordered prompt can read exactly
    "You answer questions about the islands of the northern sea from the context the user pastes. Quote the "
    "context where you can, name the passage you used, and say so plainly when the context does not hold the "
    "answer. Keep every answer to one or two short sentences, with no preamble and no list."
)


@pytest.fixture(scope="module")
def fresh(settings, loaded: LoadedModel) -> Iterator[tuple[str, Engine]]:
    """A server as a fresh one with no table for its model: prefix blocks and content chunks on, no operator's
    ratio (the suite's servers have one: tests/conftest.py); each blend it would serve checked, against targets
    a sound blend of these passages meets (KL 10, top-1 0: every check meets them)."""
    caches = {"prefix_caching": True, "content_chunks": True, "recompute_ratio": None}
    quality = {"shadow_rate": 1.0, "kl": 10.0, "top1": 0.0, "min_checks": 2, "window": 4}
    ours = settings.model_copy(update={"caches": caches, "quality": quality})
    engine = Engine(ours.engine_config(), loaded)
    try:
        with serving(ours, engine) as url:
            yield url, engine
    finally:
        engine.shutdown()


def pasted(docs: list[str], question: str) -> list[dict[str, str]]:
    """Passages pasted into the prompt, as DSPy's and LangChain's RAG prompts have them."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Context:\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}"},
    ]


def calibration(url: str, model: str) -> tuple[dict, str]:
    """What /ready says of the calibration, and the state /metrics says it is in."""
    samples = scrape(url)
    states = [s for s in STATES if value(samples, "kvgate_blend_calibration", model=model, state=s) == 1.0]
    assert len(states) == 1, states
    checks = value(samples, "kvgate_blend_calibration_checks", model=model)
    ready = loopback.get(url + "/ready").json()["calibration"]
    assert ready["checks"] == checks
    return ready, states[0]


def test_a_fresh_server_with_no_table_prefills_moved_passages_in_full_until_its_checks_open_a_ratio(fresh) -> None:
    url, engine = fresh
    model_name = engine.loaded.name
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    row = musique_rows(1, seed=307)[0]
    docs = [" ".join(str(p).split()[:50]) for p in row["passages"][:3]]
    ready, state = calibration(url, model_name)
    assert state == "calibrating" and ready == {
        "calibrated": False,
        "state": "calibrating",
        "ratio": None,
        "probe": 0.15,
        "checks": 0,
        "needed": 2,
        "note": "uncalibrated: calibrating online (0/2 shadow checks of a 15% blend)",
    }

    def chat(order: tuple[int, ...]) -> openai.types.chat.ChatCompletion:
        raw = client.chat.completions.with_raw_response.create(
            model=model_name, messages=pasted([docs[i] for i in order], str(row["question"])), max_tokens=2
        )
        wait_until(lambda: not engine.shadow.busy, 60, "the request's shadow check")
        return raw

    chat((0, 1, 2))  # the passages' chunks are new: computed, and kept
    for n, order in enumerate([(2, 1, 0), (1, 2, 0)]):  # found by content, moved: a blend is what reuse would be
        raw = chat(order)
        how = raw.headers["x-kvgate-reuse"]
        assert "chunks found by content" in how, how
        assert how.endswith(f"uncalibrated: calibrating online ({n}/2 shadow checks of a 15% blend)"), how
        assert int(raw.headers["x-kvgate-recomputed-tokens"]) == 0  # no blend ran
        assert int(raw.headers["x-kvgate-reused-tokens"]) >= 64  # what it reads exactly: the system prompt's blocks
        assert raw.headers["x-kvgate-fidelity"] == "exact"
    ready, state = calibration(url, model_name)
    assert state == "shadow" and ready["calibrated"] and ready["ratio"] == 0.15 and ready["checks"] == 2

    raw = chat((0, 2, 1))  # the ratio the checks opened: blended, its fidelity from those checks
    how, fidelity = raw.headers["x-kvgate-reuse"], raw.headers["x-kvgate-fidelity"]
    assert how.startswith("blend") and "chunks found by content" in how and "uncalibrated" not in how, how
    assert int(raw.headers["x-kvgate-recomputed-tokens"]) > 0
    assert fidelity.endswith("; ratio=0.15; source=shadow; checks=2"), fidelity
