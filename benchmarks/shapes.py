"""`python -m kvgate.bench.shapes`: KVCOMM as served, on agent pipelines of other shapes than its benchmark.

Each shape is a pipeline of agents with their own system prompts; agent k reads

    [system: its role][user: the question][answer 1]...[answer k-1][user: its cue]

with every earlier answer a message of its own (a span another agent wrote). Per GSM8K question, the
pipeline runs on two servers over one loaded model, each with caches of its own:

- kvgate: every turn a program turn (`x-kvgate-program-id`), reuse left to the server (KVCOMM with its
  anchors, the cost model and the quality gate); its answers are the ones later agents read;
- plain: the same prompts twice, `reuse: full` (dense: the truth) and `reuse: prefix` (prefix-only: the
  exact prefix blocks earlier prompts left, what vLLM's prefix cache gives), once kvgate's shadow
  checks of the turn are done (the two servers share the cores).

Reported per shape, over the readers' turns (agents 2..n) after the warm-up pipelines: time to first
token of each, kvgate's against dense and prefix-only, the tokens each reused, and greedy agreement
with dense: the share of dense's answer tokens the served answer repeats before they first differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.bench.chunks import SCORED, first_kl, leading
from kvgate.bench.commands import GSM8K, OUTPUT
from kvgate.bench.engines import Reply, stream
from kvgate.bench.multiagent import questions
from kvgate.bench.server import gateway, gateway_engine
from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.loader import load
from kvgate.runtime.quality import FULL
from kvgate.runtime.report import table, write_section

RULES = [
    "Answer only what was asked, and say so plainly when something cannot be known from the message.",
    "Quote every number you use exactly as the customer wrote it, with its unit.",
    "Never promise a refund, a credit or a delivery date; say who decides and when they will answer.",
    "Keep a friendly, calm tone, even when the message is rude or repeats itself.",
    "Work through any calculation one step at a time, and check each step before the next.",
    "If two facts in the message disagree, point out the disagreement instead of choosing one.",
    "Do not ask for passwords, card numbers or any other secret, and warn the customer who offers one.",
    "Refer to the order, the account and the product by the names the customer used.",
    "End with one clear sentence that states the result, and nothing after it.",
    "Write short sentences; avoid jargon, abbreviations and internal team names.",
    "When a policy applies, name it and explain in one sentence what it means for this case.",
    "If the request is outside what support handles, say which team handles it and how to reach them.",
]


def policy(role: str, duty: str, rules: int) -> str:
    """A long system prompt: the role, its duty and numbered house rules, as support teams write them."""
    listed = "\n".join(f"{i + 1}. {RULES[(i * 5 + len(role)) % len(RULES)]}" for i in range(rules))
    return f"You are the {role} of a retail company's customer support team. {duty}\n\nHouse rules:\n{listed}"


@dataclass(frozen=True)
class Shape:
    name: str
    roles: list[tuple[str, str]]  # (name, system prompt)
    tokens: int  # answer tokens per turn
    said_as: str = "assistant"  # the role earlier answers are given as


SHAPES = [
    Shape(
        "support, reviewer",
        [
            ("support", policy("support agent", "Answer the customer's message below.", 22)),
            ("reviewer", policy("quality reviewer", "Review the support agent's answer above and correct it.", 22)),
        ],
        tokens=24,
    ),
    Shape(
        "planner, solver, critic",
        [
            (
                "planner",
                "You plan. List the steps needed to solve the problem, one per line, without solving it. "
                "Name the quantities each step needs and the order in which they are found.",
            ),
            (
                "solver",
                "You solve. Follow the plan above step by step, computing every quantity it names, "
                "and finish with the final number on its own line.",
            ),
            (
                "critic",
                "You are a critic. Check the plan and the solution above against the problem: say which "
                "step is wrong, if any, and give the corrected final number.",
            ),
        ],  # fmt: skip
        tokens=48,
        said_as="user",
    ),
    Shape(
        "five roles",
        [
            ("solver", "You are a careful math tutor. Solve the problem step by step and end with the final number."),
            ("checker", "You are a strict reviewer. Check the solution above for mistakes and give the final number."),
            ("explainer", "You explain math to children. Retell the solution above in simple words."),
            ("judge", "You are the judge. Compare the answers above and state the one final number that is right."),
            ("summarizer", "You write summaries. In one sentence, say what the agents above agreed the answer is."),
        ],
        tokens=32,
    ),
]


def messages(shape: Shape, question: str, answers: list[str]) -> list[dict[str, str]]:
    name, role = shape.roles[len(answers)]
    said = [{"role": shape.said_as, "content": a} for a in answers]
    return [{"role": "system", "content": role}, {"role": "user", "content": question}, *said,
            {"role": "user", "content": f"Your turn, {name}."}]  # fmt: skip


@dataclass
class Turns:
    """The readers' turns of one shape, after the warm-up."""

    dense: list[float] = field(default_factory=list)  # seconds to first token
    prefix: list[float] = field(default_factory=list)
    kvgate: list[float] = field(default_factory=list)
    prefix_cached: list[int] = field(default_factory=list)
    kvgate_cached: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    agreement: list[float] = field(default_factory=list)  # kvgate against dense
    prefix_agreement: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    how: Counter[str] = field(default_factory=Counter)


