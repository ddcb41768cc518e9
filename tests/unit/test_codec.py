"""Compressed KV on the lower tiers (chunk_cache/codec.py): the error bound of each codec, entries at
least 3x smaller, damage and unknown codecs as misses, raw entries still read, the per-tier option,
and a blend from compressed entries on disk that stays close to the same blend over raw entries."""

from __future__ import annotations

import base64
import zlib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kvgate.chunk_cache import (
    ChunkCacheConfig,
    ChunkKV,
    ChunkStore,
    CorruptEntry,
    DiskTier,
    Header,
    LoadFailed,
    Loading,
    MemoryTier,
    fingerprint,
)
from kvgate.chunk_cache import codec as codecs
from kvgate.chunk_cache.codec import CODECS, Quantiser
from kvgate.chunk_cache.redis_tier import RedisTier
from kvgate.gateway.settings import Settings
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.documents import chat_pieces, document_ids
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.reuse import ReuseMode, Reuser
from tests.helpers.entries import chunk, rewritten, same

# A raw entry written by kvgate before codecs existed (2 layers, 1 kv head, 3 tokens, head_dim 2;
# keys = arange(12) / 4, values = -keys, key "old-doc", model "model-a", cost 0.5), zlib + base64.
OLD_RAW_ENTRY = (
    "eNplkU1uwjAQhd1V212PEHltkD3OD7AorCr1DBBFjj0uVYBUJCAhhMQRegRO0uYoPUrHtBVIHeXzaN6bGSXO+w07x54XxRJb40xrioKP9tzWT"
    "ctHXPYTLriv10sTymr7Ylrs2/lmVfVw1a53/S1QQzM3b0j+FESkRKRFBDnJC7PDdRP0GTfKOTQudTYbAhUWUetSDt0AlVNGz7iIZlzq1MOgzBR"
    "kEKe2NKh84tHjEOIsSeMZD3vtHG3VbJa0OTHeQpZJGevSZT4x2SDx4FUpXTmIwVL3sna4oNZz7hlSKtxRXS9cz9Whw7W78+s/aeAHwdu6wlXx6"
    "ppwEX/ecxpfPnSqc5oKl1V732BLnVMpIM5putpej4WVlzEQIJTQAv6PQywUyPxwiChuf34Lu/vN9+w6jo90jBmbEEfiNA4iPR+UP0knjsSJ6"
    "Mj7Cv6EsQciIiTRkfdFsI50IiJk9w1zBIoa"
)


def model_shaped(tokens: int = 100, layers: int = 4) -> ChunkKV:
    """SmolLM2-135M's layout (3 kv heads, head_dim 64), keys with an outlier channel."""
    keys, values = torch.randn(layers, 3, tokens, 64), torch.randn(layers, 3, tokens, 64)
    keys[..., 7] *= 40
    return ChunkKV("doc", list(range(tokens)), keys, values, 1.0, "model-a")


