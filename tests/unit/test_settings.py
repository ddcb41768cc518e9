"""gateway/settings.py: defaults < YAML file < KVGATE_* environment < flags, in groups (engine, caches, ...);
the flat names of before still accepted, each with one deprecation line."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pydantic
import pytest

from kvgate.agents.config import AnchorConfig
from kvgate.gateway import settings_flat
from kvgate.gateway.settings import FLAT, GROUPS, Settings

# Every setting's name before the groups: a user's file or environment that used them keeps working.
BEFORE = """host port model served_model_name cache_dir dtype device max_model_len max_num_seqs max_num_batched_tokens
threads chunk_cache_bytes chunk_cache_dir chunk_cache_disk_bytes redis_url chunk_cache_redis_bytes
chunk_cache_disk_codec chunk_cache_redis_codec chunk_cache_lmcache_bytes recompute_ratio shipped_calibration
repeated_tool_calls blend_select max_body_bytes semantic_cache semantic_cache_path semantic_categories
semantic_guards semantic_embedder semantic_relax_step semantic_queue_long semantic_verifier semantic_verify_rate
semantic_verify_beside semantic_race semantic_answer_similarity chunk_cache_policy agent_pins agent_fixed_ttl_s
agent_max_ttl_s agent_memory_weight agent_tool_prior_s agent_in_flight agent_in_flight_linger_s
agent_implicit_programs agent_conversations kvcomm kvcomm_anchors kvcomm_anchor_bytes kvcomm_max_distance
kvcomm_temperature kvcomm_recompute_ratio queue_order documents_in_context prefix_caching prefix_block
content_chunks content_chunk_tokens content_chunks_per_tenant content_chunks_max shadow_rate shadow_share
fidelity_kl fidelity_top1 fidelity_answer gate_window gate_min_checks gate_ratios api_keys require_api_key
rate_limit_rpm rate_limit_tpm tenant_scoped_kv tenant_secret admin_key upstreams workers proxy_retries
proxy_backoff_s proxy_connect_timeout_s proxy_first_byte_timeout_s proxy_read_timeout_s spill_at
replica_load_poll_s routing route_conversations route_ttl_s log_level max_request_seqs max_waiting_seqs
max_waiting_seqs_per_tenant semantic_scopes proxy_max_response_bytes trusted_proxies metrics_access openapi_docs
shutdown_grace_s worker_secret exit_with_pid deterministic tracing decode_batch""".split()


@pytest.fixture
def quiet(monkeypatch) -> Iterator[None]:
    """No KVGATE_* of the run (the suite's cache and dtype), and the names told here are this test's alone: none
    told before it, and none left for the next (tests/conftest.py's `grouped_names` reads the record)."""
    for name in [n for n in os.environ if n.startswith("KVGATE_")]:
        monkeypatch.delenv(name)
    before = set(settings_flat.noticed)
    settings_flat.noticed.clear()
    yield
    settings_flat.noticed.clear()
    settings_flat.noticed.update(before)


def test_precedence_in_groups(tmp_path, monkeypatch, quiet) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("operations: {port: 9001, host: 0.0.0.0}\nengine: {max_num_seqs: 3, threads: 2}\n")
    monkeypatch.setenv("KVGATE_ENGINE__MAX_NUM_SEQS", "5")
    s = Settings.load(config, operations={"host": "127.0.0.2"}, engine=None)
    assert s.operations.port == 9001  # from the file
    assert s.engine.max_num_seqs == 5  # the environment beats the file
    assert s.engine.threads == 2  # the rest of the file's group stays
    assert s.operations.host == "127.0.0.2"  # a flag beats both
    assert s.engine_config().max_num_seqs == 5


def test_the_flat_names_of_before_still_work_with_one_notice_each(tmp_path, monkeypatch, quiet, caplog) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("port: 9001\nmax_num_seqs: 3\nchunk_cache_bytes: 1024\nengine: {threads: 2}\n")
    monkeypatch.setenv("KVGATE_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("KVGATE_SEMANTIC_CACHE", "false")  # a flag, before semantic_cache was a group
    caplog.set_level(logging.WARNING, "kvgate.settings")
    s = Settings.load(config, operations={"host": "127.0.0.2"})
    assert (s.operations.port, s.engine.max_num_seqs, s.engine.threads, s.operations.host) == (9001, 5, 2, "127.0.0.2")
    assert s.caches.memory_bytes == 1024 and s.semantic_cache.enabled is False
    Settings.load(config)
    told = [r.getMessage() for r in caplog.records]
    assert "kvgate: the setting chunk_cache_bytes is now caches.memory_bytes; the flat name will be removed" in told
    assert sum("KVGATE_MAX_NUM_SEQS is now KVGATE_ENGINE__MAX_NUM_SEQS" in line for line in told) == 1  # once
    assert not any("host" in line for line in told)  # given grouped: no notice


def test_every_name_of_before_has_its_place() -> None:
    assert sorted(FLAT) == sorted(set(BEFORE) - {"cache_dir", "redis_url"})  # those two stay where they were
    for name in BEFORE:
        group, field = FLAT.get(name, (None, name))
        assert field in (GROUPS[group].model_fields if group else Settings.model_fields), name


def test_a_grouped_variable_beats_its_flat_one(monkeypatch, quiet) -> None:
    monkeypatch.setenv("KVGATE_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("KVGATE_ENGINE__MAX_NUM_SEQS", "6")
    assert Settings().engine.max_num_seqs == 6


def test_a_copy_is_validated_and_merged_into_its_groups(quiet) -> None:
    base = Settings(engine={"max_num_seqs": 4, "threads": 1})
    copied = base.model_copy(update={"engine": {"max_num_seqs": 2}, "semantic_cache": {"enabled": False}})
    assert (copied.engine.max_num_seqs, copied.engine.threads, copied.semantic_cache.enabled) == (2, 1, False)
    assert base.engine.max_num_seqs == 4
    with pytest.raises(pydantic.ValidationError):
        base.model_copy(update={"engine": {"max_num_seqs": 0}})
    with pytest.raises(pydantic.ValidationError):
        base.model_copy(update={"max_num_seq": 3})  # a typo is no new attribute
    assert base.model_copy(update={"agent_pins": "fixed"}).agents.pins == "fixed"  # a flat name, moved


def test_config_file_from_environment(tmp_path, monkeypatch) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("engine: {served_model_name: tiny}\n")
    monkeypatch.setenv("KVGATE_CONFIG", str(config))
    assert Settings.load().engine.served_model_name == "tiny"


def test_bad_values_are_refused(tmp_path) -> None:
    typo = tmp_path / "typo.yaml"
    for text in ("max_num_seq: 3\n", "engine: {max_num_seq: 3}\n", "engines: {max_num_seqs: 3}\n"):
        typo.write_text(text)
        with pytest.raises(pydantic.ValidationError):
            Settings.load(typo)
    with pytest.raises(pydantic.ValidationError):
        Settings.load(operations={"port": 70000})
    with pytest.raises(pydantic.ValidationError, match="unknown guards"):
        Settings(semantic_cache={"guards": ["no-such-guard"]})


def test_upstreams_from_the_file_become_the_proxy_config(tmp_path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "proxy:\n"
        "  upstreams:\n"
        "    - {base_url: 'http://10.0.0.5:8000/v1/', models: [llama]}\n"
        "    - {name: hosted, base_url: 'https://api.example.com', models: {llama: meta/llama}, api_key: sk-x}\n"
        "  retries: 1\n"
    )
    proxy = Settings.load(config).proxy_config()
    first, hosted = proxy.upstreams
    assert (first.name, first.base_url, first.models) == ("upstream-0", "http://10.0.0.5:8000", {"llama": "llama"})
    assert hosted.model_name("llama") == "meta/llama" and hosted.api_key == "sk-x"
    assert proxy.retries == 1
    with pytest.raises(pydantic.ValidationError):
        Settings(proxy={"upstreams": [{"models": ["x"]}]})  # no base_url


def test_keys_are_required_once_any_are_configured() -> None:
    assert not Settings().security.keys_required
    assert Settings(security={"api_keys": {"sk-a": "a"}}).security.keys_required
    assert not Settings(security={"api_keys": {"sk-a": "a"}, "require_api_key": False}).security.keys_required
    assert Settings(
        security={"require_api_key": True}
    ).security.keys_required  # keys created through the admin API only


def test_blend_select_reaches_the_engine_config_and_only_known_ways_are_taken() -> None:
    assert Settings().engine_config().blend_select == "attention"
    assert Settings(caches={"blend_select": "deviation"}).engine_config().blend_select == "deviation"
    with pytest.raises(pydantic.ValidationError):
        Settings(caches={"blend_select": "random"})


def test_the_decode_batch_reaches_the_engine_config_and_only_known_ways_are_taken() -> None:
    assert Settings().engine_config().decode_batch == "copy"
    assert Settings(engine={"decode_batch": "paged"}).engine_config().decode_batch == "paged"
    with pytest.raises(pydantic.ValidationError):
        Settings(engine={"decode_batch": "gather"})


def test_the_answer_target_of_agent_programs_reaches_the_gate() -> None:
    assert Settings().engine_config().quality.target_answer == 0.9
    assert Settings(quality={"answer": 0.5}).engine_config().quality.target_answer == 0.5
    with pytest.raises(pydantic.ValidationError):
        Settings(quality={"answer": 1.5})


def test_kvcomm_anchors_and_programs_in_flight_are_the_engines_own() -> None:
    """The engine builds its anchor pool and its door for programs from its config: nothing sets them on it."""
    assert Settings().engine_config().anchors == AnchorConfig()
    assert Settings(agents={"kvcomm": False}).engine_config().anchors is None
    assert Settings(agents={"kvcomm_anchors": 3}).engine_config().anchors.max_anchors == 3
    config = Settings(agents={"in_flight": 0.5, "in_flight_linger_s": 9}).engine_config()
    assert (config.in_flight, config.in_flight_linger_s) == (0.5, 9)
    assert Settings().engine_config().in_flight == 0.0
