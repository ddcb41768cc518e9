"""gateway/settings.py: defaults < YAML file < KVGATE_* environment < flags."""

from __future__ import annotations

import pydantic
import pytest

from kvgate.gateway.settings import Settings


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


def test_upstreams_from_the_file_become_the_proxy_config(tmp_path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "upstreams:\n"
        "  - {base_url: 'http://10.0.0.5:8000/v1/', models: [llama]}\n"
        "  - {name: hosted, base_url: 'https://api.example.com', models: {llama: meta/llama}, api_key: sk-x}\n"
        "proxy_retries: 1\n"
    )
    proxy = Settings.load(config).proxy_config()
    first, hosted = proxy.upstreams
    assert (first.name, first.base_url, first.models) == ("upstream-0", "http://10.0.0.5:8000", {"llama": "llama"})
    assert hosted.model_name("llama") == "meta/llama" and hosted.api_key == "sk-x"
    assert proxy.retries == 1
    with pytest.raises(pydantic.ValidationError):
        Settings(upstreams=[{"models": ["x"]}])  # no base_url


def test_keys_are_required_once_any_are_configured() -> None:
    assert not Settings().keys_required
    assert Settings(api_keys={"sk-a": "a"}).keys_required
    assert not Settings(api_keys={"sk-a": "a"}, require_api_key=False).keys_required
    assert Settings(require_api_key=True).keys_required  # keys created through the admin API only


def test_blend_select_reaches_the_engine_config_and_only_known_ways_are_taken() -> None:
    assert Settings().engine_config().blend_select == "attention"
    assert Settings(blend_select="deviation").engine_config().blend_select == "deviation"
    with pytest.raises(pydantic.ValidationError):
        Settings(blend_select="random")


def test_the_answer_target_of_agent_programs_reaches_the_gate() -> None:
    assert Settings().engine_config().quality.target_answer == 0.9
    assert Settings(fidelity_answer=0.5).engine_config().quality.target_answer == 0.5
    with pytest.raises(pydantic.ValidationError):
        Settings(fidelity_answer=1.5)


def test_kvcomm_anchors_and_programs_in_flight_are_the_engines_own() -> None:
    """The engine builds its anchor pool and its door for programs from its config: nothing sets them on it."""
    assert Settings().engine_config().anchors == Settings().agent_config().anchors
    assert Settings(kvcomm=False).engine_config().anchors is None
    assert Settings(kvcomm_anchors=3).engine_config().anchors.max_anchors == 3
    config = Settings(agent_in_flight=0.5, agent_in_flight_linger_s=9).engine_config()
    assert (config.in_flight, config.in_flight_linger_s) == (0.5, 9)
    assert Settings().engine_config().in_flight == 0.0
