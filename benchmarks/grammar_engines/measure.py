"""What is measured per engine and grammar: compile, matcher, masks (one sequence, batch 16), sampled outputs."""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .engines import Engine, XGrammar
from .masks import apply_mask_lut, new_bitmask
from .model import Model
from .schemas import Spec, acceptance_cases, check, probe
from .stats import med, pct, timed

NAN = float("nan")


@dataclass
class Result:
    engine: str
    spec: str
    compile_cold_ms: float = NAN
    compile_warm_ms: float = NAN
    matcher_us: float = NAN
    first_mask_ms: float = NAN
    mask_med_us: float = NAN
    mask_p99_us: float = NAN
    b16_fill_med_ms: float = NAN
    b16_fill_p99_ms: float = NAN
    b16_consume_med_ms: float = NAN
    b16_pct_step: float = NAN
    runs: int = 0
    valid: int = 0
    invalid: int = 0
    cut: int = 0
    engine_errors: int = 0
    canon_text: int = 0
    canon_tokens: int = 0
    special_tokens: int = 0  # generations with a special token (e.g. <|im_start|>) inside the JSON
    mean_tokens: float = NAN
    accepts: dict[str, str] = field(default_factory=dict)  # probe -> yes / no, with ! where the schema disagrees
    examples: list[str] = field(default_factory=list)
    error: str = ""


@torch.inference_mode()
def generate(
    eng: Engine, compiled: Any, spec: Spec, model: Model, n: int, wave: int, max_tokens: int, seed: int
) -> tuple[list[list[int]], list[str], int]:
    """n generations under the mask, real model, temperature 1; returns token lists, statuses, engine errors."""
    seqs: list[list[int]] = []
    status: list[str] = []
    errors = 0
    cache0, logits0 = model.prefill(spec)
    for start in range(0, n, wave):
        b = min(wave, n - start)
        gen = torch.Generator().manual_seed(seed + start)
        cache = copy.deepcopy(cache0)
        cache.batch_repeat_interleave(b)
        logits = logits0.repeat(b, 1)
        ms = [eng.matcher(compiled) for _ in range(b)]
        toks: list[list[int]] = [[] for _ in range(b)]
        st = ["cut"] * b
        active = list(range(b))
        bitmask = new_bitmask(b, model.vocab)
        for _ in range(max_tokens):
            bm = bitmask[: len(active)]
            eng.fill_batch([ms[i] for i in active], bm)
            apply_mask_lut(logits, bm)
            dead = torch.isinf(logits).all(dim=1)
            probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
            probs[dead, model.eos] = 1.0
            picked = torch.multinomial(probs, 1, generator=gen).view(-1).tolist()
            keep: list[int] = []
            for row, (i, t) in enumerate(zip(active, picked)):
                if bool(dead[row]):
                    st[i], errors = "dead-end", errors + 1
                elif t == model.eos:
                    st[i] = "done"
                elif not eng.consume(ms[i], t):
                    st[i], errors = "rejected", errors + 1
                else:
                    toks[i].append(t)
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                cache.batch_select_indices(torch.tensor(keep))
            active = [active[r] for r in keep]
            logits = model.step(torch.tensor([picked[r] for r in keep]), cache)
        seqs += toks
        status += st
    return seqs, status, errors


def replay_single(
    eng: Engine, compiled: Any, seqs: list[list[int]], eos: int, vocab: int
) -> tuple[list[float], list[float]]:
    """Per-token mask time of one sequence; also the first mask of each fresh matcher."""
    bitmask = new_bitmask(1, vocab)
    times: list[float] = []
    first: list[float] = []
    for seq in seqs:
        m = eng.matcher(compiled)
        for k, t in enumerate([*seq, eos]):
            dt, _ = timed(eng.fill, m, bitmask, 0)
            times.append(dt)
            if k == 0:
                first.append(dt)
            if t != eos:
                eng.consume(m, t)
    return times, first


def replay_batch(
    eng: Engine, compiled: Any, seqs: list[list[int]], eos: int, vocab: int, batch: int, max_steps: int
) -> tuple[list[float], list[float]]:
    """`batch` matchers in lockstep, each replaying its own sequence; a finished slot takes the next sequence.
    Stops when the pool cannot keep every slot busy. Returns the fill times and the consume times per step."""
    pool = iter([*s, eos] for s in seqs if s)
    bitmask = new_bitmask(batch, vocab)
    slots: list[tuple[Any, list[int], int]] = []  # (matcher, sequence, position)
    for seq in pool:
        slots.append((eng.matcher(compiled), seq, 0))
        if len(slots) == batch:
            break
    fills: list[float] = []
    consumes: list[float] = []
    for _ in range(max_steps):
        if len(slots) < batch:
            break
        dt, _ = timed(eng.fill_batch, [s[0] for s in slots], bitmask)
        fills.append(dt)
        t0 = time.perf_counter()
        for m, seq, pos in slots:
            if seq[pos] != eos:
                eng.consume(m, seq[pos])
        consumes.append(time.perf_counter() - t0)
        new: list[tuple[Any, list[int], int]] = []
        for m, seq, pos in slots:
            if pos + 1 < len(seq):
                new.append((m, seq, pos + 1))
            elif (nxt := next(pool, None)) is not None:
                new.append((eng.matcher(compiled), nxt, 0))
        slots = new
    return fills, consumes


