"""`python -m kvgate.bench.fleet`: two engine replicas behind two kvgate fronts on one Redis; multi-turn
conversations whose turns alternate between the fronts; kvgate's cache-aware routing (`routing: cache`)
against round-robin (`routing: round_robin`, what a plain load balancer does), side by side in one run.

Replicas: two vLLM CPU servers (`--replicas vllm`, prefix caching on as vLLM's default, from the virtualenv
`kvgate bench engines` makes) or two kvgate runtimes (`--replicas kvgate`). Each replica computes on one
thread. A conversation: a short system prompt, then a first user message holding its own MuSiQue passages
and a question; each later turn resends the history and adds a short follow-up. Each arm's conversations
begin with a salt of their own, so no arm reuses the other's KV; the arms alternate round by round, each
round with new salts. Closed loop: `--clients` conversations at once per arm.

Reported per arm: TTFT p50 and p90 of the turns after the first (those a router can send to their KV) and
of all turns; the prompt tokens the replicas report cached (`cached_tokens`); turns per second; the turns
that landed on the replica of their conversation's previous turn."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvgate.bench.commands import MUSIQUE, OUTPUT
from kvgate.bench.engines import Rag, kvgate_argv, load_rag, server, stream, vllm_argv, vllm_python
from kvgate.bench.server import front
from kvgate.bench.tiers import redis_server
from kvgate.gateway.settings import Settings
from kvgate.runtime.config import user_cache_dir
from kvgate.runtime.document_text import pasted
from kvgate.runtime.loader import resolve
from kvgate.runtime.report import table, write_section

ARMS = ("cache", "round_robin")
NAME = "bench-model"
FOLLOW_UPS = ("Say that again in one sentence.", "Which passage says so?", "Anything else worth knowing?")
AUTH = {"authorization": "Bearer bench-fleet"}


@dataclass
class Turned:
    turn: int
    ttft: float
    prompt: int
    cached: int
    replica: str
    stayed: bool  # on the replica of the conversation's previous turn


def converse(fronts: list[str], item: Rag, index: int, salt: str, turns: int, tokens: int) -> list[Turned]:
    """One conversation, its turns alternating between the fronts."""
    system = {"role": "system", "content": f"[{salt}] You answer questions about the passages you are given."}
    messages = pasted([system, {"role": "user", "content": item.question}], item.passages)
    done: list[Turned] = []
    for turn in range(turns):
        body = {"model": NAME, "messages": messages, "max_tokens": tokens, "temperature": 0}
        reply = stream(fronts[(index + turn) % len(fronts)], body, AUTH)
        replica = reply.headers.get("x-kvgate-upstream", "?")
        stayed = bool(done) and done[-1].replica == replica
        done.append(Turned(turn, reply.ttft, reply.prompt, reply.cached, replica, stayed))
        messages = [*messages, {"role": "assistant", "content": reply.text}]
        messages.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
    return done


def run_arm(fronts: list[str], items: list[Rag], salt: str, turns: int, tokens: int, clients: int) -> list[Turned]:
    with ThreadPoolExecutor(clients) as pool:
        asked = [pool.submit(converse, fronts, item, i, f"{salt}-{i}", turns, tokens) for i, item in enumerate(items)]
        return [t for f in asked for t in f.result()]


@contextmanager
def replicas(kind: str, model_dir: Path, venv: Path, logs: Path) -> Iterator[list[str]]:
    """Two replicas of `kind` serving the model as NAME, each on one thread."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    with ExitStack() as stack:
        urls = []
        for i in range(2):
            if kind == "vllm":
                env = {**base, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())}
                argv = [*vllm_argv(vllm_python(venv), model_dir, NAME), "--enable-prompt-tokens-details"]
                urls.append(stack.enter_context(server(argv, env, f"vllm-{i}", logs, 900)).url)
            else:
                cache = logs / f"kvgate-{i}"
                (cache / "models").mkdir(parents=True)
                env = {**base, "KVGATE_THREADS": "1", "KVGATE_SEMANTIC_CACHE": "false", "KVGATE_CACHE_DIR": str(cache)}
                urls.append(
                    stack.enter_context(server(kvgate_argv(model_dir, NAME), env, f"kvgate-{i}", logs, 300)).url
                )
        yield urls


