"""`kvgate bench gpu`: kvgate's runtime on a CUDA GPU, against the device's limits and against transformers.

Random-weight models of Llama-3.2-1B's and Llama-3.1-8B's shapes, built on the device (no downloads), in bf16:
1. the device's two ceilings, measured: a device-to-device copy (bytes read and written) and a bf16 matmul;
2. decode tokens/s at batch 1, 16 and 64 over 2k-token contexts: the model runner's step (`forward` over a
   decode batch, then the greedy choice read back), replayed from CUDA graphs and eager, with either decode batch
   (engine.decode_batch: copy, paged), against the HBM roofline (weight and KV bytes a step over the bandwidth)
   and against transformers' `generate` with a static cache, eager and under `torch.compile`;
3. prefill tokens/s of a 4k-token prompt against the bf16 FLOP roofline;
4. TTFT of six 1k-token documents, reordered, with blend against full prefill;
5. the host's time per decode step: the engine's whole step and the model step alone with a 2-layer model of
   hidden size 64, whose arithmetic is negligible.
Rows are written as they finish; past `--budget` seconds the rest are marked not run. `--small` runs tiny shapes
(a try on the CPU before a GPU's time is spent; with TRITON_INTERPRET=1 and `--interpret`, the Triton kernels too).

python -m kvgate.bench.gpu [--budget 420] [--small] [--device cuda] [--interpret]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from kvgate.runtime.config import EngineConfig
from kvgate.runtime.decode import Batches
from kvgate.runtime.engine import Engine
from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.paged_batch import TableBatch
from kvgate.runtime.paged_kernel import runs_on
from kvgate.runtime.report import write_section

OUTPUT = Path(__file__).with_name("BENCHMARKS.md")
LLAMA = dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
             max_position_embeddings=8192)  # fmt: skip
SHAPES = {
    "1B": dict(LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
               tie_word_embeddings=True),
    "8B": dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
               tie_word_embeddings=False),
}  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, max_position_embeddings=8192, tie_word_embeddings=True)  # fmt: skip
SMALL = {"tiny": dict(TINY, num_hidden_layers=2)}
HBM = 4.8e12  # the H200's datasheet bandwidth, bytes/s (the issue's roofline); the measured copy beside it


def tokens_of(n: int, model: PreTrainedModel, seed: int = 0) -> list[int]:
    """n token ids of the model's vocabulary, none of the first ten (nothing special)."""
    return [(7 * j + 131 * seed) % (model.config.vocab_size - 10) + 10 for j in range(n)]


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object], repeats: int = 3) -> float:
        """Median seconds of fn() after one warm-up."""
        fn()
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def ceilings(clock: Clock, small: bool) -> tuple[float, float]:
    """Measured bytes/s of a device-to-device copy (read plus written) and FLOP/s of a bf16 matmul."""
    n = (1 << 20) if small else (1 << 30)  # 2 GB of bf16 each side on a GPU
    a = torch.randn(n, dtype=torch.bfloat16, device=clock.device)
    b = torch.empty_like(a)
    copy = 2 * a.nbytes / clock.time(lambda: b.copy_(a), 10)
    m = 256 if small else 8192
    x, y = (torch.randn(m, m, dtype=torch.bfloat16, device=clock.device) for _ in "xy")
    flops = 2 * m**3 / clock.time(lambda: x @ y, 10)
    return copy, flops


def build(shape: dict, device: torch.device) -> PreTrainedModel:
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: an 8B model is never held in float32
    try:
        with device:
            model = LlamaForCausalLM(LlamaConfig(**shape))
    finally:
        torch.set_default_dtype(before)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model.eval()


def step_bytes(model: PreTrainedModel, sequences: int, context: int) -> tuple[int, int]:
    """Bytes a decode step must read: every weight but the embedding rows (its head's too where tied), and
    every sequence's KV."""
    c = model.config
    weights = sum(p.nbytes for name, p in model.named_parameters() if "embed_tokens" not in name)
    if c.tie_word_embeddings:
        weights += model.model.embed_tokens.weight.nbytes
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * sequences * 2
    return weights, kv


def empty_kv(model: PreTrainedModel) -> KVCache:
    c = model.config
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, model.dtype, str(model.device))


