"""The developer's own cache (~/.cache/kvgate: a calibration `kvgate calibrate` stored, a semantic cache,
document KV) changes nothing the tests see, in this process or in one it starts: tests/conftest.py points
KVGATE_CACHE_DIR at a cache of the run's own, the converted model linked from the developer's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.chunk_cache import ChunkCacheConfig
from kvgate.gateway.settings import Settings, user_cache_dir
from kvgate.runtime.calibration import Calibration, model_fingerprint, save
from kvgate.runtime.calibration import load as load_calibration
from kvgate.runtime.calibration import path as calibration_path
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import LoadedModel

CACHE_DIR_OF_A_STARTED_PROCESS = "from kvgate.gateway.settings import Settings; print(Settings().cache_dir)"


def test_settings_built_anywhere_use_the_runs_cache_and_the_developers_converted_model(settings: Settings) -> None:
    run = Settings().cache_dir
    assert settings.cache_dir == run  # the session's settings say nothing of it
    # Configs built without settings read no KVGATE_* variable: they land in the user's cache, the run's here.
    assert EngineConfig().cache_dir == run == user_cache_dir() and ChunkCacheConfig().disk_dir == run / "chunks"
    models = run / "models"
    assert models.is_symlink() and not models.resolve().is_relative_to(run)  # the developer's, linked


def test_a_calibration_in_the_developers_cache_is_served_neither_here_nor_in_a_started_process(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a developer's cache of this test's own
    model_fp = model_fingerprint(loaded)
    stored = calibration_path(user_cache_dir(), model_fp)
    save(Calibration(ratio=0.5, deviation_limit=None, target=0.5, metric="top1", items=1), stored)
    assert load_calibration(stored) is not None  # as `kvgate calibrate` leaves it: an engine there serves 50%
    engine = Engine(Settings().engine_config(), loaded)
    try:
        assert engine.calibration is None
    finally:
        engine.shutdown()
    started = subprocess.run([sys.executable, "-c", CACHE_DIR_OF_A_STARTED_PROCESS], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    theirs = Path(started.stdout.strip())
    assert theirs == Settings().cache_dir != user_cache_dir()
    assert load_calibration(calibration_path(theirs, model_fp)) is None


def test_only_the_settings_read_kvgates_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    assert Settings().cache_dir == tmp_path
    assert EngineConfig().cache_dir == user_cache_dir() != tmp_path  # one default, the configs' own
    assert ChunkCacheConfig().disk_dir == user_cache_dir() / "chunks"
