"""The blend's parts, one at a time: where reused KV is placed, which tokens are recomputed, and the
attention the question pays each token (runtime/blend.py's `place`, `choose`, `first_tokens`,
`question_attention`). tests/unit/test_blend.py checks what they add up to against full prefill."""

from __future__ import annotations

import pytest
import torch

from kvgate.chunk_cache import ChunkKV
from kvgate.runtime.blend import BlendConfig, Piece, Shift, choose, first_tokens, place, question_attention
from kvgate.runtime.kernels import rope_shift
from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import project
from kvgate.runtime.rope import angles
from kvgate.runtime.weights import Layer, decoder_of

T, F = True, False


def picked(deviation: list[float], reused: list[bool], keep: int, forced: list[bool] | None = None, **config):
    forced_mask = torch.tensor(forced or [F] * len(reused))
    return choose(torch.tensor(deviation), torch.tensor(reused), keep, forced_mask, BlendConfig(**config)).tolist()


def test_choose_keeps_every_fresh_token_and_the_reused_ones_that_deviate_most() -> None:
    deviation, reused = [0.1, 0.9, 0.5, 0.3, 0.7, 0.2], [T, T, T, T, F, F]
    # Fresh tokens 4 and 5 always; of the reused, the two that deviate most (1, 2), never fresh 4's 0.7 in their place.
    assert picked(deviation, reused, 2) == [1, 2, 4, 5]
    assert picked(deviation, reused, 1) == [1, 4, 5]
    assert picked(deviation, reused, 0) == [4, 5]
    assert picked(deviation, reused, 9) == [0, 1, 2, 3, 4, 5]  # more than there are: all of them
    assert picked(deviation, reused, 1, forced=[T, F, F, F, F, F]) == [0, 1, 4, 5]  # forced ones on top of the keep
    assert picked([0.4, 0.1, 0.8], [T, T, T], 1) == [2]  # no fresh token: only the keep
    scores = torch.tensor(deviation)
    choose(scores, torch.tensor(reused), 2, torch.zeros(6, dtype=torch.bool), BlendConfig())
    assert torch.equal(scores, torch.tensor(deviation))  # the caller's scores are left as they were


def test_random_selection_ignores_the_deviation_and_follows_its_seed() -> None:
    reused = [T] * 64 + [F] * 4
    rising = [i / 64 for i in range(68)]  # deviation would pick the last reused ones
    one, again = picked(rising, reused, 8, select="random", seed=1), picked(rising, reused, 8, select="random", seed=1)
    other = picked(rising, reused, 8, select="random", seed=2)
    assert one == again and one != other
    assert len(one) == 12 and one[-4:] == [64, 65, 66, 67]  # the keep plus every fresh token
    assert one[:8] != list(range(56, 64))  # not the deviation's choice
    assert picked(rising, reused, 8) == list(range(56, 68))


def test_first_tokens_marks_the_first_k_of_each_reused_piece_only() -> None:
    pieces = [Piece([1] * 5, cached=object()), Piece([2] * 3), Piece([3] * 2, cached=object())]  # type: ignore[arg-type]
    mask = first_tokens(pieces, 3)
    assert mask.dtype == torch.bool  # a mask, or-ed with the fresh tokens and indexed by the selection
    assert mask.tolist() == [T, T, T, F, F, F, F, F, T, T]
    assert first_tokens(pieces, 0).tolist() == [F] * 10