def agreement(truth: Reply, served: Reply) -> float:
    """The share of the dense answer's tokens the served answer repeats before they first differ."""
    return leading(truth, served) / len(truth.logprobs) if truth.logprobs else 1.0


def served_as(reply: Reply) -> str:
    """How kvgate served a turn, in a few words: the mode and, for a dense turn, why."""
    how = reply.headers.get("x-kvgate-reuse", "")
    if "kvcomm" in how.split(";")[0]:
        return "kvcomm (spans reused)"
    for reason in ("no close anchor", "would be slower", "quality gate", "chunks found by content"):
        if reason in how:
            return f"not kvcomm: {reason}"
    return f"not kvcomm: {how.split(';')[0] or 'nothing reused'}"


def body(model: str, messages: list[dict[str, str]], tokens: int, **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, **SCORED, **more}


def run_pipeline(
    shape: Shape, question: str, i: int, urls: tuple[str, str], model: str, into: Turns | None, checked: Engine
) -> None:
    """One question through the pipeline; the readers' turns measured `into` (None: a warm-up)."""
    kvgate, plain = urls
    answers: list[str] = []
    for k in range(len(shape.roles)):
        asked = messages(shape, question, answers)
        program = {"x-kvgate-program-id": f"{shape.name.replace(', ', '-').replace(' ', '-')}-{i}-{k}"}
        served = stream(kvgate, body(model, asked, shape.tokens), program)
        idle(checked)  # its shadow checks done before the other server is timed: they share the cores
        truth = stream(plain, body(model, asked, shape.tokens, kvgate={"reuse": "full"}))
        prefix = stream(plain, body(model, asked, shape.tokens, kvgate={"reuse": "prefix"}))
        answers.append(served.text.strip())
        if into is None or k == 0:
            continue
        into.dense.append(truth.ttft)
        into.prefix.append(prefix.ttft)
        into.kvgate.append(served.ttft)
        into.prefix_cached.append(prefix.cached)
        into.kvgate_cached.append(served.cached)
        into.prompt.append(truth.prompt)
        into.agreement.append(agreement(truth, served))
        into.prefix_agreement.append(agreement(truth, prefix))
        into.kl.append(first_kl(truth, served))
        into.how[served_as(served)] += 1


