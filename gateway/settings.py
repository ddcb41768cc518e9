"""The one settings object: defaults < YAML file < KVGATE_* environment < command-line flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvgate.agents import AgentConfig, AnchorConfig, PinPolicy, Prior
from kvgate.chunk_cache import ChunkCacheConfig
from kvgate.gateway.limits import Limits
from kvgate.gateway.settings_flat import FlatEnvironment, GroupedEnvironment, flat_names, nest
from kvgate.gateway.settings_groups import (
    AgentSettings,
    CacheSettings,
    EngineSettings,
    OperationsSettings,
    ProxySettings,
    QualitySettings,
    SecuritySettings,
    SemanticCacheSettings,
)
from kvgate.gateway.upstreams import ProxyConfig, Upstream
from kvgate.runtime.config import ChunkConfig, EngineConfig, user_cache_dir
from kvgate.runtime.quality import QualityConfig
from kvgate.semantic_cache import SemanticCacheConfig
from kvgate.semantic_cache import categories as semantic_categories
from kvgate.semantic_cache.verifier import SHIPPED

GROUPS: dict[str, type[BaseModel]] = {
    "operations": OperationsSettings,
    "engine": EngineSettings,
    "caches": CacheSettings,
    "quality": QualitySettings,
    "semantic_cache": SemanticCacheSettings,
    "agents": AgentSettings,
    "proxy": ProxySettings,
    "security": SecuritySettings,
}
FLAT = flat_names(GROUPS)  # the names before the groups -> (group, field)


def grouped(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with the flat names of before moved to their groups (each told once)."""
    return nest(values, FLAT, set(GROUPS))


