"""Constrained-decoding engines side by side: llguidance, xgrammar, outlines-core.

Standalone (it imports no kvgate module). Run it from the benchmarks folder, in a virtualenv that has torch,
transformers, jsonschema and any of the three engines; an engine that is not installed is skipped with a message:

    cd benchmarks && python -m grammar_engines --runs 200 --json /tmp/grammar_engines.json

The report goes to stdout, progress to stderr, the raw results to --json.

What it measures, the same way for every engine, on the default model's tokenizer (SmolLM2-135M-Instruct):

* tokenizer-info build (once per model), grammar compile (cold, then again: a cache hit where the engine caches),
  a matcher from the compiled grammar, and the first mask of a fresh matcher;
* the mask of one sequence per token (median, p99), replaying token sequences that the real model sampled
  under that engine's mask;
* batch 16: 16 matchers, each its own sequence (a finished one is replaced from the pool, as in continuous
  batching), masks filled with the engine's batched/parallel API where it has one, plus consuming the 16 tokens;
  as a percentage of one decode step of the model at batch 16 with a ~300-token KV cache (needs --runs >= 16);
* applying a [16, 49152] bitmask to float32 logits with each engine's CPU kernel and a plain-torch one;
* correctness: --runs generations per schema sampled from the real model (temperature 1; a bfloat16 copy unless
  --gen-dtype float32, for speed) under the mask, validated with jsonschema; generations cut by --max-tokens are
  counted apart, and so are those with a special token (<|im_start|>, ...) inside the JSON;
* formatting: every engine is configured for deterministic separators; the share of outputs that json.dumps
  re-renders byte for byte, and that the tokenizer re-encodes to the very tokens sampled, is reported.

The grammars: (a) function arguments, (b) a nested object, (c) any JSON object (json_object mode),
(d) a tool-call wrapper `<tool_call>\\n{"name": ..., "arguments": (a)}\\n</tool_call>`; plus (e), compiled and
checked on fixed strings only: one or more such calls separated by a newline (parallel tool calls).

The files: schemas.py (grammars, prompts, probes, output check), engines.py (one adapter per engine),
model.py (the sampling model, its decode step), masks.py (bitmask kernels), measure.py (per engine and grammar),
stats.py (timing), report.py (the report), this file (arguments and the run).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import sys
import time
import warnings

import torch
from transformers.utils import logging as hf_logging

from .engines import ENGINES, Engine
from .masks import bench_apply
from .measure import Result, run_engine
from .model import Model
from .report import report
from .schemas import SPECS
from .stats import med

MODEL_GLOB = "~/.cache/kvgate/models/SmolLM2-135M-Instruct.Q4_1-*"
BURST = 8  # decode steps per timing burst of the model


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m grammar_engines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=200, help="sampled generations per engine and grammar")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=200, help="sequences decoded together while sampling")
    ap.add_argument("--timing-seqs", type=int, default=32, help="sequences replayed for the one-sequence mask time")
    ap.add_argument("--batch-steps", type=int, default=400, help="most steps of the batch-16 replay")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="engine and decode-step threads")
    ap.add_argument(
        "--gen-threads", type=int, default=1, help="torch threads while sampling (1 holds up best on a busy CPU)"
    )
    ap.add_argument("--gen-dtype", default="bfloat16", choices=["float32", "bfloat16"], help="the sampling model")
    ap.add_argument("--step-ms", type=float, default=None, help="decode step to compare with (default: measured)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--grammars", default=",".join(s.key for s in SPECS))
    ap.add_argument("--model", default=None, help="HF directory of the model (default: kvgate's SmolLM2 cache)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    return ap.parse_args()


def load_engines(names: list[str], threads: int, versions: dict[str, str]) -> list[Engine]:
    """The named engines that are installed, in ENGINES' order; records each one's version."""
    engines: list[Engine] = []
    for name, make in ENGINES.items():
        if name not in names:
            continue
        try:
            eng = make(threads)
        except ImportError as exc:
            print(f"skipping {name}: not installed ({exc})", file=sys.stderr)
            continue
        engines.append(eng)
        versions[name] = version(eng.package)
    return engines


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    loads = [os.getloadavg()]

    path = args.model or next(iter(sorted(glob.glob(os.path.expanduser(MODEL_GLOB)))), None)
    if path is None:
        sys.exit(f"no model at {MODEL_GLOB}; pass --model")
    model = Model(path, args.gen_dtype)
    specs = [s for s in SPECS if s.key in args.grammars.split(",")]
    versions = {d: version(d) for d in ("torch", "transformers", "jsonschema")}
    engines = load_engines(args.engines.split(","), args.threads, versions)

    steps = {
        "batch 16, start": model.decode_step_ms(16, 300, BURST),
        "batch 1, start": model.decode_step_ms(1, 300, BURST),
    }
    if args.gen_dtype != "float32":
        steps[f"batch 16, {args.gen_dtype} (the sampler, not the reference)"] = model.decode_step_ms(16, 300, 4, True)
    print(f"decode step batch 16: median {med(steps['batch 16, start']):.1f} ms", file=sys.stderr)
    apply_rows = bench_apply(engines, model.vocab, 16, 100)

    results: list[Result] = []
    tok_times: dict[str, float] = {}
    extra: dict[str, float] = {}
    for eng in engines:
        tok_times[eng.name], res, ex = run_engine(eng, model, args, specs)
        results += res
        extra.update(ex)
        steps[f"batch 16, after {eng.name}"] = model.decode_step_ms(16, 300, BURST)
    steps["batch 16, end"] = model.decode_step_ms(16, 300, BURST)
    # The apply kernels once more, after everything: each one's median is the lower of the two rounds.
    again = {name: us for name, _, us in bench_apply(engines, model.vocab, 16, 100)}
    apply_rows = [(name, first, min(us, again.get(name, us))) for name, first, us in apply_rows]
    loads.append(os.getloadavg())
    # The reference step: the quietest fp32 batch-16 burst (the bfloat16 sampler's is in parentheses).
    fp32 = [med(v) for k, v in steps.items() if k.startswith("batch 16") and "(" not in k]
    step_ms = args.step_ms or min(fp32)
    for r in results:
        r.b16_pct_step = 100 * (r.b16_fill_med_ms + r.b16_consume_med_ms) / step_ms
    report(args, versions, tok_times, results, steps, apply_rows, extra, time.perf_counter() - t_start, loads, step_ms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "results": [r.__dict__ for r in results], "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
