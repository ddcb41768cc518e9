"""runtime/rope.py on small random Llama models of each RoPE type, against transformers' own rotary embedding.

Keys are cached after RoPE, and reusing a document at another offset rotates its cached keys once
more (rope.shift). That is exact only where RoPE is a pure rotation by position times fixed
frequencies: the default, linear and llama3 types. For each of those, keys rotated to positions p
and shifted by delta must equal the keys the model's own rotary embedding gives at p + delta; for
the types rope.py refuses (yarn, dynamic, longrope, proportional), such a shift would be wrong, and
a model of that type must take the documented fallback: full prefill, with a note saying why.

Tolerance: RoPE runs in fp32, and the angle position * frequency is rounded to fp32 (an error of up
to eps/2 of the angle, in radians) once for the direct rotation and twice for the shifted one
(at p, then at delta), 1.5 eps of the largest angle in all, before cos, sin and the rotation add a
few eps more. A key rotated by an angle wrong by e radians moves by at most |k| * e: the two agree to
|k| * eps * (2 * largest angle + 16). Measured: under 7e-5 of the largest key at positions up to 8100,
where the bound is 1.9e-3.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvgate.chunk_cache import ChunkStore, MemoryTier, fingerprint
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.kernels import rope_shift
from kvgate.runtime.kv import KVCache
from kvgate.runtime.model import Run, forward
from kvgate.runtime.reuse import ReuseMode, Reuser
from kvgate.runtime.rope import SHIFTABLE, angles, can_shift, rope_type, shift
from kvgate.runtime.spans import Spans

EPS = torch.finfo(torch.float32).eps
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=8192,
)
# Llama 3's bands, for theta 5e5 and head_dim 16 (wavelengths 6, 33, 170, 873, 4.5k, 23k, 120k, 650k):
# under 1024 / 4 = 256 kept, over 1024 / 1 divided by 8, and the one between (873) smoothly in between.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}  # fmt: skip
SHIFTING: dict[str, dict] = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    "llama3": LLAMA3,
}
# Why each cannot shift: yarn and longrope scale cos and sin by an attention factor (a rotation by delta
# would scale the keys once more), dynamic and longrope change their frequencies with the sequence's length;
# proportional is a pure rotation, but rope.py does not list it (no supported family uses it).
NOT_SHIFTING: dict[str, dict] = {
    "yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 2048},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                 "factor": 4.0, "original_max_position_embeddings": 64},
    "proportional": {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
}  # fmt: skip
# Positions of the cached keys: both sides of llama3's original 1024 and well past it.
POSITIONS = torch.tensor([0, 1, 2, 7, 63, 64, 255, 256, 1023, 1024, 1500, 2047, 3000, 4095])
DELTAS = (1, 5, 64, 700, 1024, 4000, -1, -5, -64, -700, -1024, -4000)


def build(rope_parameters: dict, layers: int = 2) -> PreTrainedModel:
    """A small randomly initialised Llama with these RoPE parameters (transformers 5 spells them
    `rope_parameters`, with rope_theta inside; the older `rope_scaling` is read into the same place)."""
    config = LlamaConfig(**{**SMALL, "num_hidden_layers": layers}, rope_parameters=dict(rope_parameters))
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def raw_keys(model: PreTrainedModel, n: int) -> torch.Tensor:
    """Layer 0's keys of n random tokens before RoPE: [kv_heads, n, head_dim]."""
    ids = torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(1))
    layer = model.model.layers[0]
    with torch.inference_mode():
        k = layer.self_attn.k_proj(layer.input_layernorm(model.model.embed_tokens(ids)))
    return k.view(n, SMALL["num_key_value_heads"], SMALL["head_dim"]).transpose(0, 1)


