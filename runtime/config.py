"""The one configuration object of the runtime."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvgate.agents.config import AnchorConfig
from kvgate.chunk_cache import ChunkCacheConfig
from kvgate.chunk_cache.config import user_cache_dir
from kvgate.runtime.quality import QualityConfig

__all__ = ["ChunkConfig", "EngineConfig", "ModelNotFound", "model_path", "user_cache_dir"]

QueueOrder = Literal["fcfs", "program"]
BlendSelect = Literal["deviation", "attention"]
DecodeBatching = Literal["copy", "paged"]


class ModelNotFound(RuntimeError):
    """The model asked for is not there, or is not one kvgate loads."""


def model_path(model: str | None) -> Path | None:
    """`model` as the path to load (None: the embedded default): a .gguf file or a directory with config.json,
    else ModelNotFound. Light: a server checks it before its seconds of imports."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if (path.suffix == ".gguf" and path.is_file()) or (path / "config.json").is_file():
        return path
    raise ModelNotFound(f"{path} is neither a .gguf file nor a model directory with config.json")


@dataclass(frozen=True)
class ChunkConfig:
    average: int = 64  # tokens a chunk holds on average
    minimum: int = 16
    maximum: int = 256
    window: int = 4  # tokens the hash of a cut reads
    per_tenant: int = 4096  # chunks this process keeps per tenant
    total: int = 65536  # and in all

    def __post_init__(self) -> None:
        if not 1 <= self.minimum < self.average <= self.maximum or self.window < 1:
            raise ValueError(f"chunk sizes need 1 <= minimum < average <= maximum and window >= 1: {self}")


@dataclass(frozen=True)
class EngineConfig:
    # A local HF directory of a Llama-family model, a .gguf file, or None for the embedded default.
    model: str | None = None
    cache_dir: Path = field(default_factory=user_cache_dir)
    # "auto": bf16 where the device computes it natively (runtime/loader.py: dtype_of), else fp32.
    dtype: str = "auto"
    device: str = "cpu"
    # 0: the model's own context window.
    max_model_len: int = 0
    # Sequences decoded together in one step (continuous batching).
    max_num_seqs: int = 16
    # Prompt tokens computed per step; a longer prompt is prefilled in chunks between decode steps.
    max_num_batched_tokens: int = 2048
    # 0: leave torch's default.
    threads: int = 0
    # A prompt's KV and first token never depend on what else a step computes (runtime/invariance.py); with
    # this, nor do the tokens after it: a decode step of fewer sequences than the row floor is padded to it
    # (measured on CPU: free in bf16, +30-40% per float32 step at one sequence), its attention per sequence.
    deterministic: bool = False
    # A GPU's decode batch (runtime/decode.py): "copy", the batch's KV copied whenever its sequences change and a
    # split kernel over the copy; "paged", a kernel over each sequence's blocks where they lie (runtime/
    # paged_kernel.py), no copy. "copy" until a GPU has timed the two (`kvgate bench gpu`). CPUs read the blocks
    # where they lie either way (runtime/cpu_decode.c).
    decode_batch: DecodeBatching = "copy"
    # Automatic prefix caching: every prompt's exact KV kept in blocks of `prefix_block` tokens, reused
    # by any later prompt of the tenant that begins with the same tokens (runtime/prefix.py).
    prefix_caching: bool = True
    prefix_block: int = 64
    # Content-defined chunks: spans a tenant's prompts repeat, found wherever they land (runtime/chunks.py).
    content_chunks: bool = True
    chunks: ChunkConfig = ChunkConfig()
    # Where document KV is kept: memory, then disk, Redis, LMCache (see chunk_cache/config.py).
    chunk_cache: ChunkCacheConfig = ChunkCacheConfig()
    # The admission queue: "fcfs", or "program" (by the program's first arrival, pinned programs first).
    queue_order: QueueOrder = "program"
    # Blend's recompute ratio; None: the calibrated one (`kvgate calibrate`), else the default.
    recompute_ratio: float | None = None
    # Without a calibration of its own here, the one kvgate ships for the model (runtime/calibrations); the
    # server's settings turn it on, an engine built by hand (a benchmark's, a test's) runs uncalibrated.
    shipped_calibration: bool = False
    # Which reused tokens blend recomputes: "deviation" (CacheBlend's) or "attention" (weighted by what
    # the question pays each; runtime/blend.py; measured closer to full prefill at the same speed).
    blend_select: BlendSelect = "attention"
    # A prompt of mostly new documents (within a tenant's scope) is prefilled in full and their KV
    # kept as it computed them; False: each new document is computed alone, then blended.
    documents_in_context: bool = True
    # KVCOMM's recompute ratio for shared spans, on top of the anchors' offsets.
    kvcomm_ratio: float = 0.0
    # KVCOMM's anchor pool (agents/anchors.py): the offsets that let one agent's span KV serve another's
    # context; None: spans are reused only where exact (runtime/spans.py).
    anchors: AnchorConfig | None = None
    # Agent programs in flight (agents/flight.py): a program's first turn waits at the scheduler's door while
    # `in_flight` times the contexts memory holds are out, or `in_flight_linger_s` past a late tool; 0: never.
    in_flight: float = 0.0
    in_flight_linger_s: float = 60.0
    # Shadow checks of reuse against full prefill, and the gate they move (runtime/quality.py).
    quality: QualityConfig = QualityConfig()
