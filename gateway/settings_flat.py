"""The flat setting names of kvgate before the groups (`chunk_cache_bytes`, `KVGATE_MAX_NUM_SEQS`): still
accepted in a YAML file, the environment and Python, each with a one-line deprecation notice, moved to
where the name lives now."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource

log = logging.getLogger("kvgate.settings")

# Flat names whose field is called otherwise in its group; every other flat name is its field's name.
RENAMED = {
    "chunk_cache_bytes": "caches.memory_bytes",
    "chunk_cache_policy": "caches.policy",
    "chunk_cache_dir": "caches.dir",
    "chunk_cache_disk_bytes": "caches.disk_bytes",
    "chunk_cache_redis_bytes": "caches.redis_bytes",
    "chunk_cache_disk_codec": "caches.disk_codec",
    "chunk_cache_redis_codec": "caches.redis_codec",
    "chunk_cache_lmcache_bytes": "caches.lmcache_bytes",
    "tenant_scoped_kv": "caches.tenant_scoped",
    "fidelity_kl": "quality.kl",
    "fidelity_top1": "quality.top1",
    "fidelity_answer": "quality.answer",
    "gate_window": "quality.window",
    "gate_min_checks": "quality.min_checks",
    "gate_ratios": "quality.ratios",
    "semantic_cache": "semantic_cache.enabled",
    "semantic_cache_path": "semantic_cache.path",
    **{f"semantic_{name}": f"semantic_cache.{name}" for name in ("categories", "guards", "embedder", "relax_step")},
    **{f"semantic_{name}": f"semantic_cache.{name}" for name in ("queue_long", "verifier", "verify_rate", "race")},
    **{f"semantic_{name}": f"semantic_cache.{name}" for name in ("verify_beside", "answer_similarity", "scopes")},
    **{f"agent_{name}": f"agents.{name}" for name in ("pins", "fixed_ttl_s", "max_ttl_s", "memory_weight")},
    **{f"agent_{name}": f"agents.{name}" for name in ("tool_prior_s", "in_flight", "in_flight_linger_s")},
    **{f"agent_{name}": f"agents.{name}" for name in ("implicit_programs", "conversations")},
    **{f"proxy_{name}": f"proxy.{name}" for name in ("retries", "backoff_s", "connect_timeout_s")},
    **{f"proxy_{name}": f"proxy.{name}" for name in ("first_byte_timeout_s", "read_timeout_s", "max_response_bytes")},
}


def flat_names(groups: Mapping[str, type[BaseModel]]) -> dict[str, tuple[str, str]]:
    """Every flat name -> (group, field), from the groups' fields and RENAMED."""
    renamed = {where: flat for flat, where in RENAMED.items()}
    names: dict[str, tuple[str, str]] = {}
    for group, model in groups.items():
        for field in model.model_fields:
            flat = renamed.get(f"{group}.{field}", field)
            assert flat not in names, f"two settings are both called {flat}"
            names[flat] = (group, field)
    return names


noticed: set[str] = set()  # each flat name is told once a process


def notice(old: str, new: str, what: str = "setting") -> None:
    if old not in noticed:
        noticed.add(old)
        log.warning("kvgate: the %s %s is now %s; the flat name will be removed", what, old, new)


def nest(values: Mapping[str, Any], names: Mapping[str, tuple[str, str]], groups: set[str]) -> dict[str, Any]:
    """`values` with every flat name moved into its group (noticed); what a group is given stays as given.
    A flat name beats its group's entry: it is the later spelling in the same source."""

    def flat(key: str, value: Any) -> bool:  # `semantic_cache: false` is the flag of before; a mapping, the group
        return key in names and not (key in groups and isinstance(value, (Mapping, BaseModel)))

    nested = {key: value for key, value in values.items() if not flat(key, value)}
    for key, value in values.items():
        if flat(key, value):
            group, field = names[key]
            notice(key, f"{group}.{field}")
            given = nested.get(group, {})
            nested[group] = {**(given.model_dump() if isinstance(given, BaseModel) else given), field: value}
    return nested


def flat_environment(prefix: str, names: Mapping[str, tuple[str, str]], groups: set[str]) -> dict[str, Any]:
    """The environment's flat variables (`KVGATE_MAX_NUM_SEQS`), nested; a group's own variable
    (`KVGATE_SEMANTIC_CACHE`, once a flag) is read as the flat one where it is not a mapping."""
    nested: dict[str, dict[str, str]] = {}
    for flat, (group, field) in names.items():
        value = os.environ.get(f"{prefix}{flat.upper()}")
        if value is None or (flat in groups and value.lstrip().startswith("{")):
            continue
        notice(f"{prefix}{flat.upper()}", f"{prefix}{group.upper()}__{field.upper()}", "variable")
        nested.setdefault(group, {})[field] = value
    return nested


class FlatEnvironment(PydanticBaseSettingsSource):
    """The flat KVGATE_* variables, nested (below the grouped ones: `KVGATE_ENGINE__DTYPE` wins)."""

    def __init__(self, settings_cls: type[BaseSettings], names: Mapping[str, tuple[str, str]]) -> None:
        super().__init__(settings_cls)
        self.names, self.groups = names, set(settings_cls.model_fields)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the environment itself

    def __call__(self) -> dict[str, Any]:
        prefix = self.settings_cls.model_config.get("env_prefix", "")
        return flat_environment(prefix, self.names, self.groups)


class GroupedEnvironment(EnvSettingsSource):
    """pydantic-settings' own source, but a group's variable that is no JSON mapping is left to
    FlatEnvironment: `KVGATE_SEMANTIC_CACHE=false` was a flag before it was a group."""

    def __init__(self, settings_cls: type[BaseSettings], flags: set[str]) -> None:
        super().__init__(settings_cls)
        self.flags = flags  # groups once flags

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        value, key, complex_ = super().get_field_value(field, field_name)
        if field_name in self.flags and isinstance(value, str) and not value.lstrip().startswith("{"):
            value = None
        return value, key, complex_