def idle(engine: Engine, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.shadow.busy and time.monotonic() < deadline:
        time.sleep(0.01)


def rows(shape: Shape, t: Turns) -> list[str]:
    mean = statistics.fmean
    return [
        f"{shape.name} ({len(shape.roles)} agents, {shape.tokens}-token answers)",
        f"{mean(t.prompt):.0f}",
        f"{mean(t.dense):.2f} / {mean(t.prefix):.2f} / {mean(t.kvgate):.2f}",
        f"{mean(t.dense) / mean(t.kvgate):.2f}x",
        f"{mean(t.prefix) / mean(t.kvgate):.2f}x",
        f"{mean(t.prefix_cached):.0f} / {mean(t.kvgate_cached):.0f}",
        f"{mean(t.agreement):.2f} ({mean(t.prefix_agreement):.2f})",
        f"{mean(t.kl):.3f}",
    ]


def bench_shapes(settings: Settings, data: Path, pipelines: int, warmup: int, output: Path, command: str) -> str:
    asked = questions(data, warmup + pipelines)
    base = settings.model_copy(update={"semantic_cache": {"enabled": False}})
    loaded = load(base.engine_config())
    measured: dict[str, Turns] = {}
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        served = base.model_copy(update={"caches": {"dir": Path(a)}})
        plain = base.model_copy(update={"caches": {"dir": Path(b)}})
        with gateway_engine(served, loaded) as (on, model, engine), gateway(plain, loaded) as (off, _):
            urls = on.removesuffix("/v1"), off.removesuffix("/v1")
            for shape in SHAPES:
                turns = measured[shape.name] = Turns()
                for i, question in enumerate(asked):
                    run_pipeline(shape, question, i, urls, model, turns if i >= warmup else None, engine)
                    print(f"{shape.name}: pipeline {i + 1}/{len(asked)}", file=sys.stderr, flush=True)
            gate, config = dict(engine.gate.stats()), engine.gate.config
            with engine.gate.lock:
                ladders = "\n".join(
                    f"- {key}: {'withheld' if ladder.ratio == FULL else f'{ladder.ratio:.0%} recompute'}, "
                    f"{ladder.totals.checks} checks, answers "
                    + (f"{ladder.totals.answer / ladder.totals.answered:.2f}" if ladder.totals.answered else "none")
                    for key, ladder in engine.gate.shapes.items()
                )
    header = ["shape", "prompt tokens", "TTFT s: dense / prefix / kvgate", "vs dense", "vs prefix-only",
              "reused: prefix / kvgate", "greedy agreement (prefix-only's)", "first-token KL"]  # fmt: skip
    how = "\n".join(
        f"- {shape.name}: " + ", ".join(f"{n} {what}" for what, n in measured[shape.name].how.most_common())
        for shape in SHAPES
    )
    text = (
        f"{pipelines} GSM8K questions per shape (rows {warmup}..{warmup + pipelines - 1}) after {warmup} warm-up "
        f"pipelines (rows 0..{warmup - 1}); readers' turns only (agents 2..n), greedy; each a mean. kvgate: program "
        "turns, reuse left to the server (default settings); dense and prefix-only: `reuse: full` and `reuse: "
        "prefix` on a server of their own. Greedy agreement: the share of dense's answer tokens the served answer "
        "repeats before they first differ.\n\n"
        + table(header, [rows(s, measured[s.name]) for s in SHAPES])
        + f"\n\nHow kvgate served the readers' turns:\n{how}\n\nThe quality gate at the end (a new shape "
        f"withheld until {config.min_checks} checks keep answers; every shape's first {config.min_checks} requests "
        f"on a rung checked, then quality.shadow_rate {config.shadow_rate:g}): "
        + "; ".join(
            f"{mode}: {s['checks']:.0f} checks, answers {s['answer']:.2f}, {s['ladders'] - 1:.0f} shapes, "
            f"{s['withheld']:.0f} withheld"
            for mode, s in gate.items()
        )
        + f"\n\nEach agent's ladders (lifetime checks and their answer agreement):\n{ladders}\n"
    )
    write_section(output, "kvcomm-shapes", "KVCOMM on pipelines of other shapes", command, text)
    return text


def parser() -> argparse.ArgumentParser:
    """The command line (`kvgate bench` hands it the arguments as given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=GSM8K, help="GSM8K jsonl: the questions")
    parser.add_argument("--pipelines", type=int, default=8, help="measured pipelines per shape")
    parser.add_argument("--warmup", type=int, default=4, help="pipelines per shape before those measured")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.data.is_file():
        print(f"{args.data}: no such data file (the shared GSM8K set)", file=sys.stderr)
        return 2
    command = "python -m kvgate.bench.shapes " + " ".join(argv if argv is not None else sys.argv[1:])
    print(bench_shapes(Settings(), args.data, args.pipelines, args.warmup, args.output, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