def caches(model: PreTrainedModel, sequences: int, context: int) -> list[KVCache]:
    """`sequences` caches of one `context`-token prompt, prefilled once and copied."""
    first = empty_kv(model)
    forward(model, [Run(first, tokens_of(context, model), 0)])
    out = [first]
    for _ in range(sequences - 1):
        kv = empty_kv(model)
        keys, values = first.rows(0, context)
        kv.reserve(context + 128)
        kv.extend(keys, values)
        out.append(kv)
    return out


def decode(model: PreTrainedModel, clock: Clock, sequences: int, context: int, steps: int, graphs: bool,
           paged: bool = False) -> float:  # fmt: skip
    """Seconds per decode step of the model runner: forward over the batch, the greedy tokens read back; the batch
    a GPU's (native, on a CPU too), a copy of the KV or over its blocks where they lie (`paged`)."""
    kvs, batches = caches(model, sequences, context), Batches(native=True, graphs=graphs, paged=paged)
    tokens = [5] * sequences

    def one() -> None:
        nonlocal tokens
        logits = forward(model, [Run(kv, [t], len(kv)) for kv, t in zip(kvs, tokens)], pad=False, batches=batches)
        tokens = logits.max(-1).indices.tolist()

    for _ in range(3):  # the batch's copy made, its graph captured
        one()
    if isinstance(batches.last, TableBatch) != paged:
        raise RuntimeError(f"the step ran on {type(batches.last).__name__}")
    clock.sync()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    clock.sync()
    return (time.perf_counter() - start) / steps


def prefill(model: PreTrainedModel, clock: Clock, tokens: int) -> float:
    ids = tokens_of(tokens, model)
    return clock.time(lambda: forward(model, [Run(empty_kv(model), ids, 0)]))


def generate(model: PreTrainedModel, clock: Clock, sequences: int, context: int, steps: int) -> float:
    """Seconds per decode step of transformers' generate with a static cache: two lengths, the difference."""
    ids = torch.randint(10, model.config.vocab_size, (sequences, context), device=model.device)

    def run(new: int) -> float:
        clock.sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                       disable_compile=True)  # fmt: skip
        clock.sync()
        return time.perf_counter() - start

    run(2)  # warm-up (and compiling, under torch.compile)
    short, long = run(2), run(2 + steps)
    return (long - short) / steps


