"""The report on stdout: environment, decode step, tokenizer info, the per engine and grammar table, the rest."""

from __future__ import annotations

import argparse
import os
import platform

import torch

from .measure import Result
from .stats import med, pct

COLUMNS = (
    "engine | g | compile cold ms | recompile ms | matcher us | 1st mask ms | mask med us | mask p99 us | "
    "b16 fill med ms | b16 fill p99 ms | b16 consume ms | % of b16 step | valid | invalid | cut@max | engine err | "
    "re-render same | re-tokenize same | special tok | mean tokens"
).split(" | ")


def fmt(x: float, nd: int = 1) -> str:
    return "-" if x != x else f"{x:.{nd}f}"


def row(r: Result) -> str:
    """One table row, the engine's and grammar's; a grammar that failed to compile says why."""
    if r.error:
        return f"| {r.engine} | {r.spec} | failed: {r.error} |" + " |" * (len(COLUMNS) - 3)
    done = r.valid + r.invalid
    cells = [
        r.engine,
        r.spec,
        fmt(r.compile_cold_ms, 2),
        fmt(r.compile_warm_ms, 3),
        fmt(r.matcher_us),
        fmt(r.first_mask_ms, 3),
        fmt(r.mask_med_us),
        fmt(r.mask_p99_us),
        fmt(r.b16_fill_med_ms, 3),
        fmt(r.b16_fill_p99_ms, 3),
        fmt(r.b16_consume_med_ms, 3),
        fmt(r.b16_pct_step, 2),
        f"{r.valid}/{r.runs}",
        str(r.invalid),
        str(r.cut),
        str(r.engine_errors),
        f"{r.canon_text}/{done}",
        f"{r.canon_tokens}/{done}",
        str(r.special_tokens),
        fmt(r.mean_tokens),
    ]
    return "| " + " | ".join(cells) + " |"


def report(
    args: argparse.Namespace,
    versions: dict[str, str],
    tok_times: dict[str, float],
    results: list[Result],
    steps: dict[str, list[float]],
    apply_rows: list[tuple[str, float, float]],
    extra: dict[str, float],
    wall: float,
    loads: list[tuple[float, float, float]],
    step_ms: float,
) -> None:
    p = print
    p("\n## Environment")
    p(
        f"python {platform.python_version()}, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
        f"load average at start/end {loads[0][0]:.2f} / {loads[-1][0]:.2f}"
    )
    p("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    p(
        f"args: runs={args.runs} max_tokens={args.max_tokens} gen_batch={args.gen_batch} seed={args.seed} "
        f"timing_seqs={args.timing_seqs} batch_steps={args.batch_steps}; wall {wall:.0f} s"
    )
    p("\n## Model decode step (SmolLM2-135M fp32 unless said, batch x 1 token, KV cache ~300 tokens)")
    p(f"'% of b16 step' below divides by {step_ms:.1f} ms: the lowest median of the fp32 batch-16 bursts")
    p("(bursts spread over the run: on a shared CPU the quietest one is the closest to the step's own cost)")
    for k, v in steps.items():
        p(f"{k}: median {med(v):.1f} ms, p10 {pct(v, 0.1):.1f}, p90 {pct(v, 0.9):.1f} ({len(v)} steps)")
    p("\n## Tokenizer info (once per model)")
    for engine, seconds in tok_times.items():
        p(f"{engine}: {seconds * 1e3:.0f} ms")
    p("\n## Per engine and grammar")
    p("| " + " | ".join(COLUMNS) + " |")
    p("|" + "---|" * len(COLUMNS))
    for r in results:
        p(row(r))
    p("\n## Grammar acceptance probes (accepted? '!': the grammar disagrees with the schema)")
    for r in results:
        if r.accepts:
            p(f"{r.engine} {r.spec}: " + ", ".join(f"{k}={v}" for k, v in r.accepts.items()))
    if extra:
        p("\n## xgrammar structural-tag compile (alternative to the EBNF wrapper)")
        for key, ms in extra.items():
            p(f"{key}: {ms:.2f}")
    p("\n## Apply a [16, 49152] int32 bitmask to float32 logits (CPU; median: the lower of two rounds)")
    for kernel, first_ms, median_us in apply_rows:
        p(f"{kernel}: first call {first_ms:.1f} ms, median {median_us:.0f} us")
    p("\n## Example outputs")
    for r in results:
        for e in r.examples[:1]:
            p(f"{r.engine} {r.spec}: {e!r}")
