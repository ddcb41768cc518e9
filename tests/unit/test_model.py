"""runtime/model.py: the own layer loop computes what transformers computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import MERGED_ROWS, Run, attend, forward
from tests.conftest import QUESTIONS
from tests.helpers.kv import new_kv


def greedy(loaded: LoadedModel, ids: list[int], n: int) -> list[int]:
    kv, out = new_kv(loaded), []
    logits = forward(loaded.model, [Run(kv, ids, 0)])
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        if out[-1] in loaded.eos_token_ids:
            break
        logits = forward(loaded.model, [Run(kv, out[-1:], len(kv))])
    return out


def test_greedy_equals_transformers_generate(loaded: LoadedModel, chat_ids) -> None:
    prompts = [chat_ids(QUESTIONS[0]), chat_ids(QUESTIONS[2]), loaded.tokenizer.encode("Once upon a time, in a")]
    for ids in prompts:
        ref = loaded.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :]
        ref = ref.tolist()
        ours = greedy(loaded, ids, 24)
        assert ours == ref[: len(ours)]
        assert len(ours) == len(ref) or ours[-1] in loaded.eos_token_ids


def test_logits_match_model_forward(loaded: LoadedModel, chat_ids) -> None:
    ids = chat_ids(QUESTIONS[3])
    with torch.inference_mode():
        ref = loaded.model(torch.tensor([ids])).logits[0, -1]
    ours = forward(loaded.model, [Run(new_kv(loaded), ids, 0)])[0]
    assert torch.allclose(ours, ref, atol=1e-4)


def test_chunked_prefill_equals_one_pass(loaded: LoadedModel, chat_ids) -> None:
    ids = chat_ids(QUESTIONS[4] + " " + QUESTIONS[5])
    whole = forward(loaded.model, [Run(new_kv(loaded), ids, 0)])[0]
    kv = new_kv(loaded)
    for start in range(0, len(ids), 7):
        last = forward(loaded.model, [Run(kv, ids[start : start + 7], start)])[0]
    assert len(kv) == len(ids)
    assert torch.allclose(whole, last, atol=1e-4)


def test_ragged_batch_equals_each_alone(loaded: LoadedModel, chat_ids) -> None:
    prompts = [chat_ids(q) for q in QUESTIONS[:3]]
    alone = torch.cat([forward(loaded.model, [Run(new_kv(loaded), ids, 0)]) for ids in prompts])
    # Mixed step: two sequences mid-prefill next to a fresh one.
    kvs = [new_kv(loaded) for _ in prompts]
    forward(loaded.model, [Run(kvs[0], prompts[0][:5], 0), Run(kvs[1], prompts[1][:9], 0)])
    together = forward(
        loaded.model,
        [Run(kvs[0], prompts[0][5:], 5), Run(kvs[1], prompts[1][9:], 9), Run(kvs[2], prompts[2], 0)],
    )
    assert torch.allclose(alone, together, atol=1e-4)
    assert torch.equal(alone.argmax(-1), together.argmax(-1))


def test_kv_grows_and_keeps_rows(loaded: LoadedModel) -> None:
    kv = KVCache(2, 3, 4, torch.float32, "cpu")
    rows = [torch.randn(3, 1, 4) for _ in range(40)]
    for r in rows:
        for layer in range(2):
            kv.append(layer, r, -r)
    keys, values = kv.layer(1)
    assert len(kv) == 40 and keys.shape == (3, 40, 4)
    assert torch.equal(keys, torch.cat(rows, dim=1)) and torch.equal(values, -keys)
    assert kv.nbytes == 2 * 2 * 3 * 4 * 40 * 4


@pytest.mark.parametrize(("rows", "cached"), [(MERGED_ROWS, 3), (MERGED_ROWS + 37, 400), (5, 100)])
def test_rows_after_cached_keys_attend_as_masked_attention_does(rows: int, cached: int) -> None:
    """Many rows after a cached prefix take two flash kernels merged by their log-sum-exp (the masked kernel is
    half as fast on CPU); few take the masked one. Either is causal attention over the whole KV."""
    torch.manual_seed(0)
    q, k, v = torch.randn(9, rows, 64), torch.randn(3, cached + rows, 64), torch.randn(3, cached + rows, 64)
    mask = torch.arange(cached + rows)[None, :] <= torch.arange(cached, cached + rows)[:, None]
    truth = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=0.125, enable_gqa=True)
    assert torch.allclose(attend(q, k, v, 0.125), truth[0], atol=1e-5)


def test_a_long_prompt_after_a_cached_prefix_gives_full_prefills_logits(loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode(" ".join(f"Line {i} of the report says the value was {i * 7}." for i in range(60)))
    assert len(ids) - 64 >= MERGED_ROWS  # the merged kernels' case
    whole = forward(loaded.model, [Run(new_kv(loaded), ids, 0)])[0]
    kv = new_kv(loaded)
    forward(loaded.model, [Run(kv, ids[:64], 0)])
    after = forward(loaded.model, [Run(kv, ids[64:], 64)])[0]
    assert torch.allclose(after, whole, atol=1e-3) and int(after.argmax()) == int(whole.argmax())