def laid_over(values: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with `changes` (flat names moved to their groups) laid over them: a group's mapping is
    merged into the group's, anything else replaces what was there."""
    merged = dict(values)
    for key, value in grouped(changes).items():
        both = isinstance(value, Mapping) and isinstance(merged.get(key), Mapping)
        merged[key] = {**merged[key], **value} if both else value
    return merged


class Settings(BaseSettings):
    """Grouped as kvgate is (GROUPS); `cache_dir` and `redis_url` are every group's."""

    # hide_input_in_errors: a wrong value may be a secret (tenant_secret, a Redis URL with its password)
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid", frozen=True, hide_input_in_errors=True
    )

    cache_dir: Path = Field(default_factory=user_cache_dir)
    redis_url: str | None = None  # set: keys, limits, responses, placements and a KV tier shared through it
    operations: OperationsSettings = OperationsSettings()
    engine: EngineSettings = EngineSettings()
    caches: CacheSettings = CacheSettings()
    quality: QualitySettings = QualitySettings()
    semantic_cache: SemanticCacheSettings = SemanticCacheSettings()
    agents: AgentSettings = AgentSettings()
    proxy: ProxySettings = ProxySettings()
    security: SecuritySettings = SecuritySettings()

    def __init__(self, **values: Any) -> None:
        super().__init__(**grouped(values))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        grouped = GroupedEnvironment(settings_cls, flags=set(GROUPS) & set(FLAT))
        return init_settings, grouped, FlatEnvironment(settings_cls, FLAT)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Settings:
        """A copy with `update` validated as the constructor's values are: a group's mapping is merged
        into the group, a flat name moved to its group (pydantic's own copy would validate nothing)."""
        if not update:
            return super().model_copy(deep=deep)
        return type(self)(**laid_over(self.model_dump(), update))

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> Settings:
        """Build the settings once at start-up. `config_file` (or KVGATE_CONFIG) is a YAML mapping
        of the same names; `overrides` (as the constructor takes them; None: not given) win over everything."""
        path = config_file or os.environ.get("KVGATE_CONFIG")
        values: dict[str, Any] = {}
        if path:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping of setting names to values")
            values = grouped(loaded)
        # Init values beat the environment in pydantic-settings; the environment must beat the file.
        for key in [k for k in values if k not in GROUPS]:
            if os.environ.get(f"KVGATE_{key.upper()}") is not None:
                del values[key]
        for flat, (group, field) in FLAT.items():
            named = (f"KVGATE_{group.upper()}__{field.upper()}", f"KVGATE_{flat.upper()}")
            if isinstance(values.get(group), dict) and any(os.environ.get(name) is not None for name in named):
                values[group] = {k: v for k, v in values[group].items() if k != field}
        return cls(**laid_over(values, {k: v for k, v in overrides.items() if v is not None}))

    def chunk_cache_config(self) -> ChunkCacheConfig:
        c = self.caches
        tiers = ["memory"]
        tiers += ["disk"] if c.disk_bytes else []
        tiers += ["redis"] if self.redis_url else []
        tiers += ["lmcache"] if c.lmcache_bytes else []
        return ChunkCacheConfig(
            tiers=tuple(tiers),
            memory_bytes=c.memory_bytes,
            memory_policy=c.policy,
            disk_dir=self.chunk_dir,
            disk_bytes=c.disk_bytes,
            redis_url=self.redis_url or "",
            redis_bytes=c.redis_bytes,
            disk_codec=c.disk_codec,
            redis_codec=c.redis_codec,
            lmcache_bytes=c.lmcache_bytes,
        )

    @property
    def chunk_dir(self) -> Path:
        """The disk tier's directory."""
        return self.caches.dir or self.cache_dir / "chunks"

    def semantic_cache_config(self) -> SemanticCacheConfig:
        s = self.semantic_cache
        verifier = {None: SHIPPED, "none": None}.get(s.verifier, Path(s.verifier or ""))
        return SemanticCacheConfig(
            categories=semantic_categories(s.categories),
            sqlite_path=s.path or self.cache_dir / "semantic.sqlite3",
            redis_url=self.redis_url or "",
            embedder=s.embedder,
            guards=tuple(s.guards),
            relax_step=s.relax_step,
            queue_long=s.queue_long,
            scopes=s.scopes,
            verifier=verifier,
            verify_rate=s.verify_rate,
            verify_beside=s.verify_beside,
            answer_similarity=s.answer_similarity,
        )

    def engine_config(self) -> EngineConfig:
        e, c, q, a = self.engine, self.caches, self.quality, self.agents
        return EngineConfig(
            model=e.model,
            cache_dir=self.cache_dir,
            dtype=e.dtype,
            device=e.device,
            max_model_len=e.max_model_len,
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            threads=e.threads,
            deterministic=e.deterministic,
            decode_batch=e.decode_batch,
            chunk_cache=self.chunk_cache_config(),
            recompute_ratio=c.recompute_ratio,
            shipped_calibration=c.shipped_calibration,
            blend_select=c.blend_select,
            queue_order=e.queue_order,
            kvcomm_ratio=a.kvcomm_recompute_ratio,
            anchors=self.anchor_config() if a.kvcomm else None,
            in_flight=a.in_flight,
            in_flight_linger_s=a.in_flight_linger_s,
            documents_in_context=c.documents_in_context,
            prefix_caching=c.prefix_caching,
            prefix_block=c.prefix_block,
            content_chunks=c.content_chunks,
            chunks=ChunkConfig(
                average=c.content_chunk_tokens,
                minimum=c.content_chunk_tokens // 4,
                maximum=c.content_chunk_tokens * 4,
                per_tenant=min(c.content_chunks_per_tenant, c.content_chunks_max),
                total=c.content_chunks_max,
            ),
            quality=QualityConfig(
                q.shadow_rate,
                q.kl,
                q.top1,
                q.window,
                min(q.min_checks, q.window),
                tuple(q.ratios),
                shadow_share=q.shadow_share,
                target_answer=q.answer,
            ),
        )

    def anchor_config(self) -> AnchorConfig:
        a = self.agents
        return AnchorConfig(a.kvcomm_anchors, a.kvcomm_anchor_bytes, a.kvcomm_max_distance, a.kvcomm_temperature)

    def agent_config(self) -> AgentConfig:
        a = self.agents
        return AgentConfig(
            pins=PinPolicy(a.pins, a.fixed_ttl_s, a.max_ttl_s, a.memory_weight),
            prior=Prior(median_s=a.tool_prior_s),
            implicit_programs=a.implicit_programs,
            conversations=a.conversations,
        )

    def limits(self) -> Limits:
        return Limits(self.security.rate_limit_rpm, self.security.rate_limit_tpm)

    def proxy_config(self, workers: tuple[Upstream, ...] = ()) -> ProxyConfig:
        """The upstreams of proxy mode: the configured ones, or this front's runtime workers."""
        p = self.proxy
        upstreams = list(workers)
        for i, u in enumerate(p.upstreams):
            models = dict(zip(u.models, u.models)) if isinstance(u.models, list) else dict(u.models)
            base_url = u.base_url.rstrip("/").removesuffix("/v1")
            named = u.name or f"upstream-{i}"
            upstreams.append(Upstream(named, base_url, models, u.api_key, u.max_in_flight, fallback=u.fallback))
        names = [u.name for u in upstreams]
        if len(set(names)) < len(names):
            raise ValueError(f"upstreams: each needs a name of its own, got {names}")
        return ProxyConfig(
            tuple(upstreams),
            retries=p.retries,
            backoff_s=p.backoff_s,
            connect_timeout_s=p.connect_timeout_s,
            first_byte_timeout_s=p.first_byte_timeout_s,
            read_timeout_s=p.read_timeout_s,
            spill_at=p.spill_at,
        )