def rotated(model: PreTrainedModel, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`keys` [kv_heads, T, head_dim] at `positions` [T], as transformers' Llama attention rotates them."""
    with torch.inference_mode():
        cos, sin = model.model.rotary_emb(keys, positions[None])
        return apply_rotary_pos_emb(keys[None], keys[None], cos, sin)[1][0]


def tolerance(keys: torch.Tensor, model: PreTrainedModel, largest_position: int) -> float:
    largest_angle = largest_position * float(model.model.rotary_emb.inv_freq.max())
    return float(keys.abs().max()) * EPS * (2 * largest_angle + 16)


def test_every_rope_type_transformers_knows_is_either_shifted_or_refused() -> None:
    """A rope type added to transformers must be looked at before a model of it is served."""
    assert SHIFTABLE == set(SHIFTING)
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(SHIFTING) | set(NOT_SHIFTING)


@pytest.mark.parametrize("name", [*SHIFTING, *NOT_SHIFTING])
def test_the_rope_type_is_read_from_either_spelling_of_the_config(name: str) -> None:
    params = {**SHIFTING, **NOT_SHIFTING}[name]
    model = build(params, layers=1)
    assert rope_type(model) == name and can_shift(model) == (name in SHIFTING)
    # transformers <5 kept the scaling in `rope_scaling` (with "type" in older files) and theta beside it.
    legacy = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
    old = LlamaConfig(**SMALL, rope_theta=params["rope_theta"], rope_scaling={"type": name, **legacy})
    assert old.rope_parameters["rope_type"] == name
    assert rope_type(LlamaForCausalLM(old)) == name


def test_llama3_config_here_has_all_three_frequency_bands() -> None:
    """Otherwise llama3 could pass below while treated as linear, or as default."""
    plain = build({"rope_type": "default", "rope_theta": LLAMA3["rope_theta"]}, layers=1).model.rotary_emb.inv_freq
    ratio = build(LLAMA3, layers=1).model.rotary_emb.inv_freq / plain
    kept, divided = torch.isclose(ratio, torch.tensor(1.0)), torch.isclose(ratio, torch.tensor(1 / LLAMA3["factor"]))
    assert kept.sum() == 3 and divided.sum() == 4 and not (kept | divided)[3]


@pytest.mark.parametrize("name", list(SHIFTING))
def test_shifted_keys_equal_the_models_rotation_at_the_new_positions(name: str) -> None:
    model = build(SHIFTING[name], layers=1)
    assert can_shift(model)
    keys = raw_keys(model, len(POSITIONS))
    worst = 0.0
    for delta in DELTAS:
        p = POSITIONS + max(0, -delta)  # cached at p >= 0, moved to p + delta >= 0
        cached, direct = rotated(model, keys, p), rotated(model, keys, p + delta)
        moved = shift(model, cached, delta)
        error = float((moved - direct).abs().max())
        assert error <= tolerance(keys, model, int((p + delta).max())), (name, delta, error)
        # Not vacuous: the keys did need to move, in every band (the lowest frequencies only move far).
        assert (cached - direct).abs().max() > 0.1 * keys.abs().max()
        worst = max(worst, error / float(keys.abs().max()))
    # Back where they came from, and by two shifts as by their sum.
    cached = rotated(model, keys, POSITIONS + 4000)
    assert (shift(model, shift(model, cached, -4000), 4000) - cached).abs().max() <= tolerance(keys, model, 8000)
    twice, once = shift(model, shift(model, cached, 1500), -700), shift(model, cached, 800)
    assert (twice - once).abs().max() <= tolerance(keys, model, 6000)
    print(f"{name}: largest error {worst:.2e} of the largest key")


@pytest.mark.parametrize("name", list(SHIFTING))
def test_kvgate_forward_keys_moved_back_and_forth_equal_keys_computed_there(name: str) -> None:
    """Layer 0's keys depend only on each token and its position: a document's keys computed after
    a prefix, moved to another prefix's end (as runtime/spans.py's `local` moves them to 0), are the
    keys computed there."""
    model = build(SHIFTING[name])
    doc = torch.randint(0, SMALL["vocab_size"], (9,), generator=torch.Generator().manual_seed(2)).tolist()

    def layer0(prefix: int) -> torch.Tensor:
        kv = KVCache(SMALL["num_hidden_layers"], SMALL["num_key_value_heads"], SMALL["head_dim"], model.dtype, "cpu")
        forward(model, [Run(kv, [3] * prefix + doc, 0)])
        return kv.layer(0)[0][:, prefix : len(kv)]

    keys = {prefix: layer0(prefix) for prefix in (0, 40, 1500)}  # 1500: past llama3's original 1024
    scale = max(float(k.abs().max()) for k in keys.values())
    for start, end in ((1500, 0), (1500, 40), (40, 0), (0, 1500), (40, 1500)):
        moved = shift(model, keys[start], end - start)
        assert (moved - keys[end]).abs().max() <= scale * EPS * (2 * 1510 + 16), (start, end)
        assert (keys[start] - keys[end]).abs().max() > 0.1 * scale


@pytest.mark.parametrize("name", list(NOT_SHIFTING))
def test_a_rotation_by_the_shift_would_misplace_keys_of_types_that_cannot_shift(name: str) -> None:
    model = build(NOT_SHIFTING[name], layers=1)
    assert not can_shift(model)
    with pytest.raises(ValueError, match=f"rope type '{name}' does not allow shifting"):
        angles(model, 3, torch.device("cpu"))
    if name == "proportional":
        return  # a pure rotation: refused only because no supported family uses it
    # From short of 64 (longrope's original length) to past 8192 (dynamic's maximum).
    keys, p, delta = raw_keys(model, 8), torch.arange(8), 9000
    cached = rotated(model, keys, p)
    with torch.inference_mode():  # what rope.shift would do, were the type allowed
        cos, sin = model.model.rotary_emb(keys, torch.tensor([[delta]]))
    moved = rope_shift(cached, cos[0, 0], sin[0, 0])
    assert (moved - rotated(model, keys, p + delta)).abs().max() > 1e-3 * keys.abs().max()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Words w0..w255, one token each."""
    vocab = {f"w{i}": i for i in range(SMALL["vocab_size"])}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


@pytest.mark.parametrize("name", ["yarn", "dynamic", "longrope"])
def test_a_model_whose_rope_cannot_shift_falls_back_to_full_prefill(name: str) -> None:
    model = build(NOT_SHIFTING[name])
    store = ChunkStore([MemoryTier(1 << 24)])
    reuser = Reuser(model, tiny_tokenizer(), store, fingerprint(name), BlendConfig())
    assert not reuser.shiftable
    note = f"rope type {name} cannot shift cached keys"
    head, doc, tail = [1, 2, 3], list(range(10, 90)), [4, 5]  # 85 tokens: past longrope's 64
    for mode in ("blend", "naive"):
        kv = reuser.new_kv()
        done = reuser.prefill(kv, [head, doc, tail], [False, True, False], ReuseMode(mode))
        # Nothing reused, nothing computed: the caller prefills the whole prompt from len(kv) = 0.
        assert (done.mode, done.logits, done.reused, done.note) == ("full", None, 0, note)
        assert len(kv) == 0 and reuser.key(doc) not in store  # no document computed, none stored
    prompt = head + doc + tail
    with torch.inference_mode():
        reference = model(torch.tensor([prompt])).logits[0]
    assert torch.allclose(forward(model, [Run(kv, prompt, 0)], every=True), reference, atol=1e-5)

    # Spans (runtime/spans.py): after the exact prefix the cache holds, the rest is left to the caller too.
    spans = Spans(reuser)
    kv = reuser.new_kv()
    forward(model, [Run(kv, head, 0)])
    shared = spans.prefill(kv, [head, doc, tail], [False, True, False], "naive", "reader", "", 0.0)
    assert (shared.prefilled.mode, shared.prefilled.logits, shared.prefilled.note) == ("full", None, note)
    assert shared.prefilled.reused == len(head) == len(kv) and shared.spans == []
    # The fallback's dense prefill computes what transformers computes continuing its own cache (for
    # longrope and dynamic, not what one pass over the whole prompt gives: their frequencies depend on
    # the length of each call, here 3 tokens, then 88), and the answer is not kept as a span.
    logits = forward(model, [Run(kv, doc + tail, len(kv))], every=True)
    with torch.inference_mode():
        cache = model(torch.tensor([head]), use_cache=True).cache
        reference = model(torch.tensor([doc + tail]), cache=cache).logits[0]
    assert torch.allclose(logits, reference, atol=1e-5)
    answer = [7, 8, 9]
    forward(model, [Run(kv, answer, len(kv))])
    spans.wrote(kv, len(head + doc + tail), answer, "w7 w8 w9", "reader", "")
    assert spans.key(answer, "") not in store and not spans.slots