# float32: the CPU kernel writes (runtime/cpu_place.c); float16, which it does not take: torch's ops, block by block.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_place_writes_each_reused_piece_at_its_offset_with_its_keys_shifted_there(
    loaded: LoadedModel, dtype: torch.dtype
) -> None:
    model = loaded.model
    layers, kv_heads, head_dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    gen = torch.Generator().manual_seed(0)

    def entry(n: int) -> ChunkKV:
        shape = (layers, kv_heads, n, head_dim)
        keys, values = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
        return ChunkKV("k", tuple(range(n)), keys, values, model="m")

    first, second = entry(4), entry(70)  # the second across a block's end
    pieces = [Piece([0] * 4, first), Piece([0] * 2), Piece([0] * 70, second)]
    start = 5  # after an exact prefix of five tokens
    kv = KVCache(layers, kv_heads, head_dim, dtype, torch.device("cpu"))
    kv.extend(*(torch.zeros(layers, kv_heads, start + 76, head_dim, dtype=dtype) for _ in "kv"))
    shift = Shift.of(model, pieces, start, torch.device("cpu"))
    assert shift is not None and (shift.begin, shift.end) == (5, 81)  # from the first reused row to the last
    cpu = torch.device("cpu")
    assert torch.allclose(shift.cos[:4], angles(model, 5, cpu)[0].expand(4, -1), atol=1e-6)
    assert torch.allclose(shift.sin[6:], angles(model, 11, cpu)[1].expand(70, -1), atol=1e-6)
    place(kv, 2, pieces, start, shift)
    keys, values = kv.layer(2)
    assert torch.equal(keys[:, 5:9], rope_shift(first.keys[2], shift.cos[:4], shift.sin[:4]))
    assert torch.equal(values[:, 5:9], first.values[2])
    assert torch.equal(values[:, 11:81], second.values[2])
    assert torch.equal(keys[:, 11:81], rope_shift(second.keys[2], shift.cos[6:], shift.sin[6:]))
    assert not keys[:, :5].any() and not keys[:, 9:11].any() and not values[:, 9:11].any()  # prefix and fresh rows
    assert not kv.layer(1)[0].any() and not kv.layer(3)[0].any()  # one layer at a time
    # Nothing moves (a piece reused where it was cached): no shift, the cached keys as they are.
    assert Shift.of(model, [Piece([0] * 3, second), Piece([0] * 2)], 0, cpu) is None
    place(kv, 3, pieces, start, None)
    assert torch.equal(kv.layer(3)[0][:, 11:81], second.keys[3])


def test_place_moves_a_tier_s_keys_to_the_cache_s_device_before_shifting_them(loaded: LoadedModel) -> None:
    # An entry read from a CPU tier into a cache on another device (CUDA on a GPU; "meta" here, where
    # an operation mixing it with a CPU tensor fails as CUDA would) is moved before its keys are shifted.
    model, meta = loaded.model, torch.device("meta")
    layers, kv_heads, head_dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    shape = (layers, kv_heads, 4, head_dim)
    cached = ChunkKV("k", tuple(range(4)), torch.randn(shape), torch.randn(shape), model="m")
    kv = KVCache(layers, kv_heads, head_dim, torch.float32, meta)
    kv.reserve(9)
    pieces = [Piece([0] * 4, cached)]
    place(kv, 0, pieces, 5, Shift.of(model, pieces, 5, meta))
    assert kv.blocks[0].keys.device == meta


def reference_attention(layer: Layer, h, cos, sin, rows: list[int]) -> torch.Tensor:
    """Softmax attention of each question row over the tokens up to it, per head, averaged: written out."""
    q, k, _ = project(layer, h, cos, sin)  # [n, heads, d], [n, kv_heads, d]
    group = q.shape[1] // k.shape[1]
    total = torch.zeros(len(h))
    for r in rows:
        for head in range(q.shape[1]):
            scores = (k[: r + 1, head // group] @ q[r, head]) * layer.scale
            total[: r + 1] += scores.float().softmax(0)
    return total / (len(rows) * q.shape[1])


@pytest.mark.parametrize(
    ("reused", "question"),
    [
        ([T] * 6 + [F] * 4, [6, 7, 8, 9]),  # a document, then the question
        ([F, F, T, T, T, F, F, T, F, F], [8, 9]),  # head, document, fresh text, document, question
        ([F] * 5, [0, 1, 2, 3, 4]),  # nothing reused: every token asks
        ([F, T, T, T], [3]),  # a document last: its last token stands for the question
    ],
)
def test_question_attention_is_what_the_question_pays_each_token(
    loaded: LoadedModel, reused: list[bool], question: list[int]
) -> None:
    inner = loaded.model.model
    layer = decoder_of(loaded.model).layers[1]
    text = "Where does the ferry from Vellmoor stop at night?"
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"][: len(reused)])
    with torch.inference_mode():
        noise = torch.randn(len(ids), inner.embed_tokens.embedding_dim, generator=torch.Generator().manual_seed(0))
        h = inner.embed_tokens(ids) + 0.1 * noise
        cos, sin = (t[0] for t in inner.rotary_emb(h[None], torch.arange(len(ids))[None]))
        keys = project(layer, h, cos, sin)[1].transpose(0, 1)
        got = question_attention(layer, h, keys, cos, sin, torch.tensor(reused))
        want = reference_attention(layer, h, cos, sin, question)
    assert got.shape == (len(reused),)
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert got.sum().item() == pytest.approx(1.0, abs=1e-5)