def accepts(eng: Engine, compiled: Any, model: Model, text: str) -> bool:
    """Whether the grammar takes `text` (tokenized the canonical way) and can stop right after it."""
    m = eng.matcher(compiled)
    if not all(eng.consume(m, t) for t in model.encode(text)):
        return False
    bitmask = new_bitmask(1, len(model.tok), fill=0)
    eng.fill(m, bitmask, 0)
    return bool((int(bitmask[0, model.eos // 32]) >> (model.eos % 32)) & 1)


def probes(eng: Engine, compiled: Any, model: Model, spec: Spec, prefix: str = "") -> dict[str, str]:
    """Each probe string of the spec: accepted or not, "!" where that disagrees with the schema."""
    cases = acceptance_cases(spec, eng.compact)
    return {prefix + k: probe(accepts(eng, compiled, model, text), want, k) for k, (text, want) in cases.items()}


def run_engine(
    eng: Engine, model: Model, args: argparse.Namespace, specs: list[Spec]
) -> tuple[float, list[Result], dict[str, float]]:
    """(tokenizer-info seconds, a Result per spec, xgrammar's structural-tag compile ms by name)."""
    tok_s, _ = timed(eng.build_tokenizer, model.tok)
    print(f"[{eng.name}] tokenizer info {tok_s * 1e3:.0f} ms", file=sys.stderr)
    results: list[Result] = []
    extra: dict[str, float] = {}
    for spec in specs:
        r = Result(eng.name, spec.key)
        results.append(r)
        try:
            cold, compiled = timed(eng.compile, spec)
        except Exception as exc:  # an engine that cannot express a grammar is a result
            r.error = f"{type(exc).__name__}: {str(exc)[:160]}"
            print(f"[{eng.name}] {spec.key}: compile failed: {r.error}", file=sys.stderr)
            continue
        r.compile_cold_ms = cold * 1e3
        r.compile_warm_ms = med([timed(eng.compile, spec)[0] for _ in range(3)]) * 1e3
        r.matcher_us = med([timed(eng.matcher, compiled)[0] for _ in range(20)]) * 1e6
        if isinstance(eng, XGrammar) and spec.kind != "json":
            st_s, st = timed(eng.compile_structural_tag, spec)
            extra[f"structural_tag_{spec.key}_ms"] = st_s * 1e3
            r.accepts.update(probes(eng, st, model, spec, "structural_tag:"))
        r.accepts.update(probes(eng, compiled, model, spec))
        if not spec.generate:
            print(f"[{eng.name}] {spec.key}: compile {r.compile_cold_ms:.1f} ms; {r.accepts}", file=sys.stderr)
            continue
        torch.set_num_threads(args.gen_threads)
        gen_s, (seqs, status, errors) = timed(
            generate, eng, compiled, spec, model, args.runs, args.gen_batch, args.max_tokens, args.seed
        )
        torch.set_num_threads(args.threads)
        r.runs, r.engine_errors, r.cut = len(seqs), errors, status.count("cut")
        r.special_tokens = sum(any(t in model.special for t in seq) for seq in seqs)
        for seq, s in zip(seqs, status):
            if s != "done":
                continue
            text = str(model.tok.decode(seq))
            ok, canon = check(spec, text, eng.compact)
            r.valid += ok
            r.invalid += not ok
            r.canon_text += canon
            r.canon_tokens += model.encode(text) == seq
            if len(r.examples) < 2:
                r.examples.append(text)
        r.mean_tokens = statistics.fmean(len(s) for s in seqs) if seqs else NAN
        single, first = replay_single(eng, compiled, seqs[: args.timing_seqs], model.eos, model.vocab)
        r.mask_med_us, r.mask_p99_us = med(single) * 1e6, pct(single, 0.99) * 1e6
        r.first_mask_ms = med(first) * 1e3
        fills, consumes = replay_batch(eng, compiled, seqs, model.eos, model.vocab, 16, args.batch_steps)
        r.b16_fill_med_ms, r.b16_fill_p99_ms = med(fills) * 1e3, pct(fills, 0.99) * 1e3
        r.b16_consume_med_ms = med(consumes) * 1e3
        print(
            f"[{eng.name}] {spec.key}: gen {gen_s:.0f} s, valid {r.valid}/{r.runs} cut {r.cut} err {errors}; "
            f"mask {r.mask_med_us:.0f}/{r.mask_p99_us:.0f} us; b16 {r.b16_fill_med_ms:.2f} ms "
            f"({len(fills)} steps)",
            file=sys.stderr,
        )
    return tok_s, results, extra