def attempt(fn: Callable[..., float], *args: object, **kwargs: object) -> float | str:
    """fn(*args, **kwargs), or what it raised (a row keeps its other cells)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        print(f"failed: {exc!r}", flush=True)
        return f"failed: {type(exc).__name__}"


def ms(x: float | str) -> str:
    return f"{x * 1e3:.2f}" if isinstance(x, float) else x


def synthetic_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    inner = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="t1", pad_token="t0")


def engine_step_s(model: PreTrainedModel, sequences: int, where: Path) -> float:
    """Seconds per step of the engine, `sequences` 4-token prompts and their 64 decode steps (kvgate bench decode's)."""
    from kvgate.bench.decode_step import engine_ms

    tokenizer = synthetic_tokenizer(model.config.vocab_size)
    model.save_pretrained(where)  # the engine fingerprints its weights' files
    loaded = LoadedModel(model, tokenizer, "tiny", where, frozenset({1}))
    engine = Engine(EngineConfig(dtype="bfloat16", device=str(model.device), cache_dir=where / "cache",
                                 max_num_seqs=64), loaded)  # fmt: skip
    try:
        return engine_ms(engine, sequences) / 1e3
    finally:
        engine.shutdown()


def blend_ttft(model: PreTrainedModel, clock: Clock, docs: int, tokens: int) -> tuple[float, float, int]:
    """Seconds to the first token's logits: full prefill of the reordered prompt, blend over the documents'
    KV computed in the first order; and the tokens blend recomputed."""
    from kvgate.chunk_cache import ChunkStore, MemoryTier, fingerprint
    from kvgate.runtime.blend import BlendConfig
    from kvgate.runtime.reuse import ReuseMode, Reuser

    store = ChunkStore([MemoryTier(budget_bytes=64 << 30)])
    reuser = Reuser(model, synthetic_tokenizer(model.config.vocab_size), store, fingerprint("gpu-bench"),
                    BlendConfig())  # fmt: skip
    documents = [tokens_of(tokens, model, seed=d + 1) for d in range(docs)]
    for ids in documents:
        reuser.document(ids)
    store.flush()
    head, question = tokens_of(4, model, seed=50), tokens_of(32, model, seed=51)
    pieces = [head, *documents[::-1], question]
    kinds = [False, *[True] * docs, False]
    full = clock.time(lambda: forward(model, [Run(reuser.new_kv(), [t for p in pieces for t in p], 0)]))
    done = []
    blend = clock.time(lambda: done.append(reuser.prefill(reuser.new_kv(), pieces, kinds, ReuseMode("blend", 0.15))))
    store.close()
    return full, blend, done[-1].recomputed


class Report:
    """Rows as they come, the section rewritten after each group; a group past the budget is marked not run."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.start = time.perf_counter()
        self.parts: list[str] = []

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.start)

    def group(self, title: str, header: list[str], rows: Callable[[], list[list[str]]], needs: float = 0) -> None:
        lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        if self.left() < needs:
            lines.append("| not run: past the budget |" + " |" * (len(header) - 1))
        else:
            try:
                lines += ["| " + " | ".join(row) + " |" for row in rows()]
            except Exception as exc:  # a group that fails says so; the others still run
                lines.append(f"| failed: {type(exc).__name__}: {str(exc)[:200]} |" + " |" * (len(header) - 1))
        self.parts.append("\n".join(lines))
        print(self.parts[-1], "\n", flush=True)
        self.write()

    def write(self) -> None:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        where = f"{name}, torch {torch.__version__}, {time.perf_counter() - self.start:.0f} s in all"
        command = "kvgate bench gpu " + " ".join(self.args.argv)
        write_section(self.args.output, "gpu", "kvgate on a GPU", command.strip(), "\n\n".join([where, *self.parts]))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=int, default=420, help="seconds; groups that would start later are not run")
    p.add_argument("--small", action="store_true", help="tiny shapes and contexts: a try on the CPU")
    p.add_argument("--compile", default="1,64", help="batch sizes for transformers under torch.compile ('' none)")
    p.add_argument("--output", type=Path, default=OUTPUT)
    p.add_argument("--interpret", action="store_true", help="on a CPU under TRITON_INTERPRET=1: Triton interpreted")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    device, small = torch.device(args.device), args.small
    if args.interpret:
        from kvgate.runtime import kernels

        kernels.INTERPRET_ON_CPU = True
    clock = Clock(device)
    report = Report(args, device)
    shapes = SMALL if small else SHAPES
    context, prompt, batches_at = (64, 128, (1, 4)) if small else (2048, 4096, (1, 16, 64))
    steps = 4 if small else 32
    copy, flops = ceilings(clock, small)
    report.group("The device's ceilings, measured:", ["copy, TB/s (read + written)", "bf16 matmul, TFLOP/s"],
                 lambda: [[f"{copy / 1e12:.2f}", f"{flops / 1e12:.0f}"]])  # fmt: skip
    models = {name: build(shape, device) for name, shape in shapes.items()}

    def decode_rows() -> list[list[str]]:
        rows = []
        for name, model in models.items():
            for b in batches_at:
                weights, kv = step_bytes(model, b, context)
                times = [attempt(decode, model, clock, b, context, steps, graphs=graphs, paged=paged)
                         if runs_on(device) or not paged else "no paged kernel here"
                         for paged in (False, True) for graphs in (device.type == "cuda", False)]  # fmt: skip
                best = min((x for x in times if isinstance(x, float)), default=None)
                floor = (weights + kv) / HBM
                rows.append([name, str(b), f"{(weights + kv) / 1e9:.1f}", f"{floor * 1e3:.2f}", *map(ms, times),
                             *(["-"] * 3 if best is None else [f"{b / best:.0f}", f"{floor / best:.0%}",
                                                               f"{(weights + kv) / copy / best:.0%}"])])  # fmt: skip
                print(rows[-1], flush=True)
        return rows

    report.group(f"Decode over {context}-token contexts, the model runner's step (forward over the batch, the "
                 "greedy tokens read back), from CUDA graphs and eager, the batch's KV copied (`copy`) or read "
                 "where it lies (`paged`: engine.decode_batch); the roofline: the step's bytes over 4.8 TB/s (and "
                 "over the measured copy):",
                 ["shape", "batch", "GB a step", "roofline ms", "copy ms, graphs", "copy, eager", "paged ms, graphs",
                  "paged, eager", "tok/s (the fastest)", "of roofline", "of measured copy"], decode_rows)  # fmt: skip

    def transformers_rows() -> list[list[str]]:
        rows = []
        compiled = {int(b) for b in args.compile.split(",") if b}
        for name, model in models.items():
            for b in batches_at:
                eager = generate(model, clock, b, context, steps)
                rows.append([name, str(b), "eager", f"{eager * 1e3:.2f}", f"{b / eager:.0f}"])
                print(rows[-1], flush=True)
            if name != list(models)[-1] or not compiled or report.left() < 150:
                continue
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            for b in sorted(compiled):
                if report.left() < 100:
                    break
                start = time.perf_counter()
                took = generate(model, clock, b, context, steps)
                rows.append([name, str(b), f"torch.compile ({time.perf_counter() - start:.0f} s with compiling)",
                             f"{took * 1e3:.2f}", f"{b / took:.0f}"])  # fmt: skip
                print(rows[-1], flush=True)
            del model.forward  # the class's own again
        return rows

    def prefill_rows() -> list[list[str]]:
        rows = []
        for name, model in models.items():
            c = model.config
            took = prefill(model, clock, prompt)
            weights, _ = step_bytes(model, 1, 0)
            attention = 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * prompt * prompt  # causal
            need = weights * prompt + attention  # 2 FLOP a bf16 weight (2 bytes) a token
            rows.append([name, str(prompt), f"{took * 1e3:.0f}", f"{prompt / took:.0f}",
                         f"{need / flops / took:.0%}"])  # fmt: skip
        return rows

    def blend_rows() -> list[list[str]]:
        name, model = list(models.items())[-1]
        docs, tokens = (3, 32) if small else (6, 1024)
        full, blend, recomputed = blend_ttft(model, clock, docs, tokens)
        return [[name, f"{docs} x {tokens}", f"{full * 1e3:.0f}", f"{blend * 1e3:.0f}", str(recomputed),
                 f"{full / blend:.2f}x"]]  # fmt: skip

    def host_rows() -> list[list[str]]:
        rows = []
        with tempfile.TemporaryDirectory() as where:
            for layers in (2, 32):
                tiny = build(dict(TINY, num_hidden_layers=layers), device)
                for b in batches_at:
                    graphed = attempt(decode, tiny, clock, b, context, steps, graphs=device.type == "cuda")
                    eager = attempt(decode, tiny, clock, b, context, steps, graphs=False)
                    engine = attempt(engine_step_s, tiny, b, Path(where) / f"{layers}-{b}") if layers == 2 else ""
                    rows.append([str(layers), str(b), ms(graphed), ms(eager), ms(engine)])
        return rows

    report.group(f"Prefill of a {prompt}-token prompt (one forward, as the engine's prefill runs it); of the "
                 "roofline: its FLOPs over the measured bf16 matmul rate:",
                 ["shape", "tokens", "ms", "tok/s", "of roofline"], prefill_rows, 20)  # fmt: skip
    report.group("TTFT of documents in another order than they were cached, then a question: full prefill "
                 "against blend (15% recomputed):",
                 ["shape", "documents", "full ms", "blend ms", "recomputed tokens", "blend ahead by"],
                 blend_rows, 30)  # fmt: skip
    report.group("The host's time per decode step, ms, with a random Llama of hidden size 64 (its arithmetic "
                 "negligible): the model step from CUDA graphs and eager, and the engine's whole step (schedule, "
                 "forward, sample, detokenize, deliver):",
                 ["layers", "batch", "graphs", "eager", "engine"], host_rows, 30)  # fmt: skip
    report.group(f"transformers' generate with a static cache on the same device, ms per decode step over "
                 f"{context}-token contexts:",
                 ["shape", "batch", "mode", "ms", "tok/s"], transformers_rows, 60)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
