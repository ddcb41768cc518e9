"""Exact reuse is exact: a prompt continued from stored KV computes, bit for bit, what its whole prefill
computes, in float32 and in bfloat16, however the step splits it (runtime/model.py, invariance.py); KV that
is not full prefill's own (decoded rows, a lossy codec's read-back) is never called exact (runtime/caching.py).

A tiny random-weight Llama makes bf16 cheap on a CPU without native bf16, and its near-flat distributions turn
any difference in the last bit into another logprob."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvgate.chunk_cache import ChunkKV
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.engine import Engine
from kvgate.runtime.invariance import probe_floor
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.request import Plan, Request, Result
from kvgate.runtime.reuse import ReuseMode
from kvgate.runtime.reuse_report import Fidelity
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.weights import Linear


def tiny_engine(loaded: LoadedModel, where: Path, dtype: torch.dtype, deterministic: bool = False) -> Engine:
    torch.manual_seed(0)
    vocab = len(loaded.tokenizer)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=vocab, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(where)
    tiny = LoadedModel(model, loaded.tokenizer, "tiny", where, loaded.eos_token_ids)
    # A step of 128 tokens: a 300-token prompt is prefilled in three chunks, beside another sequence's decode.
    config = EngineConfig(
        dtype=str(dtype)[6:], cache_dir=where / "cache", max_num_batched_tokens=128, deterministic=deterministic
    )
    return Engine(config, tiny)


def ask(engine: Engine, prompts: list[tuple[list[int], Plan | None]], tokens: int = 8) -> list[Result]:
    """The prompts at once (their steps shared), greedy, with the chosen tokens' logprobs."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=0)

    async def one(ids: list[int], plan: Plan | None) -> Result:
        result = Result()
        async for out in engine.generate(Request(ids, params, plan)):
            result.add(out)
        return result

    async def every() -> list[Result]:
        return list(await asyncio.gather(*(one(ids, plan) for ids, plan in prompts)))

    return asyncio.run(every())


def logprobs(result: Result) -> list[float]:
    return [p.logprob for p in result.logprobs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_continued_from_its_prefix_blocks_is_its_full_prefill_bit_for_bit(
    loaded: LoadedModel, tmp_path: Path, dtype: torch.dtype
) -> None:
    engine = tiny_engine(loaded, tmp_path, dtype)
    try:
        rng = random.Random(0)
        system = [rng.randrange(100, 40000) for _ in range(200)]
        first, second = system + [11, 12, 13], system + [rng.randrange(100, 40000) for _ in range(100)]
        other = [rng.randrange(100, 40000) for _ in range(50)]
        ask(engine, [(first, None)])  # leaves the system prompt's blocks
        full = Plan([second], [False], ReuseMode("full"))
        beside, _ = ask(engine, [(second, None), (other, None)])  # prefilled beside another sequence's steps
        (truth,) = ask(engine, [(second, full)])  # alone, and in one chunk fewer
        (reused,) = ask(engine, [(second, None)])
        # read to a multiple of the grid: 64, or 1 where the CPU kernel attends (runtime/model.py grid_of)
        grid = engine.scheduler.grid
        assert beside.report.reused == 200 - 200 % grid  # 200 shared
        assert reused.report.reused == 299 - 299 % grid  # its own blocks now, up to its last token
        assert beside.report.fidelity == reused.report.fidelity == Fidelity("exact") and truth.report.reused == 0
        assert logprobs(beside)[0] == logprobs(truth)[0]  # the first token, bit for bit, whatever the step held
        assert reused.token_ids == truth.token_ids
        assert logprobs(reused) == logprobs(truth)  # every logprob, bit for bit
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_decode_steps_do_not_depend_on_the_batch(
    loaded: LoadedModel, tmp_path: Path, dtype: torch.dtype
) -> None:
    engine = tiny_engine(loaded, tmp_path, dtype, deterministic=True)
    try:
        rng = random.Random(2)
        one, two, three = ([rng.randrange(100, 40000) for _ in range(40)] for _ in range(3))
        together = ask(engine, [(one, None), (two, None), (three, None)], tokens=12)
        alone = [
            ask(engine, [(ids, Plan([ids], [False], ReuseMode("full")))], tokens=12)[0] for ids in (one, two, three)
        ]
        assert [logprobs(r) for r in together] == [logprobs(r) for r in alone]
    finally:
        engine.shutdown()


def test_kv_a_decode_computed_is_read_again_but_not_called_exact(loaded: LoadedModel, tmp_path: Path) -> None:
    engine = tiny_engine(loaded, tmp_path, torch.float32)
    try:
        rng = random.Random(1)
        prompt = [rng.randrange(100, 40000) for _ in range(120)]
        (turn,) = ask(engine, [(prompt, None)], tokens=80)  # its answer's blocks are kept, decoded
        (next_turn,) = ask(engine, [(prompt + turn.token_ids + [5, 6, 7], None)])
        assert next_turn.report.reused > len(prompt)  # the answer's KV was read
        assert next_turn.report.fidelity is not None and next_turn.report.fidelity.kind == "numerics"
        assert next_turn.report.fidelity.lossy_rows > 0
        (same_prompt,) = ask(engine, [(prompt, None)])
        assert same_prompt.report.fidelity == Fidelity("exact")  # the prompt's own blocks are
    finally:
        engine.shutdown()


def test_an_entry_says_which_rows_are_full_prefill_and_a_lossy_read_back_has_none() -> None:
    keys = torch.randn(2, 1, 5, 4)
    entry = ChunkKV("k", (1, 2, 3, 4, 5), keys, keys.clone(), 1.0, "m", exact=3)
    assert ChunkKV.from_bytes(entry.to_bytes()).exact == 3
    assert ChunkKV.from_bytes(ChunkKV("k", (1, 2, 3, 4, 5), keys, keys, 1.0, "m").to_bytes()).exact_rows == 5
    assert ChunkKV.from_bytes(entry.to_bytes("int8")).exact_rows == 0
    with pytest.raises(ValueError):
        ChunkKV("k", (1, 2), keys[:, :, :2], keys[:, :, :2], exact=3)


def test_the_row_floor_is_where_a_linear_computes_each_row_as_among_many() -> None:
    dense = torch.nn.Linear(64, 48)
    linear = Linear(dense.weight, dense.bias)  # as the engine computes it (oneDNN's, prepacked, on CPU)
    with torch.inference_mode():
        floor = probe_floor([linear])
        x = torch.randn(256, 64)
        whole = linear(x)
        assert all(torch.equal(linear(x[:m]), whole[:m]) for m in range(floor, 65))
