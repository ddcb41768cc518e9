"""The one settings object: defaults < YAML file < KVGATE_* environment < command-line flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvgate.agents import AgentConfig, AnchorConfig, PinPolicy, Prior
from kvgate.chunk_cache import ChunkCacheConfig
from kvgate.gateway.limits import Limits
from kvgate.gateway.upstreams import ProxyConfig, Upstream
from kvgate.runtime.config import ChunkConfig, EngineConfig, user_cache_dir
from kvgate.runtime.quality import QualityConfig
from kvgate.semantic_cache import SemanticCacheConfig
from kvgate.semantic_cache import categories as semantic_categories
from kvgate.semantic_cache.guards import GUARDS
from kvgate.semantic_cache.verifier import SHIPPED


class UpstreamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None  # default: upstream-<index>
    base_url: str  # up to /v1 excluded: http://host:port
    models: list[str] | dict[str, str] = Field(default_factory=lambda: ["*"])
    api_key: str | None = None
    max_in_flight: int = Field(64, ge=1)
    fallback: bool = False  # true: sent to only when no other upstream serving the model answered


class Settings(BaseSettings):
    # hide_input_in_errors: a wrong value may be a secret (tenant_secret, a Redis URL with its password)
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="forbid", frozen=True, hide_input_in_errors=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: str | None = None  # HF directory or .gguf; None: the embedded SmolLM2-135M-Instruct
    served_model_name: str | None = None
    cache_dir: Path = Field(default_factory=user_cache_dir)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    max_model_len: int = Field(0, ge=0)
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    threads: int = Field(0, ge=0)
    chunk_cache_bytes: int = Field(2 << 30, ge=0)  # document KV in memory
    chunk_cache_dir: Path | None = None  # None: <cache_dir>/chunks
    chunk_cache_disk_bytes: int = Field(16 << 30, ge=0)  # 0: no disk tier
    redis_url: str | None = None  # set: a Redis tier shared by every kvgate process using it
    chunk_cache_redis_bytes: int = Field(4 << 30, ge=0)
    # Compressed KV on the disk and Redis tiers (chunk_cache/codec.py); None: raw.
    chunk_cache_disk_codec: Literal["int8", "int4"] | None = None
    chunk_cache_redis_codec: Literal["int8", "int4"] | None = None
    chunk_cache_lmcache_bytes: int = Field(0, ge=0)  # > 0: an LMCache tier (needs kvgate[lmcache])
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0)
    shipped_calibration: bool = True  # no `kvgate calibrate` result here: the one kvgate ships for the model
    # end: a tool call the model writes again word for word ends its answer before it (a small model's loop);
    # keep: every call as written, as OpenAI and vLLM pass them on
    repeated_tool_calls: Literal["end", "keep"] = "end"
    # Which reused tokens blend recomputes: by the question's attention (measured closer to full prefill than by
    # key deviation, at the same speed: BENCHMARKS.md), or by key deviation (CacheBlend's).
    blend_select: Literal["deviation", "attention"] = "attention"
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    semantic_cache: bool = True  # the semantic response cache
    semantic_cache_path: Path | None = None  # its SQLite file; None: <cache_dir>/semantic.sqlite3 (Redis if redis_url)
    semantic_categories: list[dict[str, Any]] | None = None  # None: semantic_cache/categories.yaml
    semantic_guards: list[str] = Field(default_factory=lambda: list(GUARDS))
    semantic_embedder: str = "minilm"  # or "package.module:Class"
    semantic_relax_step: float = Field(0.03, ge=0.0, le=0.5)  # how far thresholds relax under load
    semantic_queue_long: int = Field(8, ge=1)  # queued requests at which the relaxation is whole
    # The error bound (max_error_rate per category): the verifier file (None: the shipped one; "none":
    # the cosine is the score), the share of would-be hits the model answers to check them, and how
    # close two answers' embeddings must be to agree.
    semantic_verifier: str | None = None
    semantic_verify_rate: float = Field(0.1, ge=0.0, le=1.0)
    semantic_verify_beside: bool = False  # checked would-be hits are served, and answered later when idle
    # The backend starts at once and the lookup runs beside it: a miss waits for no embedding; a hit found
    # first withdraws the backend's answer (an upstream may still bill what it began).
    semantic_race: bool = False
    semantic_answer_similarity: float = Field(0.9, gt=0.0, le=1.0)
    chunk_cache_policy: Literal["value", "lru"] = "value"  # what the memory tier evicts first (pins aside)
    agent_pins: Literal["off", "fixed", "decide"] = "decide"  # how long a program's KV stays pinned
    agent_fixed_ttl_s: float = Field(10.0, ge=0.0)  # the TTL of agent_pins: fixed
    agent_max_ttl_s: float = Field(300.0, ge=0.0)
    agent_memory_weight: float = Field(1.0, ge=0.0)  # seconds of compute one second of all memory is worth
    agent_tool_prior_s: float = Field(2.0, gt=0.0)  # median tool duration before any is observed
    # Programs in flight per context memory holds (0: no limit): past that, a new program's first turn
    # waits for one to end, or for a tool's return to be agent_in_flight_linger_s late.
    agent_in_flight: float = Field(0.0, ge=0.0)
    agent_in_flight_linger_s: float = Field(60.0, gt=0.0)
    # Programs without markup: a request resending an answered turn's history continues its program.
    agent_implicit_programs: bool = True
    agent_conversations: int = Field(4096, ge=1)  # answered turns remembered for that, newest first
    # KVCOMM: a program's messages that another program read or wrote reuse that KV, offset by anchors.
    kvcomm: bool = True
    kvcomm_anchors: int = Field(32, ge=1)  # anchor pool size; a new anchor evicts the least used
    kvcomm_anchor_bytes: int = Field(1 << 30, ge=1)  # and the bytes its deviations may hold
    kvcomm_max_distance: float = Field(0.6, ge=0.0)  # the gate: farther from every anchor is prefilled densely
    kvcomm_temperature: float = Field(0.05, gt=0.0)  # softmax temperature over anchor distances
    # Span tokens recomputed (CacheBlend) on top of the offsets; measured: offsets alone beat blend at 15%.
    kvcomm_recompute_ratio: float = Field(0.0, ge=0.0, le=1.0)
    queue_order: Literal["fcfs", "program"] = "program"  # the runtime's admission queue
    # A prompt of mostly new documents is prefilled in full and their KV kept as it computed them
    # (within a tenant's scope); false: each new document is computed alone and blended.
    documents_in_context: bool = True
    # Automatic prefix caching: every prompt's exact KV kept in blocks of `prefix_block` tokens, reused
    # by any later prompt of the same tenant that begins with the same tokens (as vLLM's APC).
    prefix_caching: bool = True
    prefix_block: int = Field(64, ge=1, le=4096)
    # Content-defined chunks: any span a tenant's prompts repeat (a pasted document, an agent's answer
    # quoted in another's message, a history re-rendered as text) found by its tokens wherever it lands
    # and reused as documents are; `content_chunk_tokens` on average, bounded per tenant and in all.
    content_chunks: bool = True
    content_chunk_tokens: int = Field(64, ge=8, le=1024)
    content_chunks_per_tenant: int = Field(4096, ge=1)
    content_chunks_max: int = Field(65536, ge=1)
    # ---- the quality gate: a share of reused requests checked against full prefill on spare capacity
    shadow_rate: float = Field(0.05, ge=0.0, le=1.0)
    shadow_share: float = Field(0.05, ge=0.0, lt=1.0)  # of the busy engine's time, checks take at most this
    fidelity_kl: float = Field(0.05, ge=0.0)  # target: mean first-token KL of the checks, at most
    fidelity_top1: float = Field(0.95, ge=0.0, le=1.0)  # target: first tokens agreeing with full prefill
    # target of an agent program's reuse: the share of the answer's first 32 tokens full prefill's repeats
    fidelity_answer: float = Field(0.9, ge=0.0, le=1.0)
    gate_window: int = Field(16, ge=1)  # checks of a recompute ratio that decide whether it holds
    gate_min_checks: int = Field(8, ge=1)  # checks before a ratio may be raised
    gate_ratios: list[float] = Field(default_factory=lambda: [0.3, 0.5])  # the rungs before full prefill
    # API key (or "sha256:<hex>" of it) -> tenant, or {tenant, models, rpm, tpm}; more keys via POST /admin/keys.
    api_keys: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    require_api_key: bool | None = None  # None: required when api_keys is set; false: unknown keys are anonymous
    rate_limit_rpm: int | None = Field(None, ge=1)  # requests per minute of a key (or caller) without its own
    rate_limit_tpm: int | None = Field(None, ge=1)  # tokens per minute, likewise
    tenant_scoped_kv: bool = True  # document and prefix KV shared only within a tenant
    # Names the tenants of bearer tokens that are no key (an HMAC under it): set it alike on every front.
    # None: made once in Redis when redis_url is set (every front agrees), else in cache_dir (this machine).
    tenant_secret: SecretStr | None = None
    admin_key: str | None = None  # set: admin endpoints need it as the bearer token
    # Proxy mode: [{name, base_url, models: [names] or {name: upstream name}, api_key, max_in_flight}].
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    workers: int = Field(0, ge=0)  # > 0: this process fronts N runtime worker processes
    proxy_retries: int = Field(2, ge=0)
    proxy_backoff_s: float = Field(0.1, ge=0.0)
    proxy_connect_timeout_s: float = Field(5.0, gt=0.0)
    proxy_first_byte_timeout_s: float = Field(60.0, gt=0.0)
    proxy_read_timeout_s: float = Field(300.0, gt=0.0)
    spill_at: int = Field(4, ge=1)  # requests in flight at the preferred replica from which one spills over
    # How often each replica's /metrics is read for the load every front puts on it (0: this front's own count).
    replica_load_poll_s: float = Field(1.0, ge=0.0)
    # How a request picks among the replicas serving its model: where its KV likely is (gateway/routing.py),
    # or each in turn (what a plain load balancer does; the baseline `kvgate bench fleet` measures against).
    routing: Literal["cache", "round_robin"] = "cache"
    # Where each conversation's latest turn went (in Redis with redis_url): its next turn goes there too.
    route_conversations: int = Field(65536, ge=1)  # placements kept, the least recently placed go first
    route_ttl_s: float = Field(600.0, gt=0.0)  # a conversation idle this long may start anywhere
    log_level: str = "info"
    # ---- admission: bounds on what callers can queue (over them: 400, 429 or 503 with Retry-After)
    max_request_seqs: int = Field(128, ge=1)  # sequences one request may ask for: prompts x n (x best_of)
    max_waiting_seqs: int = Field(1024, ge=1)  # sequences waiting or running on this server, all tenants
    max_waiting_seqs_per_tenant: int = Field(256, ge=1)  # and of one tenant
    # ---- memory a caller can grow
    semantic_scopes: int = Field(64, ge=1)  # semantic-cache scope indexes held in memory (LRU; rebuilt lazily)
    proxy_max_response_bytes: int = Field(64 << 20, ge=1024)  # a buffered (non-streamed) upstream answer
    # ---- who is believed, what is public
    trusted_proxies: list[str] = Field(default_factory=list)  # IPs/CIDRs whose X-Forwarded-For is believed
    metrics_access: Literal["public", "admin", "off"] = "public"  # /metrics: anyone, the admin key, nobody
    openapi_docs: bool = True  # /openapi.json and /docs
    # ---- operations
    shutdown_grace_s: float = Field(30.0, ge=0.0)  # SIGTERM: in-flight requests may finish for this long
    # ---- set by a front for the runtime workers it starts (gateway/workers.py), not by hand
    worker_secret: SecretStr | None = None  # set: every request but /health must carry it
    exit_with_pid: int | None = None  # set: this server stops once that process is no longer its parent

    @field_validator("tenant_secret")
    @classmethod
    def long_secret(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and len(secret.get_secret_value()) < 32:
            raise ValueError("tenant_secret must be at least 32 characters")  # never the value itself
        return secret

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> Settings:
        """Build the settings once at start-up. `config_file` (or KVGATE_CONFIG) is a YAML mapping
        of the same names; flags given as `overrides` (None means not given) win over everything."""
        path = config_file or os.environ.get("KVGATE_CONFIG")
        values: dict[str, Any] = {}
        if path:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping of setting names to values")
            values.update(loaded)
        # Init values beat the environment in pydantic-settings; the environment must beat the file.
        for name in cls.model_fields:
            env = os.environ.get(f"KVGATE_{name.upper()}")
            if env is not None:
                values.pop(name, None)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def chunk_cache_config(self) -> ChunkCacheConfig:
        tiers = ["memory"]
        tiers += ["disk"] if self.chunk_cache_disk_bytes else []
        tiers += ["redis"] if self.redis_url else []
        tiers += ["lmcache"] if self.chunk_cache_lmcache_bytes else []
        return ChunkCacheConfig(
            tiers=tuple(tiers),
            memory_bytes=self.chunk_cache_bytes,
            memory_policy=self.chunk_cache_policy,
            disk_dir=self.chunk_cache_dir or self.cache_dir / "chunks",
            disk_bytes=self.chunk_cache_disk_bytes,
            redis_url=self.redis_url or "",
            redis_bytes=self.chunk_cache_redis_bytes,
            disk_codec=self.chunk_cache_disk_codec,
            redis_codec=self.chunk_cache_redis_codec,
            lmcache_bytes=self.chunk_cache_lmcache_bytes,
        )

    def semantic_cache_config(self) -> SemanticCacheConfig:
        unknown = set(self.semantic_guards) - set(GUARDS)
        if unknown:
            raise ValueError(f"semantic_guards: unknown guards {sorted(unknown)}; known: {sorted(GUARDS)}")
        verifier = {None: SHIPPED, "none": None}.get(self.semantic_verifier, Path(self.semantic_verifier or ""))
        return SemanticCacheConfig(
            categories=semantic_categories(self.semantic_categories),
            sqlite_path=self.semantic_cache_path or self.cache_dir / "semantic.sqlite3",
            redis_url=self.redis_url or "",
            embedder=self.semantic_embedder,
            guards=tuple(self.semantic_guards),
            relax_step=self.semantic_relax_step,
            queue_long=self.semantic_queue_long,
            scopes=self.semantic_scopes,
            verifier=verifier,
            verify_rate=self.semantic_verify_rate,
            verify_beside=self.semantic_verify_beside,
            answer_similarity=self.semantic_answer_similarity,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            cache_dir=self.cache_dir,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            threads=self.threads,
            chunk_cache=self.chunk_cache_config(),
            recompute_ratio=self.recompute_ratio,
            shipped_calibration=self.shipped_calibration,
            blend_select=self.blend_select,
            queue_order=self.queue_order,
            kvcomm_ratio=self.kvcomm_recompute_ratio,
            anchors=self.anchor_config() if self.kvcomm else None,
            in_flight=self.agent_in_flight,
            in_flight_linger_s=self.agent_in_flight_linger_s,
            documents_in_context=self.documents_in_context,
            prefix_caching=self.prefix_caching,
            prefix_block=self.prefix_block,
            content_chunks=self.content_chunks,
            chunks=ChunkConfig(
                average=self.content_chunk_tokens,
                minimum=self.content_chunk_tokens // 4,
                maximum=self.content_chunk_tokens * 4,
                per_tenant=min(self.content_chunks_per_tenant, self.content_chunks_max),
                total=self.content_chunks_max,
            ),
            quality=QualityConfig(
                self.shadow_rate,
                self.fidelity_kl,
                self.fidelity_top1,
                self.gate_window,
                min(self.gate_min_checks, self.gate_window),
                tuple(self.gate_ratios),
                shadow_share=self.shadow_share,
                target_answer=self.fidelity_answer,
            ),
        )

    def anchor_config(self) -> AnchorConfig:
        return AnchorConfig(
            self.kvcomm_anchors, self.kvcomm_anchor_bytes, self.kvcomm_max_distance, self.kvcomm_temperature
        )

    def agent_config(self) -> AgentConfig:
        pins = PinPolicy(self.agent_pins, self.agent_fixed_ttl_s, self.agent_max_ttl_s, self.agent_memory_weight)
        anchors = self.anchor_config()
        prior = Prior(median_s=self.agent_tool_prior_s)
        return AgentConfig(
            pins=pins,
            prior=prior,
            kvcomm=self.kvcomm,
            anchors=anchors,
            in_flight=self.agent_in_flight,
            in_flight_linger_s=self.agent_in_flight_linger_s,
            implicit_programs=self.agent_implicit_programs,
            conversations=self.agent_conversations,
        )

    @property
    def keys_required(self) -> bool:
        return bool(self.api_keys) if self.require_api_key is None else self.require_api_key

    def limits(self) -> Limits:
        return Limits(self.rate_limit_rpm, self.rate_limit_tpm)

    def proxy_config(self, workers: tuple[Upstream, ...] = ()) -> ProxyConfig:
        """The upstreams of proxy mode: the configured ones, or this front's runtime workers."""
        upstreams = list(workers)
        for i, u in enumerate(self.upstreams):
            models = dict(zip(u.models, u.models)) if isinstance(u.models, list) else dict(u.models)
            base_url = u.base_url.rstrip("/").removesuffix("/v1")
            named = u.name or f"upstream-{i}"
            upstreams.append(Upstream(named, base_url, models, u.api_key, u.max_in_flight, fallback=u.fallback))
        names = [u.name for u in upstreams]
        if len(set(names)) < len(names):
            raise ValueError(f"upstreams: each needs a name of its own, got {names}")
        return ProxyConfig(
            tuple(upstreams),
            retries=self.proxy_retries,
            backoff_s=self.proxy_backoff_s,
            connect_timeout_s=self.proxy_connect_timeout_s,
            first_byte_timeout_s=self.proxy_first_byte_timeout_s,
            read_timeout_s=self.proxy_read_timeout_s,
            spill_at=self.spill_at,
        )
