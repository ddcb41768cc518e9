"""The runtime on a CUDA device computes what it computes on the CPU: each family's logits and KV, the
engine's greedy tokens (chunked prefill, prefix blocks), blend over document KV read back from disk (where
the Triton kernels run), and bf16 where the GPU has it. Skipped without a CUDA device."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kvgate.agents.anchors import AnchorConfig, AnchorPool
from kvgate.chunk_cache import ChunkStore, DiskTier, MemoryTier, fingerprint
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.decode import Batches
from kvgate.runtime.documents import message_pieces
from kvgate.runtime.engine import Engine
from kvgate.runtime.grammar import json_grammar
from kvgate.runtime.loader import load
from kvgate.runtime.model import Run, forward
from kvgate.runtime.paged_batch import TableBatch
from kvgate.runtime.quality import QualityConfig
from kvgate.runtime.request import Plan
from kvgate.runtime.reuse import ReuseMode, Reuser
from kvgate.runtime.sampling import SamplingParams
from kvgate.runtime.spans import Spans
from kvgate.runtime.tokens import chat_prompt
from tests.unit.test_families import FAMILIES, build, new_kv, prompt, saved

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ATOL = 1e-4  # cuBLAS and the CPU add up in other orders (TF32 stays off, torch's default)
LONG = "Call the weather tool for Paris, then for Lyon, and say which city is warmer today. " * 6


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_decode_and_a_ragged_batch_on_cuda_equal_the_cpu(name: str) -> None:
    cpu = build(FAMILIES[name])
    gpu = copy.deepcopy(cpu).to("cuda")
    a, b = prompt(30, seed=2), prompt(12, seed=3)
    got, want = [], []
    for model, rows in ((cpu, want), (gpu, got)):
        kv_a, kv_b = new_kv(model), new_kv(model)
        rows.append(forward(model, [Run(kv_a, a[:20], 0)], every=True))
        rows.append(forward(model, [Run(kv_a, a[20:], 20), Run(kv_b, b, 0)], every=True))
        rows.append(forward(model, [Run(kv_a, [7], 30)]))  # a decode step
        rows.extend(kv_a.layer(len(kv_a.lengths) - 1, 31))
    assert got[0].device.type == "cuda"
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_replayed_from_cuda_graphs_equal_eager_ones_across_batches(dtype: torch.dtype) -> None:
    """A batch's step is captured once and replayed, also for a later batch of the same shape (other sequences,
    other lengths); another shape is captured anew."""
    model = build(FAMILIES["llama"]).to("cuda", dtype)
    seen = {}
    for graphs in (False, True):
        batches, logits = Batches(graphs=graphs), []
        kvs = [new_kv(model) for _ in range(4)]
        for kv, n in zip(kvs, (30, 12, 45, 7)):
            forward(model, [Run(kv, prompt(n, seed=n), 0)])
        for group in (kvs[:2], kvs[2:], kvs[:3]):  # the second batch has the first's shape; the third its own
            for t in range(3):
                logits.append(forward(model, [Run(kv, [t + 5], len(kv)) for kv in group], pad=False, batches=batches))
        seen[graphs] = torch.cat(logits).float().cpu()
        if graphs:
            assert len(batches.captured.captured) == 2
    torch.testing.assert_close(seen[True], seen[False], rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("name", ["llama", "mistral-window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_steps_equal_the_copy_batchs_and_replay_from_cuda_graphs(name: str, dtype: torch.dtype) -> None:
    """Over each sequence's blocks where they lie (TableBatch, runtime/paged_kernel.py): the logits and KV of the
    copy batch's steps, a sequence crossing into a new block, batches changing, a sliding window; replayed from
    CUDA graphs as eager, one graph per table shape (the second batch has the first's)."""
    model = build(FAMILIES[name]).to("cuda", dtype)
    seen, kv_seen = {}, {}
    for way, paged, graphs in (("copy", False, False), ("paged", True, False), ("paged, graphs", True, True)):
        batches, logits = Batches(graphs=graphs, paged=paged), []
        kvs = [new_kv(model) for _ in range(4)]
        for kv, n in zip(kvs, (60, 12, 45, 7)):
            forward(model, [Run(kv, prompt(n, seed=n), 0)])
        for group in (kvs[:2], kvs[2:], kvs[:3]):  # the first sequence's rows 63, 64, 65 in the third batch
            for t in range(3):
                logits.append(forward(model, [Run(kv, [t + 5], len(kv)) for kv in group], pad=False, batches=batches))
        seen[way], kv_seen[way] = torch.cat(logits).float().cpu(), [kv.rows(0, len(kv))[0].float().cpu() for kv in kvs]
        assert isinstance(batches.last, TableBatch) == paged
        if graphs:
            assert len(batches.captured.captured) == 2
    copy_atol = 1e-4 if dtype == torch.float32 else 5e-2  # other splits, merged in another order
    torch.testing.assert_close(seen["paged"], seen["copy"], rtol=0, atol=copy_atol)
    for got, want in zip(kv_seen["paged"], kv_seen["copy"]):
        torch.testing.assert_close(got, want, rtol=0, atol=copy_atol)
    graph_atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(seen["paged, graphs"], seen["paged"], rtol=0, atol=graph_atol)


def test_the_engine_on_cuda_decodes_paged_like_generate_on_the_cpu(tmp_path: Path) -> None:
    """engine.decode_batch paged: the engine's greedy tokens, over a prompt of several blocks read again from its
    prefix blocks, are transformers' on the CPU."""
    model = saved(FAMILIES["llama"], tmp_path / "model")
    config = EngineConfig(model=str(tmp_path / "model"), cache_dir=tmp_path / "cache", device="cuda",
                          dtype="float32", decode_batch="paged")  # fmt: skip
    engine = Engine(config)
    try:
        ids = chat_prompt(engine.tokenizer, [{"role": "user", "content": LONG}])
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids) :].tolist()
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        first, again = engine.generate_sync(ids, params), engine.generate_sync(ids, params)
        assert isinstance(engine.batches.last, TableBatch)
    finally:
        engine.shutdown()
    assert first.token_ids == ref == again.token_ids and again.report.reused >= 128


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_engine_on_cuda_decodes_like_generate_on_the_cpu(name: str, tmp_path: Path) -> None:
    model = saved(FAMILIES[name], tmp_path / "model")
    # 32 prompt tokens a step: the prompt is prefilled in chunks; the second run reads its prefix blocks.
    config = EngineConfig(model=str(tmp_path / "model"), cache_dir=tmp_path / "cache", device="cuda",
                          dtype="float32", max_num_batched_tokens=32)  # fmt: skip
    engine = Engine(config)
    try:
        assert engine.loaded.model.device.type == "cuda"
        ids = chat_prompt(engine.tokenizer, [{"role": "user", "content": LONG}])
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids) :].tolist()
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        first, again = engine.generate_sync(ids, params), engine.generate_sync(ids, params)
    finally:
        engine.shutdown()
    assert len(ids) > 128 and first.token_ids == ref == again.token_ids
    assert first.report.reused == 0 and again.report.reused >= 128


