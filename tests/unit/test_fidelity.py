"""Every reuse reports how far it moved the answer (`x-kvgate-fidelity`, `Result.report.fidelity`): the latest
shadow checks of the ratio served, else what calibration measured there, else that nothing measured it.
A reuse of the very KV full prefill computes (an exact prefix, a program's own context) is "exact"."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.bench.gate import ask
from kvgate.runtime.calibration import Calibration, model_fingerprint, save
from kvgate.runtime.calibration import path as calibration_path
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.planner import Planner
from kvgate.runtime.quality import QualityConfig
from kvgate.runtime.reuse_report import Fidelity

DOCS = [
    "The ferry from Calder Bay to Orrin Island leaves at seven each morning and returns at dusk.",
    "Orrin Island's lighthouse was kept by Ada Vell for thirty years; her logbooks are in the harbour museum.",
]
# Targets no check misses: the gate never moves, so every check is of the one rung served.
CHECKED = QualityConfig(shadow_rate=1.0, target_kl=10.0, target_top1=0.0, window=4, min_checks=2)


def fields(fidelity: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in fidelity.split("; "))


@pytest.fixture
def engine(loaded: LoadedModel, tmp_path: Path):
    # Blends at an operator's ratio: an uncalibrated engine's report of the ratio its checks opened is
    # tests/server/test_calibrating.py's.
    made = Engine(
        EngineConfig(cache_dir=tmp_path, quality=CHECKED, recompute_ratio=0.15, blend_select="deviation"), loaded
    )
    yield made
    made.shutdown()


def test_a_blend_reports_the_shadow_checks_of_the_ratio_it_ran(engine: Engine) -> None:
    planner = Planner(engine.reuser)
    first = ask(engine, planner, "When does the ferry leave?", DOCS)
    assert first.report.reused == 0 and first.report.fidelity is None  # documents new to the cache: nothing reused

    window = dict(engine.gate.stats())["blend"]  # the first request's check, done while the engine idled
    assert window["checks"] == 1
    served = ask(engine, planner, "Who kept the lighthouse?", DOCS)
    assert served.report.reused > 0
    assert fields(str(served.report.fidelity)) == {
        "kl": f"{window['window_kl']:.4f}",
        "top1": f"{window['window_top1']:.3f}",
        "answer": f"{window['answer']:.3f}",  # one token answered: whether it was full prefill's
        "ratio": f"{engine.gate.base('blend'):g}",
        "source": "shadow",
        "checks": "1",
    }


def test_a_ratio_the_checks_did_not_measure_reports_calibration_or_nothing(
    engine: Engine, loaded: LoadedModel, tmp_path: Path
) -> None:
    planner = Planner(engine.reuser)
    ask(engine, planner, "When does the ferry leave?", DOCS)  # checked at the gate's rung
    asked = ask(engine, planner, "Where are the logbooks kept?", DOCS, ratio=0.4)  # asked: never checked
    assert asked.report.reused > 0 and asked.report.fidelity == Fidelity("unmeasured", 0.4)

    # A calibration that measured 40% on two documents: an engine that loads it reports its numbers.
    table = {"2": {"0.4": {"kl": 0.0123, "top1": 0.975}}}
    stored = Calibration(0.4, None, 0.05, "kl", 2, table=table)
    save(stored, calibration_path(tmp_path, model_fingerprint(loaded)))
    calibrated = Engine(EngineConfig(cache_dir=tmp_path, quality=QualityConfig(), blend_select="deviation"), loaded)
    try:
        for question in ("When does the ferry leave?", "Who kept the lighthouse?"):
            served = ask(calibrated, Planner(calibrated.reuser), question, DOCS)
        assert served.report.reused > 0 and served.report.fidelity == Fidelity(
            "measured", 0.4, 0.0123, 0.975, source="calibration"
        )
    finally:
        calibrated.shutdown()