def summary(arm: str, done: list[Turned], seconds: float) -> list[str]:
    later = [t for t in done if t.turn > 0]

    def p(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]

    return [
        arm,
        f"{p([t.ttft for t in later], 50):.2f} / {p([t.ttft for t in later], 90):.2f}",
        f"{p([t.ttft for t in done], 50):.2f} / {p([t.ttft for t in done], 90):.2f}",
        f"{sum(t.cached for t in done) / max(1, sum(t.prompt for t in done)):.0%}",
        f"{len(done) / seconds:.2f}",
        f"{sum(t.stayed for t in later)} of {len(later)}",
    ]


def bench_fleet(kind: str, data: Path, conversations: int, turns: int, rounds: int, clients: int, tokens: int,
                docs: int, words: int, venv: Path, output: Path, command: str) -> str:  # fmt: skip
    model_dir = Path(resolve(Settings.load().engine_config()))
    items = load_rag(data, conversations, docs, words)
    done: dict[str, list[Turned]] = {arm: [] for arm in ARMS}
    seconds = dict.fromkeys(ARMS, 0.0)  # each arm's rounds, end to end
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-fleet-") as tmp, ExitStack() as stack:
        logs = Path(tmp)
        urls = stack.enter_context(replicas(kind, model_dir, venv, logs))
        redis_url = stack.enter_context(redis_server())
        upstreams = [{"name": f"replica-{i}", "base_url": f"{u}/v1", "models": [NAME]} for i, u in enumerate(urls)]
        fronts = {}
        for arm in ARMS:
            settings = Settings(
                proxy={"upstreams": upstreams, "routing": arm},
                redis_url=redis_url,
                semantic_cache={"enabled": False},
                cache_dir=logs / arm,
            )
            fronts[arm] = [stack.enter_context(front(settings)) for _ in range(2)]
        for url in urls:  # lazy start-up work is not measured
            stream(url, {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello."}]})
        for r in range(rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                started = time.perf_counter()
                done[arm] += run_arm(fronts[arm], items, f"{arm}-{r}", turns, tokens, clients)
                seconds[arm] += time.perf_counter() - started
                print(f"round {r}, {arm}: {time.perf_counter() - started:.0f} s", flush=True)
    rows = [summary(arm, done[arm], seconds[arm]) for arm in ARMS]
    head = ["routing", "TTFT p50 / p90, turns 2+ (s)", "TTFT p50 / p90, all (s)", "prompt cached", "turns/s", "stayed"]
    later = {arm: [t.ttft for t in done[arm] if t.turn > 0] for arm in ARMS}
    gain = {
        q: statistics.quantiles(later["round_robin"], n=100)[q - 1] / statistics.quantiles(later["cache"], n=100)[q - 1]
        for q in (50, 90)
    }
    where = f"two {kind} replicas (one thread each) behind two kvgate fronts on one Redis"
    body = (
        f"{where}; {conversations} conversations of {turns} turns ({docs} passages of ~{words} words in the first), "
        f"{clients} at once, {rounds} rounds per arm, {tokens}-token greedy answers.\n\n{table(head, rows)}\n\n"
        f"Cache-aware routing against round-robin, turns 2+: TTFT p50 {gain[50]:.2f}x, p90 {gain[90]:.2f}x better.\n"
    )
    write_section(output, f"fleet-{kind}", f"Routing over {where}", command, body)
    return body


def parser() -> argparse.ArgumentParser:
    """The command line (`kvgate bench` hands it the arguments as given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", choices=["vllm", "kvgate"], default="vllm")
    parser.add_argument("--data", type=Path, default=MUSIQUE)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each arm, alternating")
    parser.add_argument("--clients", type=int, default=2, help="conversations at once")
    parser.add_argument("--tokens", type=int, default=16, help="answer tokens per turn")
    parser.add_argument("--docs", type=int, default=4, help="passages in a conversation's first message")
    parser.add_argument("--words", type=int, default=120, help="words per passage")
    parser.add_argument("--venv", type=Path, default=user_cache_dir() / "vllm-venv", help="vLLM's virtualenv")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.data.is_file():
        print(f"{args.data}: no such data file (the shared MuSiQue set)", file=sys.stderr)
        return 2
    command = "python -m kvgate.bench.fleet " + " ".join(argv if argv is not None else sys.argv[1:])
    print(bench_fleet(args.replicas, args.data, args.conversations, args.turns, args.rounds, args.clients,
                      args.tokens, args.docs, args.words, args.venv, args.output, command))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