def worst_error(codec: Quantiser, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """The largest |decoded - x| of one layer [2, kv_heads, T, head_dim] through the codec."""
    out = torch.empty(x.shape, dtype=dtype)
    codec.decode(codec.encode(x).numpy().tobytes(), out)
    return float((out.float() - x).abs().max())


# --- the codecs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 300])
def test_each_value_is_within_half_a_step_of_its_channel_range(name: str, tokens: int) -> None:
    codec = CODECS[name]
    x = torch.randn(2, 3, tokens, 64)
    x[0, :, :, 5] *= 50  # an outlier key channel: its range must not widen the others' steps
    out = torch.empty_like(x)
    codec.decode(codec.encode(x).numpy().tobytes(), out)
    chunk_range = x.amax(2, keepdim=True) - x.amin(2, keepdim=True)  # each group's range is within it
    assert bool(((out - x).abs() <= chunk_range / codec.levels / 2 * (1 + 1e-5) + 1e-6).all())


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_group_of_tokens_keeps_its_own_range(name: str) -> None:
    codec = CODECS[name]
    x = torch.randn(2, 3, 3 * codec.group, 64)
    x[:, :, 0] *= 1000  # one huge token in the first group (an attention sink)
    later = x[:, :, codec.group :]
    bound = float((later.amax(2) - later.amin(2)).max()) / codec.levels / 2
    out = torch.empty_like(x)
    codec.decode(codec.encode(x).numpy().tobytes(), out)
    assert float((out[:, :, codec.group :] - later).abs().max()) <= bound * (1 + 1e-5)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_bfloat16_and_an_empty_layer_decode(name: str) -> None:
    codec = CODECS[name]
    x = torch.randn(2, 3, 70, 64).to(torch.bfloat16).float()
    assert worst_error(codec, x, torch.bfloat16) <= float(x.abs().max()) * 2 / codec.levels
    empty = ChunkKV("doc", [], torch.zeros(2, 3, 0, 64), torch.zeros(2, 3, 0, 64))
    assert ChunkKV.from_bytes(empty.to_bytes(name)).tokens == 0


@pytest.mark.parametrize(("name", "at_least"), [("int8", 3.5), ("int4", 5.5)])
def test_compressed_entries_are_at_least_3x_smaller(name: str, at_least: float) -> None:
    entry = model_shaped(tokens=100)  # a short passage: the parameters of its groups weigh the most
    smaller = len(entry.to_bytes()) / len(entry.to_bytes(name))
    assert smaller >= at_least


def test_an_entry_names_its_codec_and_decodes_within_the_bound() -> None:
    entry = model_shaped()
    data = entry.to_bytes("int8")
    header = Header.parse(data[: Header.size_of(data)], "doc", "model-a")
    assert header.codec is CODECS["int8"] and header.dtype == torch.float32
    got = ChunkKV.from_bytes(data, "doc", "model-a")
    assert (got.token_ids, got.cost, got.keys.shape) == (entry.token_ids, entry.cost, entry.keys.shape)
    assert float((got.keys - entry.keys).abs().max()) <= float(entry.keys.abs().max()) * 2 / 255
    assert not torch.equal(got.keys, entry.keys)  # lossy: it is really the codec that was read


def test_raw_entries_are_unchanged_and_old_ones_still_read() -> None:
    keys = torch.arange(12, dtype=torch.float32).view(2, 1, 3, 2) / 4
    old = ChunkKV.from_bytes(zlib.decompress(base64.b64decode(OLD_RAW_ENTRY)), "old-doc", "model-a")
    assert same(old, ChunkKV("old-doc", [7, 8, 9], keys, -keys, 0.5, "model-a"))
    data = old.to_bytes()
    header = Header.parse(data[: Header.size_of(data)])
    assert header.codec is None and b"codec" not in data[: Header.size_of(data)]


# --- the tiers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_damaged_compressed_file_is_a_miss_and_is_deleted(tmp_path: Path, name: str) -> None:
    disk = DiskTier(tmp_path, budget_bytes=1 << 24, codec=name)
    assert disk.put(model_shaped())
    path = disk.path("doc")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside one layer's stored integers
    path.write_bytes(bytes(data))
    assert disk.get("doc") is None and not path.exists()
    assert disk.stats()["corrupt"] == 1


def test_a_damaged_compressed_layer_fails_a_load_midway(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, budget_bytes=1 << 24, codec="int4")
    store = ChunkStore([MemoryTier(0), disk])
    assert disk.put(model_shaped())
    path = disk.path("doc")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10  # the last layer: the header and the first layers are sound
    path.write_bytes(bytes(data))
    loading = store.fetch("doc")
    assert isinstance(loading, Loading)
    loading.layer(0)
    with pytest.raises(LoadFailed):
        loading.result()
    store.close()


def test_a_codec_this_reader_does_not_know_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Written by a kvgate that knows "int7"; read by one that does not.
    monkeypatch.setitem(codecs.CODECS, "int7", Quantiser("int7", 8, 128))
    disk = DiskTier(tmp_path, budget_bytes=1 << 24, codec="int7")
    assert disk.put(model_shaped())
    data = disk.path("doc").read_bytes()
    monkeypatch.delitem(codecs.CODECS, "int7")
    with pytest.raises(CorruptEntry):
        ChunkKV.from_bytes(data)
    assert disk.get("doc") is None and not disk.path("doc").exists()
    assert disk.stats()["corrupt"] == 1


def test_a_codec_named_in_place_of_another_of_the_same_size_fails_the_header_checksum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fake: no two real codecs store layers of one size, so the stored shape alone catches a real swap.
    monkeypatch.setitem(codecs.CODECS, "int8b", Quantiser("int8b", 8, 128))
    data = model_shaped().to_bytes("int8")
    assert ChunkKV.from_bytes(data).keys.shape == model_shaped().keys.shape
    with pytest.raises(CorruptEntry, match="^header checksum mismatch$"):
        ChunkKV.from_bytes(rewritten(data, codec="int8b"))


def test_the_codec_is_an_option_per_tier(tmp_path: Path, redis_url: str) -> None:
    config = ChunkCacheConfig(
        tiers=("memory", "disk", "redis"), disk_dir=tmp_path, redis_url=redis_url, disk_codec="int4", redis_codec="int8"
    )
    store = ChunkStore.from_config(config)
    _, disk, redis = store.tiers
    assert isinstance(disk, DiskTier) and isinstance(redis, RedisTier)
    entry = model_shaped()
    assert disk.put(entry) and redis.put(entry)
    assert disk.stats()["bytes_written"] == len(entry.to_bytes("int4"))
    assert redis.stats()["bytes_written"] == len(entry.to_bytes("int8"))
    for tier in (disk, redis):  # read back layer by layer (disk: its file reader; Redis: ranges), decoded
        got = tier.get("doc")
        assert got is not None and float((got.values - entry.values).abs().max()) < 0.5
    store.close()

    settings = Settings(caches={"disk_codec": "int8", "redis_codec": "int4"})
    assert (settings.chunk_cache_config().disk_codec, settings.chunk_cache_config().redis_codec) == ("int8", "int4")
    assert ChunkCacheConfig().tier_options("disk")["codec"] is None  # raw unless asked
    with pytest.raises(ValidationError):
        Settings(caches={"disk_codec": "zstd"})
    with pytest.raises(ValueError, match="unknown KV codec"):
        DiskTier(tmp_path, budget_bytes=1 << 20, codec="zstd")


def test_a_raw_tier_reads_compressed_entries_and_the_reverse(tmp_path: Path) -> None:
    raw, entry = DiskTier(tmp_path, budget_bytes=1 << 24), chunk(tokens=8)
    assert DiskTier(tmp_path, budget_bytes=1 << 24, codec="int8").put(entry)
    assert raw.get("doc") is not None  # written compressed, read by a tier that writes raw
    assert raw.put(entry) and same(DiskTier(tmp_path, budget_bytes=1 << 24, codec="int8").get("doc"), entry)


# --- a blend over compressed entries ---------------------------------------------------------------

PASSAGES = [
    "The Harwick lighthouse was built in 1887 on a granite spit north of the harbour. Its keeper, Ada Lund, "
    "kept a log of every ship that passed for thirty-one years, and the log is now held by the town museum.",
    "Marrow Bay is a fishing village known for its smoked herring. A ferry leaves for the islands twice a day "
    "in summer and once a day in winter, weather permitting; the crossing takes about forty minutes.",
    "In 1921 a storm destroyed the old pier at Marrow Bay. The new pier, of reinforced concrete, was opened "
    "in 1924 by the mayor, Tomas Berg, who had been a ferry captain before he entered politics.",
]


def first_token_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


# Per codec: the most first-token KL to the same blend over raw entries, and the most KL (to full
# prefill) it may add. int4 adds ~0.006 on average over MuSiQue items (BENCHMARKS.md, "Compressed KV")
# but up to a few hundredths on one short prompt like this one; int8 adds nothing measurable.
BOUNDS = {"int8": (0.001, 0.01), "int4": (0.01, 0.05)}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_blend_from_compressed_disk_entries_stays_close_to_one_from_raw_entries(
    loaded: LoadedModel, tmp_path: Path, name: str
) -> None:
    tok = loaded.tokenizer
    head, tail = chat_pieces(tok, [{"role": "user", "content": "Who opened the new pier at Marrow Bay, and when?"}])
    pieces = [head, *(document_ids(tok, p) for p in PASSAGES), tail]
    documents = [False, True, True, True, False]
    fresh = Reuser(loaded.model, tok, ChunkStore([MemoryTier(0)]), fingerprint("test"), BlendConfig()).new_kv()
    full = forward(loaded.model, [Run(fresh, [t for p in pieces for t in p], 0)])[0]

    def blend(codec: str | None) -> torch.Tensor:
        # A memory tier of 0 bytes: every document is read from the disk tier, decoded layer by layer.
        store = ChunkStore([MemoryTier(0), DiskTier(tmp_path / str(codec), 1 << 30, codec=codec)])
        reuser = Reuser(loaded.model, loaded.tokenizer, store, fingerprint("test"), BlendConfig())
        for ids in (p for p, d in zip(pieces, documents) if d):
            store.tiers[1].put(reuser.document(ids)[0])
        done = reuser.prefill(reuser.new_kv(), pieces, documents, ReuseMode("blend", 0.15))
        disk = store.stats()["tiers"][1]
        store.close()
        assert done.reused > 0 and disk["hits"] == 3 and disk["corrupt"] == 0
        return done.logits

    raw, compressed = blend(None), blend(name)
    assert not torch.equal(raw, compressed)  # the codec's entries were the ones read
    to_raw, added = BOUNDS[name]
    assert first_token_kl(raw, compressed) <= to_raw
    assert first_token_kl(full, compressed) - first_token_kl(full, raw) <= added