def test_a_grammar_masks_cuda_logits_on_their_device_as_on_the_cpu(tmp_path: Path) -> None:
    saved(FAMILIES["llama"], tmp_path / "model")
    answer = {"answer": {"enum": ["yes", "no"]}}
    schema = {"type": "object", "properties": answer, "required": ["answer"], "additionalProperties": False}
    seen = {}
    for device in ("cpu", "cuda"):
        engine = Engine(EngineConfig(model=str(tmp_path / "model"), cache_dir=tmp_path / device, device=device,
                                     dtype="float32"))  # fmt: skip
        try:
            ids = chat_prompt(engine.tokenizer, [{"role": "user", "content": "Is Paris in France?"}])
            grammar = engine.grammars.compile(json_grammar(schema))
            seen[device] = engine.generate_sync(ids, SamplingParams(max_tokens=24, temperature=0, grammar=grammar))
        finally:
            engine.shutdown()
    assert seen["cuda"].token_ids == seen["cpu"].token_ids
    assert seen["cuda"].text.replace(" ", "") in ('{"answer":"yes"}', '{"answer":"no"}')


def test_blend_on_cuda_over_kv_read_from_disk_equals_the_cpu(tmp_path: Path) -> None:
    saved(FAMILIES["llama"], tmp_path / "model")
    pieces = [prompt(5, seed=6), prompt(40, seed=7), prompt(33, seed=8), prompt(6, seed=9)]
    documents = [False, True, True, False]
    done = {}
    for device in ("cpu", "cuda"):
        loaded = load(EngineConfig(model=str(tmp_path / "model"), device=device, dtype="float32"))
        # Memory takes nothing: each document's KV is written to disk, and read back from it layer by layer.
        store = ChunkStore([MemoryTier(budget_bytes=0), DiskTier(tmp_path / device, budget_bytes=1 << 30)])
        reuser = Reuser(loaded.model, loaded.tokenizer, store, fingerprint("cuda-check"), BlendConfig())
        for ids, is_doc in zip(pieces, documents):
            if is_doc:
                reuser.document(ids)
        store.flush()
        done[device] = {mode: reuser.prefill(reuser.new_kv(), pieces, documents, ReuseMode(mode, 0.25))
                        for mode in ("naive", "blend")}  # fmt: skip
        store.close()
    for mode in ("naive", "blend"):
        cpu, gpu = done["cpu"][mode], done["cuda"][mode]
        assert gpu.mode == cpu.mode == mode and gpu.logits.device.type == "cuda"
        assert (gpu.reused, gpu.recomputed) == (cpu.reused, cpu.recomputed) and gpu.reused > 0
        torch.testing.assert_close(gpu.logits.cpu(), cpu.logits, rtol=0, atol=1e-3)
    assert done["cuda"]["blend"].recomputed > 0


