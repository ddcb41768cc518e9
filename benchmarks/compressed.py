"""`kvgate bench compressed`: compressed document KV on the disk and Redis tiers against raw entries.

Per codec (raw, int8, int4: chunk_cache/codec.py) and tier: bytes stored per token, the time to load
an entry (read layer by layer, every checksum checked, decoded into tensors), the time to first
token of a blend reading its documents from that tier, and the blend's fidelity against full
prefill, measured as `bench fidelity` does: first-token KL and top-1 agreement over the reference
answer's first 32 positions, teacher-forced. "KL added" is the compressed blend's KL minus the raw
blend's (the same blend, its documents' KV stored raw), which is the cost of the codec alone.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from kvgate.bench.tiers import best, cold, redis_server, whole
from kvgate.chunk_cache import ByteTier, ChunkKV, ChunkStore, DiskTier, MemoryTier, make_tier
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.calibration import model_fingerprint
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.fidelity import Item, greedy, kl, load_items, start, teacher_forced, top1
from kvgate.runtime.loader import load
from kvgate.runtime.progress import progress
from kvgate.runtime.report import table, write_section
from kvgate.runtime.reuse import ReuseMode, Reuser

CODECS = (None, "int8", "int4")
TARGET_RATIO, TARGET_KL = 3.0, 0.01  # compressed entries >= 3x smaller, first-token KL added <= 0.01


@dataclass
class Row:
    stored: int = 0  # bytes written to the tier
    tokens: int = 0
    load_s: list[float] = field(default_factory=list)  # per entry
    cold_s: list[float] = field(default_factory=list)  # per entry, disk pages dropped first
    ttft_s: list[float] = field(default_factory=list)  # per item
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    kl_to_raw: list[float] = field(default_factory=list)  # KL(raw blend || this blend), first token


def name(codec: str | None) -> str:
    return codec or "raw"


def lower_tier(tier: str, codec: str | None, tmp: Path, redis_url: str) -> ByteTier:
    """A tier of its own per codec: its own directory, its own Redis prefix."""
    if tier == "disk":
        return DiskTier(tmp / name(codec), 64 << 30, codec=codec)
    found = make_tier("redis", url=redis_url, budget_bytes=64 << 30, prefix=f"kvgate:bench:{name(codec)}:", codec=codec)
    assert isinstance(found, ByteTier)
    return found


def bench_compressed(
    config: EngineConfig,
    data: Path,
    docs: int,
    limit: int,
    offset: int,
    words: int,
    ratio: float,
    repeats: int,
    redis_url: str | None,
    output: Path,
    command: str,
) -> None:
    loaded = load(config)
    items = load_items(loaded, data, docs, limit, True, offset, words)
    server = redis_server() if redis_url is None else contextlib.nullcontext(redis_url)
    with tempfile.TemporaryDirectory() as tmp, server as url:
        fp = model_fingerprint(loaded)
        memory = Reuser(loaded.model, loaded.tokenizer, ChunkStore([MemoryTier(64 << 30)]), fp, BlendConfig())
        entries = [memory.document(ids)[0] for item in items for ids, d in zip(item.pieces, item.documents) if d]
        stores = {
            (tier, codec): ChunkStore([MemoryTier(0), lower_tier(tier, codec, Path(tmp), url)])
            for tier in ("disk", "redis")
            for codec in CODECS
        }  # a memory tier of 0 bytes: every read is the lower tier's
        rows = {where: stored(store.tiers[-1], entries) for where, store in stores.items()}
        for where, store in stores.items():
            time_loads(store, entries, rows[where], repeats)
        full = measure_blends(memory, stores, items, rows, ratio, repeats, loaded.eos_token_ids)
        for store in stores.values():
            store.close()
    write(rows, full, ratio, len(items), docs, output, command)


def stored(tier: ByteTier, entries: list[ChunkKV]) -> Row:
    row = Row()
    for entry in entries:
        assert tier.put(entry), f"tier {tier.name} refused an entry"
        row.tokens += entry.tokens
    row.stored = tier.stats()["bytes_written"]
    return row


def time_loads(store: ChunkStore, entries: list[ChunkKV], row: Row, repeats: int) -> None:
    tier = store.tiers[-1]
    for entry in entries:
        row.load_s.append(best(partial(whole, store, entry.key), repeats))
        if isinstance(tier, DiskTier):
            row.cold_s.append(cold(partial(whole, store, entry.key), tier.path(entry.key), repeats))


def measure_blends(
    memory: Reuser,
    stores: dict[tuple[str, str | None], ChunkStore],
    items: list[Item],
    rows: dict[tuple[str, str | None], Row],
    ratio: float,
    repeats: int,
    eos: frozenset[int],
) -> list[float]:
    """Each store's blend per item: TTFT (fastest of `repeats`) and fidelity; full prefill's TTFT, returned."""
    reusers = {w: Reuser(memory.model, memory.tokenizer, s, memory.model_fp, BlendConfig()) for w, s in stores.items()}
    full = []
    for n, item in enumerate(progress(items, "items timed")):
        full.append(best(partial(start, memory, item, ReuseMode("full")), repeats))
        ref_kv, ref_first, _ = start(memory, item, ReuseMode("full"))
        answer, _ = greedy(memory, ref_kv, ref_first, eos)
        raw_first = {}
        for (tier, codec), reuser in reusers.items():
            row = rows[(tier, codec)]
            runs = []
            for _ in range(repeats):
                began = time.perf_counter()
                kv, first, done = start(reuser, item, ReuseMode("blend", ratio))
                runs.append(time.perf_counter() - began)
                assert done.reused > 0, f"{tier} {name(codec)}: the blend reused nothing"
            row.ttft_s.append(min(runs))
            row.kl.append(kl(ref_first, first))
            row.top1.append(top1(teacher_forced(reuser, kv, first, answer), answer))
            raw_first.setdefault(tier, first)  # CODECS puts raw first
            row.kl_to_raw.append(kl(raw_first[tier], first))
        line = ", ".join(f"{t} {name(c)} {r.ttft_s[-1]:.2f} s KL {r.kl[-1]:.4f}" for (t, c), r in rows.items())
        print(f"item {n + 1}/{len(items)}: {len(item.ids)} tokens; full {full[-1]:.2f} s; {line}", flush=True)
    return full


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def median(values: list[float]) -> float:
    """Timings: the median, as other processes on a shared machine add outliers of seconds."""
    return statistics.median(values) if values else float("nan")


def write(
    rows: dict[tuple[str, str | None], Row],
    full: list[float],
    ratio: float,
    items: int,
    docs: int,
    output: Path,
    command: str,
) -> None:
    header = ["tier", "codec", "bytes / token", "smaller", "load ms / doc", "load ms, cold", "blend TTFT s",
              "first-token KL", "KL added, mean / worst item", "KL to raw blend", "top-1 (32, forced)"]  # fmt: skip
    table_rows, verdicts = [], {}
    for (tier, codec), row in rows.items():
        raw = rows[(tier, None)]
        smaller = (raw.stored / raw.tokens) / (row.stored / row.tokens)
        added = mean(row.kl) - mean(raw.kl)
        worst = max((a - b for a, b in zip(row.kl, raw.kl, strict=True)), default=float("nan"))
        if codec is not None:
            verdicts.setdefault(codec, []).append(smaller >= TARGET_RATIO and added <= TARGET_KL)
        table_rows.append([
            tier, name(codec), f"{row.stored / row.tokens:.0f}", f"{smaller:.2f}x", f"{1e3 * median(row.load_s):.2f}",
            f"{1e3 * median(row.cold_s):.2f}" if row.cold_s else "", f"{median(row.ttft_s):.3f}", f"{mean(row.kl):.4f}",
            f"{added:+.4f} / {worst:+.4f}", f"{mean(row.kl_to_raw):.4f}", f"{100 * mean(row.top1):.1f}%",
        ])  # fmt: skip
    tokens = next(iter(rows.values())).tokens
    met = ", ".join(f"{c}: {'met' if all(v) else 'MISSED'}" for c, v in verdicts.items())
    body = (
        f"{items} MuSiQue items, {docs} passages each as documents (shuffled; {tokens} document tokens in all), "
        f"blend at {ratio:.0%}; full prefill median {median(full):.3f} s. Each tier has a memory tier of 0 bytes "
        "above it, so every read is the tier's own. Bytes / token: what the tier stored (header, scales and "
        "checksums included) over the documents' tokens. A load: the entry read whole, layer by layer, every "
        "checksum checked, decoded into fresh tensors (cold: the file's pages dropped first). Timings: the "
        "fastest of the repeats, then the median over documents (loads) or items (TTFT). Blend TTFT includes "
        "the loads, pipelined with the recompute. Fidelity: means over items. First-token KL and top-1 are "
        "against full prefill; KL added is the row's KL minus the raw row's (the mean, and the largest on one "
        "item); KL to raw blend compares the blend's first token with the same blend over raw entries.\n\n"
        + table(header, table_rows)
        + f"\n\nTarget: compressed entries >= {TARGET_RATIO:.0f}x smaller with first-token KL added <= "
        f"{TARGET_KL}: {met}."
    )
    write_section(output, "compressed", "Compressed KV on the disk and Redis tiers", command, body)
    print(body)
