"""What an engine's config asks for, built: its reuser, and its caches wired to the reuser, spans and gate."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvgate.chunk_cache import ChunkStore
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.caching import Caches
from kvgate.runtime.calibration import Calibration
from kvgate.runtime.chunks import Breaks, Chunks
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.prefix import Blocks
from kvgate.runtime.quality import QualityGate
from kvgate.runtime.reuse import Reuser
from kvgate.runtime.spans import Spans


def make_reuser(
    config: EngineConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_fp: str,
    calibration: Calibration | None,
) -> Reuser:
    """The reuser over the config's chunk store, blending at the operator's ratio, else the calibrated one."""
    c = config
    ratio = c.recompute_ratio if c.recompute_ratio is not None else calibration.ratio if calibration else None
    blend = BlendConfig(select=c.blend_select) if ratio is None else BlendConfig(ratio=ratio, select=c.blend_select)
    limit = calibration.deviation_limit if calibration and c.recompute_ratio is None else None
    store = ChunkStore.from_config(c.chunk_cache)
    return Reuser(model, tokenizer, store, model_fp, blend, deviation_limit=limit)


def make_caches(
    config: EngineConfig,
    reuser: Reuser,
    spans: Spans,
    gate: QualityGate,
    calibration: Calibration | None,
    cost: Callable[[int], float],
    exact: bool = False,
    grid: int = 1,
) -> Caches:
    """The caches an engine's config asks for (cost: seconds to prefill n tokens; exact: whether the engine
    computes a prompt the same however its prefill is split, its chunks ending at multiples of `grid`)."""
    store, model_fp = reuser.store, reuser.model_fp
    grid = grid if exact else 1
    fp = reuser.tokenizer_fp
    blocks = Blocks(store, model_fp, fp, cost, config.prefix_block, grid=grid) if config.prefix_caching else None
    chunks = blended = None
    if config.content_chunks:
        chunks = Chunks(store, reuser.model, model_fp, reuser.key, cost, config.chunks, Breaks.of(reuser.tokenizer))
        if config.prefix_caching:
            blended = Blocks(store, model_fp, fp, cost, config.prefix_block, namespace="blended")
    calibrated = calibration if config.recompute_ratio is None else None
    if calibrated is None and config.recompute_ratio is None:  # no ratio measured: blends calibrated online
        gate.uncalibrated("blend")
    in_context = config.documents_in_context
    return Caches(reuser, blocks, spans, cost, gate, calibrated, in_context, chunks, blended, exact, grid)
