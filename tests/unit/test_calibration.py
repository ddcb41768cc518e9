"""runtime/calibration.py: the stored calibration, its file, and how a ratio is picked."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.calibrate import deviation_limit
from kvgate.runtime.calibration import Calibration, find, load, model_fingerprint, path, pick_ratio, save
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.fidelity import Scores
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.loader import load as load_model
from kvgate.runtime.planner import Planner
from tests.unit.test_families import FAMILIES, saved
from tests.unit.test_quality import ask


def sample() -> Calibration:
    return Calibration(
        ratio=0.15, deviation_limit=0.004, target=0.95, metric="top1", items=8, curve={"0.1": 0.9, "0.15": 0.96}
    )


def test_save_then_load_gives_the_same_calibration(tmp_path: Path) -> None:
    where = path(tmp_path, "ab" * 32)
    assert where == tmp_path / "calibration" / f"{'ab' * 8}.json"
    assert load(where) is None  # none yet
    save(sample(), where)
    assert load(where) == sample()
    save(Calibration(0.3, None, 0.05, "kl", 2, {}), where)  # replaced whole
    assert load(where) == Calibration(0.3, None, 0.05, "kl", 2, {})
    assert [p.name for p in where.parent.iterdir()] == [where.name]  # no temp file left behind
    assert path(tmp_path, "ab" * 32, "attention").name == f"{'ab' * 8}-attention.json"  # beside it, per selection


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"ratio": 0.1}),  # fields missing
        json.dumps({**sample().__dict__, "extra": 1}),
        json.dumps({**sample().__dict__, "ratio": 1.5}),
        json.dumps({**sample().__dict__, "deviation_limit": -1.0}),
        json.dumps({**sample().__dict__, "document_kv": "elsewhere"}),
        "\udcff",
    ],
)
def test_a_damaged_file_counts_as_none_and_is_logged(tmp_path: Path, text: str, caplog) -> None:
    where = path(tmp_path, "cd" * 32)
    where.parent.mkdir(parents=True)
    where.write_bytes(text.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger="kvgate.calibration"):
        assert load(where) is None
    assert "ignoring the calibration" in caplog.text


def test_the_smallest_ratio_meeting_the_target_is_picked() -> None:
    curve = {0.0: 0.7, 0.05: 0.9, 0.1: 0.96, 0.2: 0.95, 0.5: 0.99}
    assert pick_ratio(curve, 0.95, "top1") == (0.1, True)
    assert pick_ratio(curve, 0.995, "top1") == (0.5, False)  # none meets it: the largest, and say so
    kls = {0.0: 0.3, 0.1: 0.08, 0.3: 0.04}
    assert pick_ratio(kls, 0.05, "kl") == (0.3, True)  # for KL, smaller is better
    assert pick_ratio({0.1: float("nan")}, 0.9, "top1") == (0.1, False)
    with pytest.raises(ValueError):
        pick_ratio(curve, 0.9, "rouge")


def test_the_deviation_limit_comes_from_the_chosen_ratio() -> None:
    curve = {0.0: Scores(deviation=[0.0, 0.0]), 0.1: Scores(deviation=[0.002, 0.004]), 0.5: Scores(deviation=[0.003])}
    assert deviation_limit(curve, 0.1) == pytest.approx(1.5 * 0.004)
    # Ratio 0 selects nothing and measures no deviation: the largest seen at any ratio.
    assert deviation_limit(curve, 0.0) == pytest.approx(1.5 * 0.004)
    assert deviation_limit({0.0: Scores(deviation=[0.0])}, 0.0) is None


def test_the_model_fingerprint_is_the_engines(loaded: LoadedModel, engine) -> None:
    fp = model_fingerprint(loaded)
    assert fp == model_fingerprint(loaded) == engine.model_fp and len(fp) == 64


def tiny(where: Path, **config) -> LoadedModel:
    if not (where / "config.json").is_file():
        saved(FAMILIES["llama"], where)
    return load_model(EngineConfig(model=str(where), cache_dir=where.parent / f"cache-{where.name}", **config))


def test_the_model_fingerprint_is_its_content_not_its_path(tmp_path: Path) -> None:
    a = tiny(tmp_path / "a", dtype="float32")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    b = tiny(tmp_path / "b", dtype="float32")  # another path, another cache dir
    fp = model_fingerprint(a)
    assert model_fingerprint(b) == fp == model_fingerprint(replace(a, cache_dir=None))
    save(sample(), path(tmp_path / "cache", fp))  # a calibration made with one copy serves the other
    assert load(path(tmp_path / "cache", model_fingerprint(b))) == sample()

    bf16 = tiny(tmp_path / "a", dtype="bfloat16")
    assert model_fingerprint(bf16) != fp  # KV differs by dtype
    # `auto` is the dtype it picks on this CPU (bfloat16 with AVX512-BF16 or AMX, else float32), not a third one:
    # a table made for that dtype (as kvgate ships one for each) serves a server left at `auto`.
    auto = tiny(tmp_path / "a")
    assert model_fingerprint(auto) == model_fingerprint({"float32": a, "bfloat16": bf16}[auto.dtype])
    a.tokenizer.chat_template = "{{ messages }}"
    assert model_fingerprint(a) != fp  # so do the prompts the template makes


def test_the_model_fingerprint_is_not_the_transformers_version_that_wrote_its_config(tmp_path: Path) -> None:
    """A new transformers release converts the default model to the same weights and writes its own version into
    the config: still the same model, its shipped calibration still its own. Any other field is another model."""
    a = tiny(tmp_path / "a", dtype="float32")
    fp = model_fingerprint(a)
    config = tmp_path / "a" / "config.json"
    written = json.loads(config.read_text())
    config.write_text(json.dumps({**written, "transformers_version": "9.99.0"}, indent=1))
    assert model_fingerprint(a) == fp
    config.write_text(json.dumps({**written, "rms_norm_eps": 1e-3}))
    assert model_fingerprint(a) != fp


def test_weights_are_hashed_once_and_again_when_their_file_changes(tmp_path: Path) -> None:
    loaded = tiny(tmp_path / "m")
    fp = model_fingerprint(loaded)
    weights = (tmp_path / "m" / "model.safetensors").resolve()
    kept = next(
        f
        for f in (tmp_path / "cache-m" / "digests").glob("*.json")
        if json.loads(f.read_text())["path"] == str(weights)
    )
    record = json.loads(kept.read_text())
    assert record["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    # A restart reads the kept hash rather than hashing again: a kept hash changed by hand is followed.
    kept.write_text(json.dumps({**record, "sha256": "0" * 64}))
    assert model_fingerprint(loaded) != fp
    # Any change to the file's stat (here a rewrite of the same bytes) and it is hashed again.
    weights.write_bytes(weights.read_bytes())
    assert model_fingerprint(loaded) == fp


TABLE = {
    "2": {"0.15": {"kl": 0.03, "top1": 0.97}, "0.3": {"kl": 0.01, "top1": 0.99}},
    "6": {"0.15": {"kl": 0.09, "top1": 0.88}, "0.3": {"kl": 0.04, "top1": 0.96}, "0.5": {"kl": 0.02, "top1": 0.97}},
}


def test_the_table_gives_the_cheapest_ratio_meeting_both_targets_per_document_count() -> None:
    cal = replace(sample(), table=TABLE)
    assert cal.ratio_for(1, 0.05, 0.95) == (0.15, "")  # the nearest count at or above: 2
    assert cal.ratio_for(3, 0.05, 0.95) == (0.3, "")  # 6's row
    assert cal.ratio_for(10, 0.05, 0.95) == (0.3, "")  # beyond every count: the largest
    ratio, why = cal.ratio_for(6, 0.01, 0.99)
    assert ratio is None and "for 6 documents" in why and "50%" in why
    assert sample().ratio_for(6, 0.0, 1.0) == (0.15, "")  # no table: the one calibrated ratio


@pytest.mark.parametrize(
    "table", [{"0": {"0.1": {"kl": 0, "top1": 1}}}, {"2": {"1.5": {"kl": 0, "top1": 1}}}, {"2": {"0.1": {}}}, {"2": []}]
)
def test_a_damaged_table_counts_as_none(tmp_path: Path, table) -> None:
    where = path(tmp_path, "ef" * 32)
    where.parent.mkdir(parents=True)
    where.write_text(json.dumps({**sample().__dict__, "table": table}))
    assert load(where) is None


def test_the_engine_serves_what_the_table_says_and_full_prefill_where_nothing_meets(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    from tests.unit.test_quality import DOCS

    save(
        replace(sample(), table={"1": {"0.15": {"kl": 0.2, "top1": 0.5}}, "2": TABLE["2"]}),
        path(tmp_path, model_fingerprint(loaded)),
    )
    engine = Engine(
        EngineConfig(cache_dir=tmp_path, prefix_caching=False, blend_select="deviation"), loaded
    )  # blends: the subject
    try:
        planner = Planner(engine.reuser)
        two = ask(engine, planner, "Who kept the lamp?")  # TABLE's 2 documents: 15% meets the target
        assert two.report.mode == "blend" and "no calibrated" not in str(two.report)
        one = ask(engine, planner, "Who kept the lamp?", DOCS[:1])
        assert one.report.mode == "full" and "no calibrated recompute ratio meets" in str(one.report)
        assert one.report.reused == 0
    finally:
        engine.shutdown()


CALIBRATED = Calibration(ratio=0.37, deviation_limit=1e9, target=0.95, metric="top1", items=8, curve={})


@pytest.mark.parametrize(
    ("stored", "configured", "recomputed"),
    [
        (None, None, None),  # nothing calibrated, no shadow checks to calibrate with: no blend at all
        (None, BlendConfig().ratio, BlendConfig().ratio),  # nothing calibrated, an operator's ratio: run as set
        (CALIBRATED, None, 0.37),  # the stored ratio
        (CALIBRATED, 0.25, 0.25),  # a ratio in the engine's config wins over it
        (replace(CALIBRATED, deviation_limit=0.0), None, 0.5),  # every blend deviates more: redone at max_ratio
    ],
)
def test_the_engine_blends_as_its_stored_calibration_says(
    loaded: LoadedModel,
    tmp_path: Path,
    stored: Calibration | None,
    configured: float | None,
    recomputed: float | None,
) -> None:
    if stored is not None:
        save(stored, path(tmp_path, model_fingerprint(loaded)))
    config = EngineConfig(
        cache_dir=tmp_path, recompute_ratio=configured, prefix_caching=False, blend_select="deviation"
    )
    engine = Engine(config, loaded)
    try:
        planner = Planner(engine.reuser)
        ask(engine, planner, "Who kept the lamp?")  # the documents' KV computed and stored
        blended = ask(engine, planner, "Who kept the lamp?")
        reused = blended.report.reused + blended.report.recomputed  # the documents' tokens, all from the cache
        if recomputed is None:  # computed in full, and the header says why (tests/server/test_calibrating.py: online)
            assert str(blended.report).startswith("full; uncalibrated: no shadow checks") and reused == 0
            return
        assert blended.report.mode == "blend" and reused > 0
        assert blended.report.recomputed == round(recomputed * reused)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("select", "document_kv"), [("deviation", "alone"), ("attention", "context")])
def test_kvgate_ships_the_default_models_calibration(engine, tmp_path: Path, select: str, document_kv: str) -> None:
    """`kvgate calibrate --table-docs 2,4,6` for the default model in float32 is in the package, per way of
    selecting tokens, under the fingerprint a fresh conversion of that model gives (the suite's own): a fresh
    server serves the table of its `caches.blend_select`, until `kvgate calibrate` makes one here, which wins."""
    shipped = find(tmp_path, engine.model_fp, select=select)
    assert shipped is not None and set(shipped.table) == {"2", "4", "6"}, shipped
    assert (shipped.select, shipped.document_kv) == (select, document_kv)
    assert find(tmp_path, engine.model_fp, shipped=False, select=select) is None
    own = replace(shipped, ratio=0.42, table={})
    save(own, path(tmp_path, engine.model_fp, select))
    assert find(tmp_path, engine.model_fp, select=select) == own
    other = "deviation" if select == "attention" else "attention"
    assert find(tmp_path, engine.model_fp, shipped=False, select=other) is None  # saved for one selection only
