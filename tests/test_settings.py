"""gateway/settings.py: defaults < YAML file < KVGATE_* environment < flags."""

from __future__ import annotations

import pydantic
import pytest

from gateway.settings import Settings


def test_precedence(tmp_path, monkeypatch) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("port: 9001\nmax_num_seqs: 3\nhost: 0.0.0.0\n")
    monkeypatch.setenv("KVGATE_MAX_NUM_SEQS", "5")
    s = Settings.load(config, host="127.0.0.2", port=None)
    assert s.port == 9001  # from the file
    assert s.max_num_seqs == 5  # the environment beats the file
    assert s.host == "127.0.0.2"  # a flag beats both
    assert s.engine_config().max_num_seqs == 5


def test_config_file_from_environment(tmp_path, monkeypatch) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("served_model_name: tiny\n")
    monkeypatch.setenv("KVGATE_CONFIG", str(config))
    assert Settings.load().served_model_name == "tiny"


def test_bad_values_are_refused(tmp_path) -> None:
    typo = tmp_path / "typo.yaml"
    typo.write_text("max_num_seq: 3\n")
    with pytest.raises(pydantic.ValidationError):
        Settings.load(typo)
    with pytest.raises(pydantic.ValidationError):
        Settings.load(port=70000)