def test_auto_is_bf16_on_a_cuda_gpu_and_moves_the_logits_little(tmp_path: Path) -> None:
    saved(FAMILIES["llama"], tmp_path / "model")
    ids = prompt(50, seed=10)
    logits = {}
    for dtype in ("auto", "float32"):
        loaded = load(EngineConfig(model=str(tmp_path / "model"), device="cuda", dtype=dtype))
        logits[str(loaded.model.dtype)] = forward(loaded.model, [Run(new_kv(loaded.model), ids, 0)])[0].float()
    assert sorted(logits) == ["torch.bfloat16", "torch.float32"]
    cosine = torch.nn.functional.cosine_similarity(logits["torch.bfloat16"], logits["torch.float32"], dim=0)
    assert cosine > 0.99


def test_the_engine_on_cuda_reuses_documents_as_on_the_cpu(tmp_path: Path) -> None:
    """The same requests, on each device: documents kept in context, then reordered and blended, each reuse
    shadow-checked against full prefill; the same tokens and the same reuse on both."""
    saved(FAMILIES["llama"], tmp_path / "model")
    head, tail, docs = prompt(4, seed=11), prompt(5, seed=12), [prompt(70, seed=13), prompt(50, seed=14)]
    plans = [Plan([head, docs[0], docs[1], tail], [False, True, True, False], ReuseMode("blend", 0.2)),
             Plan([tail, docs[1], docs[0], head], [False, True, True, False], ReuseMode("blend", 0.2))]  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    seen = {}
    for device in ("cpu", "cuda"):
        config = EngineConfig(model=str(tmp_path / "model"), cache_dir=tmp_path / device, device=device,
                              dtype="float32", quality=QualityConfig(shadow_rate=1.0))  # fmt: skip
        engine = Engine(config)
        try:
            results = [engine.generate_sync([t for p in plan.pieces for t in p], params, plan) for plan in plans]
        finally:
            engine.shutdown()
        seen[device] = [(r.token_ids, r.report.reused, r.report.recomputed, str(r.report)) for r in results]
    assert seen["cuda"] == seen["cpu"]
    assert seen["cuda"][1][1] > 0 and seen["cuda"][1][2] > 0  # the second reused and recomputed some


def test_kvcomm_on_cuda_offsets_a_span_as_on_the_cpu(tmp_path: Path) -> None:
    saved(FAMILIES["llama"], tmp_path / "model")
    system = ["You are a careful math tutor.", "You are a strict reviewer."]
    question = "A quilt takes 2 rolls of red cloth and half that much grey cloth. How many rolls in all?"
    seen = {}
    for device in ("cpu", "cuda"):
        loaded = load(EngineConfig(model=str(tmp_path / "model"), device=device, dtype="float32"))
        reuser = Reuser(loaded.model, loaded.tokenizer, ChunkStore.from_config(), fingerprint("t"), BlendConfig())
        spans, runs = Spans(reuser, AnchorPool(AnchorConfig())), []
        for who, mode in ((0, "full"), (1, "kvcomm"), (1, "kvcomm")):  # the second reader finds an anchor
            messages = [{"role": "system", "content": system[who]}, {"role": "user", "content": question}]
            pieces, kinds = message_pieces(loaded.tokenizer, messages)
            kv = reuser.new_kv()
            shared = spans.prefill(kv, pieces, kinds, mode, f"agent{who}", "", 0.0)
            logits = shared.prefilled.logits
            if logits is None:
                ids = [t for p in pieces for t in p]
                logits = forward(loaded.model, [Run(kv, ids[len(kv) :], len(kv))])[0]
            spans.settle(kv, shared, f"agent{who}", "")
            runs.append((shared.prefilled.mode, shared.prefilled.reused, logits.cpu()))
        seen[device] = runs
    for (mode, reused, logits), (want_mode, want_reused, want) in zip(seen["cuda"], seen["cpu"]):
        assert (mode, reused) == (want_mode, want_reused)
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-3)
    assert seen["cuda"][-1][0] == "kvcomm" and seen["cuda"][-1][1] > 0
