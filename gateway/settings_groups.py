"""The settings' groups, one per part of kvgate: each a frozen model, nested the same way in the YAML file
(`engine: {max_num_seqs: 8}`) and in the environment (`KVGATE_ENGINE__MAX_NUM_SEQS=8`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from kvgate.runtime.config import BlendSelect, DecodeBatching, EngineConfig, QueueOrder
from kvgate.semantic_cache.guards import GUARDS


class Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class OperationsSettings(Group):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: str = "info"
    shutdown_grace_s: float = Field(30.0, ge=0.0)  # SIGTERM: in-flight requests may finish for this long
    # OpenTelemetry traces of each request's stages, over OTLP/HTTP (needs kvgate[otel]); the standard OTEL_*
    # variables say where to and how (gateway/otel.py)
    tracing: bool = False
    # set by a front for the runtime workers it starts (gateway/workers.py), not by hand: this server stops
    # once that process is no longer its parent
    exit_with_pid: int | None = None


class EngineSettings(Group):
    model: str | None = None  # HF directory or .gguf; None: the embedded SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    max_model_len: int = Field(0, ge=0)
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    threads: int = Field(0, ge=0)
    queue_order: QueueOrder = EngineConfig.queue_order  # the runtime's admission queue
    # end: a tool call the model writes again word for word ends its answer before it (a small model's loop);
    # keep: every call as written, as OpenAI and vLLM pass them on
    repeated_tool_calls: Literal["end", "keep"] = "end"
    # decode steps too computed as in any batch (runtime/invariance.py), not only prompts
    deterministic: bool = False
    # a GPU's decode batch: copy (the batch's KV copied, a split kernel over it) or paged (a kernel over each
    # sequence's KV blocks where they lie); CPUs read the blocks where they lie either way
    decode_batch: DecodeBatching = EngineConfig.decode_batch


class CacheSettings(Group):
    """Reused KV: documents' on tiers, prompts' prefixes, repeated spans, and how reuse is blended."""

    memory_bytes: int = Field(2 << 30, ge=0)  # document KV in memory
    policy: Literal["value", "lru"] = "value"  # what the memory tier evicts first (pins aside)
    dir: Path | None = None  # the disk tier's; None: <cache_dir>/chunks
    disk_bytes: int = Field(16 << 30, ge=0)  # 0: no disk tier
    redis_bytes: int = Field(4 << 30, ge=0)  # the Redis tier's, where redis_url is set
    # Compressed KV on the disk and Redis tiers (chunk_cache/codec.py); None: raw.
    disk_codec: Literal["int8", "int4"] | None = None
    redis_codec: Literal["int8", "int4"] | None = None
    lmcache_bytes: int = Field(0, ge=0)  # > 0: an LMCache tier (needs kvgate[lmcache])
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0)
    shipped_calibration: bool = True  # no `kvgate calibrate` result here: the one kvgate ships for the model
    # Which reused tokens blend recomputes: by the question's attention (measured closer to full prefill than by
    # key deviation, at the same speed: BENCHMARKS.md), or by key deviation (CacheBlend's).
    blend_select: BlendSelect = EngineConfig.blend_select
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
    tenant_scoped: bool = True  # document KV shared only within a tenant (prefix blocks always are)


class QualitySettings(Group):
    """The quality gate: a share of reused requests checked against full prefill on spare capacity."""

    shadow_rate: float = Field(0.05, ge=0.0, le=1.0)
    shadow_share: float = Field(0.05, ge=0.0, lt=1.0)  # of the busy engine's time, checks take at most this
    kl: float = Field(0.05, ge=0.0)  # target: mean first-token KL of the checks, at most
    top1: float = Field(0.95, ge=0.0, le=1.0)  # target: first tokens agreeing with full prefill
    # target of an agent program's reuse: the share of the answer's first 32 tokens full prefill's repeats
    answer: float = Field(0.9, ge=0.0, le=1.0)
    window: int = Field(16, ge=1)  # checks of a recompute ratio that decide whether it holds
    min_checks: int = Field(8, ge=1)  # checks before a ratio may be raised
    ratios: list[float] = Field(default_factory=lambda: [0.3, 0.5])  # the rungs before full prefill


class SemanticCacheSettings(Group):
    enabled: bool = True
    path: Path | None = None  # its SQLite file; None: <cache_dir>/semantic.sqlite3 (Redis if redis_url)
    categories: list[dict[str, Any]] | None = None  # None: semantic_cache/categories.yaml
    guards: list[str] = Field(default_factory=lambda: list(GUARDS))
    embedder: str = "minilm"  # or "package.module:Class"
    relax_step: float = Field(0.03, ge=0.0, le=0.5)  # how far thresholds relax under load
    queue_long: int = Field(8, ge=1)  # queued requests at which the relaxation is whole
    # The error bound (max_error_rate per category): the verifier file (None: the shipped one; "none":
    # the cosine is the score), the share of would-be hits the model answers to check them, and how
    # close two answers' embeddings must be to agree.
    verifier: str | None = None
    verify_rate: float = Field(0.1, ge=0.0, le=1.0)
    verify_beside: bool = False  # checked would-be hits are served, and answered later when idle
    # The backend starts at once and the lookup runs beside it: a miss waits for no embedding; a hit found
    # first withdraws the backend's answer (an upstream may still bill what it began).
    race: bool = False
    answer_similarity: float = Field(0.9, gt=0.0, le=1.0)
    scopes: int = Field(64, ge=1)  # scope indexes held in memory (LRU; rebuilt lazily)

    @field_validator("guards")
    @classmethod
    def known_guards(cls, guards: list[str]) -> list[str]:
        if unknown := set(guards) - set(GUARDS):
            raise ValueError(f"unknown guards {sorted(unknown)}; known: {sorted(GUARDS)}")
        return guards


class AgentSettings(Group):
    pins: Literal["off", "fixed", "decide"] = "decide"  # how long a program's KV stays pinned
    fixed_ttl_s: float = Field(10.0, ge=0.0)  # the TTL of pins: fixed
    max_ttl_s: float = Field(300.0, ge=0.0)
    memory_weight: float = Field(1.0, ge=0.0)  # seconds of compute one second of all memory is worth
    tool_prior_s: float = Field(2.0, gt=0.0)  # median tool duration before any is observed
    # Programs in flight per context memory holds (0: no limit): past that, a new program's first turn
    # waits for one to end, or for a tool's return to be in_flight_linger_s late.
    in_flight: float = Field(0.0, ge=0.0)
    in_flight_linger_s: float = Field(60.0, gt=0.0)
    # Programs without markup: a request resending an answered turn's history continues its program.
    implicit_programs: bool = True
    conversations: int = Field(4096, ge=1)  # answered turns remembered for that, newest first
    # KVCOMM: a program's messages that another program read or wrote reuse that KV, offset by anchors.
    kvcomm: bool = True
    kvcomm_anchors: int = Field(32, ge=1)  # anchor pool size; a new anchor evicts the least used
    kvcomm_anchor_bytes: int = Field(1 << 30, ge=1)  # and the bytes its deviations may hold
    kvcomm_max_distance: float = Field(0.6, ge=0.0)  # the gate: farther from every anchor is prefilled densely
    kvcomm_temperature: float = Field(0.05, gt=0.0)  # softmax temperature over anchor distances
    # Span tokens recomputed (CacheBlend) on top of the offsets; measured: offsets alone beat blend at 15%.
    kvcomm_recompute_ratio: float = Field(0.0, ge=0.0, le=1.0)


class UpstreamSettings(Group):
    name: str | None = None  # default: upstream-<index>
    base_url: str  # up to /v1 excluded: http://host:port
    models: list[str] | dict[str, str] = Field(default_factory=lambda: ["*"])
    api_key: str | None = None
    max_in_flight: int = Field(64, ge=1)
    fallback: bool = False  # true: sent to only when no other upstream serving the model answered


class ProxySettings(Group):
    # [{name, base_url, models: [names] or {name: upstream name}, api_key, max_in_flight}]: proxy mode
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    workers: int = Field(0, ge=0)  # > 0: this process fronts N runtime worker processes
    retries: int = Field(2, ge=0)
    backoff_s: float = Field(0.1, ge=0.0)
    connect_timeout_s: float = Field(5.0, gt=0.0)
    first_byte_timeout_s: float = Field(60.0, gt=0.0)
    read_timeout_s: float = Field(300.0, gt=0.0)
    max_response_bytes: int = Field(64 << 20, ge=1024)  # a buffered (non-streamed) upstream answer
    spill_at: int = Field(4, ge=1)  # requests in flight at the preferred replica from which one spills over
    # How often each replica's /metrics is read for the load every front puts on it (0: this front's own count).
    replica_load_poll_s: float = Field(1.0, ge=0.0)
    # How a request picks among the replicas serving its model: where its KV likely is (gateway/routing.py),
    # or each in turn (what a plain load balancer does; the baseline `kvgate bench fleet` measures against).
    routing: Literal["cache", "round_robin"] = "cache"
    # Where each conversation's latest turn went (in Redis with redis_url): its next turn goes there too.
    route_conversations: int = Field(65536, ge=1)  # placements kept, the least recently placed go first
    route_ttl_s: float = Field(600.0, gt=0.0)  # a conversation idle this long may start anywhere


class SecuritySettings(Group):
    """Who may call, as whom, how much; what is public; what a caller can queue."""

    # API key (or "sha256:<hex>" of it) -> tenant, or {tenant, models, rpm, tpm}; more keys via POST /admin/keys.
    api_keys: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    require_api_key: bool | None = None  # None: required when api_keys is set; false: unknown keys are anonymous
    rate_limit_rpm: int | None = Field(None, ge=1)  # requests per minute of a key (or caller) without its own
    rate_limit_tpm: int | None = Field(None, ge=1)  # tokens per minute, likewise
    # Names the tenants of bearer tokens that are no key (an HMAC under it): set it alike on every front.
    # None: made once in Redis when redis_url is set (every front agrees), else in cache_dir (this machine).
    tenant_secret: SecretStr | None = None
    admin_key: str | None = None  # set: admin endpoints need it as the bearer token
    trusted_proxies: list[str] = Field(default_factory=list)  # IPs/CIDRs whose X-Forwarded-For is believed
    metrics_access: Literal["public", "admin", "off"] = "public"  # /metrics: anyone, the admin key, nobody
    openapi_docs: bool = True  # /openapi.json and /docs
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # bounds on what callers can queue (over them: 400, 429 or 503 with Retry-After)
    max_request_seqs: int = Field(128, ge=1)  # sequences one request may ask for: prompts x n (x best_of)
    max_waiting_seqs: int = Field(1024, ge=1)  # sequences waiting or running on this server, all tenants
    max_waiting_seqs_per_tenant: int = Field(256, ge=1)  # and of one tenant
    # set by a front for the runtime workers it starts, not by hand: every request but /health must carry it
    worker_secret: SecretStr | None = None

    @field_validator("tenant_secret")
    @classmethod
    def long_secret(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and len(secret.get_secret_value()) < 32:
            raise ValueError("tenant_secret must be at least 32 characters")  # never the value itself
        return secret

    @property
    def keys_required(self) -> bool:
        return bool(self.api_keys) if self.require_api_key is None else self.require_api_key
