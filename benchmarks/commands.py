"""`kvgate bench ...`: the command kvgate's benchmarks add to the CLI (entry point `bench` of the group
`kvgate.commands`, pyproject.toml): `add` (its argparse options), `passthrough` and `run`.

The CLI loads this module on every start (a proxy front included), so it imports no benchmark, no torch
and nothing of kvgate but the CLI's shared options; `run` imports the runner (benchmarks/runners.py)
when a command runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.gateway.cli import musique_args

if TYPE_CHECKING:
    from kvgate.gateway.settings import Settings

# The shared evaluation data sits beside the project: ../shared/data.
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
MUSIQUE = SHARED / "musique_rag_dev.jsonl"
GSM8K = SHARED / "gsm8k_dev.jsonl"
QQP = SHARED / "qqp_pairs_dev.jsonl"
OUTPUT = Path("benchmarks/BENCHMARKS.md")
# Benchmarks with a command line of their own (`python -m kvgate.bench.<module>`): `kvgate bench KIND ARGS`
# hands them ARGS as they are.
MODULES = {
    "fleet": "fleet",
    "gate": "gate",
    "gate-load": "gate_load",
    "shapes": "shapes",
    "embedders": "embedders",
}


def count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number, 0 or more")
    return int(text)


def layers(text: str) -> tuple[int, ...]:
    """Layer indices, comma-separated: "1,8" -> (1, 8)."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isdigit() for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: layer indices, comma-separated")
    return tuple(sorted({int(x) for x in parts}))


def policies(text: str) -> list[tuple[str, str, float]]:
    """Pin and queue policies, and programs in flight per context memory holds:
    "off+fcfs,decide+program+2" -> [("off", "fcfs", 0.0), ("decide", "program", 2.0)]."""
    out = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        pins, _, rest = part.partition("+")
        queue, _, in_flight = rest.partition("+")
        try:
            flight = float(in_flight or 0)
        except ValueError:
            flight = -1.0
        if pins not in ("off", "fixed", "decide") or queue not in ("fcfs", "program") or flight < 0:
            raise argparse.ArgumentTypeError(
                f"{part!r}: PINS+QUEUE[+IN_FLIGHT], PINS off, fixed or decide, QUEUE fcfs or program, IN_FLIGHT >= 0"
            )
        out.append((pins, queue, flight))
    return out


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """`kvgate bench KIND`; `common`: the options every (sub)command accepts (--config)."""
    bench = sub.add_parser("bench", parents=[common], help=f"measurements written to {OUTPUT}")
    kinds = bench.add_subparsers(dest="kind", required=True)

    def kind(name: str, text: str) -> argparse.ArgumentParser:
        return kinds.add_parser(name, parents=[common], help=text)

    for name, module in MODULES.items():  # listed here; `kvgate` hands them their arguments unparsed
        kinds.add_parser(name, add_help=False, help=f"python -m kvgate.bench.{module} (its own options: --help)")

    prefill = kind("prefill", "prefill and decode tokens/s by prompt length")
    prefill.add_argument("--model")
    prefill.add_argument("--lengths", default="512,1024,2048,4096")
    prefill.add_argument("--decode-tokens", type=int, default=32)
    prefill.add_argument("--repeats", type=int, default=2)

    fidelity = kind("fidelity", "how far each reuse mode moves the answer from full prefill")
    musique_args(fidelity, limit=6, offset=0, data=MUSIQUE)
    fidelity.add_argument("--shuffle", action="store_true", help="documents in a fixed random order per item")
    fidelity.add_argument("--ratios", default="0,5,10,15,20,30,50", help="blend recompute ratios, percent")
    # The blend's other settings (BlendConfig); any given names the section, so variants do not overwrite it.
    fidelity.add_argument(
        "--select", choices=["deviation", "attention", "random"], help="how the blend picks tokens to recompute"
    )
    fidelity.add_argument("--first-k", type=count, help="always recompute each document's first N tokens")
    fidelity.add_argument("--check-layers", type=layers, help="layers where tokens are selected, e.g. 1,4")
    fidelity.add_argument("--widen", type=float, help="tokens kept at each earlier check layer, times")
    fidelity.add_argument(
        "--document-kv",
        choices=["alone", "context"],
        default="alone",
        help="each document's KV computed alone, or from a dense prefill of the same documents in the other order",
    )

    sources = kind("error-sources", "where the error of reused document KV comes from: repairs and an oracle")
    musique_args(sources, limit=6, offset=0, data=MUSIQUE)
    sources.add_argument("--shuffle", action="store_true", help="documents in a fixed random order per item")

    ttft = kind("ttft", "time to first token of each reuse mode against full prefill")
    musique_args(ttft, limit=6, offset=0, data=MUSIQUE)
    ttft.add_argument("--ratio", type=float, help="blend recompute ratio, percent (default: the calibrated one)")
    ttft.add_argument("--ratios", default="", help="more blend ratios to time, percent, comma-separated")
    ttft.add_argument("--repeats", type=int, default=2, help="timings per mode and item; the fastest is kept")

    grammar = kind("grammar", "constrained decoding: forced calls and json_schema answers checked, cost per step")
    grammar.add_argument("--requests", type=int, default=1000, help="forced calls, and as many json_schema answers")
    grammar.add_argument("--batch", type=int, default=16, help="requests decoding together")
    grammar.add_argument("--tokens", type=int, default=48, help="tokens per sequence when timing steps")
    grammar.add_argument("--max-tokens", type=int, default=160, help="max_tokens of each checked request")

    tiers = kind("tiers", "load bandwidth of each chunk cache tier, and TTFT of a blend from it")
    musique_args(tiers, limit=3, offset=0, data=MUSIQUE)
    tiers.add_argument("--ratio", type=float, default=15.0, help="blend recompute ratio, percent")
    tiers.add_argument("--repeats", type=int, default=2, help="timings per load and prefill; the fastest is kept")
    tiers.add_argument("--redis-url", help="an existing Redis (default: a redis-server started for the run)")

    compressed = kind("compressed", "compressed document KV on disk and Redis: size, load, blend TTFT, fidelity")
    musique_args(compressed, limit=6, offset=0, data=MUSIQUE)
    compressed.add_argument("--ratio", type=float, default=15.0, help="blend recompute ratio, percent")
    compressed.add_argument("--repeats", type=int, default=2, help="timings per load and blend; the fastest is kept")
    compressed.add_argument("--redis-url", help="an existing Redis (default: a redis-server started for the run)")

    semantic = kind("semantic", "semantic cache: hit precision/recall, traps, lookup latency")
    semantic.add_argument("--data", type=Path, default=QQP, help="QQP pairs jsonl (a, b, duplicate)")
    semantic.add_argument("--limit", type=int, default=20000, help="pairs (the first rows of the data file)")
    semantic.add_argument("--traps", type=int, default=1000, help="synthetic traps per type")
    semantic.add_argument("--sizes", default="1000,10000,100000", help="cache sizes for the latency, entries")
    semantic.add_argument("--queries", type=int, default=1000, help="lookups timed at each size")
    semantic.add_argument("--gateway", type=int, default=8, help="questions asked through the gateway (0: none)")
    semantic.add_argument(
        "--fit-verifier",
        type=Path,
        metavar="PATH",
        help="first fit the verifier on the fit half, write it to PATH and measure it "
        "(semantic_cache/verifier.npz is the one shipped)",
    )

    agents = kind("agents", "agent programs: JCT of TTL pins and program FCFS, live and simulated")
    agents.add_argument("--programs", type=int, default=10, help="programs run live through the gateway")
    agents.add_argument("--rate", type=float, default=0.125, help="program arrivals per second (Poisson)")
    agents.add_argument("--memory-mb", type=int, default=160, help="the KV memory tier's budget, MiB")
    agents.add_argument("--fixed-ttl", type=float, default=4.0, help="the TTL of the fixed-TTL policy, seconds")
    agents.add_argument("--output-tokens", type=int, default=16, help="tokens each turn generates")
    agents.add_argument("--seed", type=int, default=0)
    agents.add_argument(
        "--workloads",
        type=count,
        default=1,
        help="live workloads (seeds from --seed), every policy on each, pooled (0: simulation only)",
    )
    agents.add_argument(
        "--client",
        choices=["agents-sdk", "openai"],
        default="agents-sdk",
        help="what drives each program's tool loop: the OpenAI Agents SDK (no kvgate field), or the openai SDK "
        "with kvgate's program header",
    )
    agents.add_argument(
        "--data", type=Path, default=MUSIQUE, help="MuSiQue jsonl: the text of prompts and tool results"
    )
    agents.add_argument(
        "--sim-programs",
        type=int,
        default=300,
        help="programs in the simulator (0: no simulation; with --sweep 0 too, the live run writes a section of "
        "its own, agents-live-PROGRAMS)",
    )
    agents.add_argument(
        "--sweep",
        type=int,
        default=0,
        metavar="PROGRAMS",
        help="also simulate every regime of arrival rate x memory x tool-duration spread with PROGRAMS programs "
        "each, and check decided pins against the best of off and fixed (0: no sweep)",
    )
    agents.add_argument(
        "--policies",
        type=policies,
        default=None,
        help="the live policies, comma-separated pins+queue[+in flight per context memory holds] "
        "(e.g. off+program,decide+program+2; default: all six without a limit; "
        "off+fcfs, the baseline, always runs)",
    )

    multiagent = kind("multiagent", "agents reading each other's answers: KVCOMM against dense")
    multiagent.add_argument("--data", type=Path, default=GSM8K, help="GSM8K jsonl: the questions")
    multiagent.add_argument("--questions", type=int, default=8)
    multiagent.add_argument("--agents", type=int, default=5, help="2 to 5")
    multiagent.add_argument("--ratio", type=float, default=0.15, help="span tokens blend and kvcomm recompute")
    multiagent.add_argument("--written", type=int, default=128, help="tokens each agent's answer has at most")

    gateway = kind("gateway", "latency proxy mode adds, against calling the upstream directly")
    gateway.add_argument("--requests", type=int, default=2000, help="timed requests per path")
    gateway.add_argument("--litellm", type=Path, help="LiteLLM's proxy command (default: a venv of its own)")
    gateway.add_argument("--no-litellm", action="store_true", help="no LiteLLM row")

    front = kind("front", "start-up time and memory of a proxy-mode front (no model, no semantic cache)")
    front.add_argument("--before", type=Path, help="a checkout of an earlier commit, measured beside this one")
    front.add_argument("--runs", type=int, default=5, help="starts of each front; the median is kept")

    engines = kind("engines", "kvgate's default server against vLLM's CPU build, side by side, in one run")
    engines.add_argument("--vs", choices=["vllm"], default="vllm", help="the engine to measure against")
    engines.add_argument("--model", help="the HF directory both serve (default: the one `kvgate convert` writes)")
    engines.add_argument("--data", type=Path, default=MUSIQUE, help="MuSiQue RAG jsonl: documents and questions")
    engines.add_argument("--repeats", type=int, default=3, help="requests per row and engine (new documents each)")
    engines.add_argument(
        "--cores", type=int, default=0, help="both engines computing on this many cores (0: each engine's defaults)"
    )
    engines.add_argument(
        "--kvgate-dtype", choices=["float32", "bfloat16"], help="kvgate's dtype (default: its own, auto)"
    )
    engines.add_argument(
        "--venv", type=Path, help="vLLM's virtualenv, made on first use (default: the user cache's vllm-venv)"
    )

    chunks = kind("chunks", "documents pasted into the prompt, found by their content, against full prefill")
    chunks.add_argument("--data", type=Path, default=MUSIQUE, help="MuSiQue RAG jsonl: documents and questions")
    chunks.add_argument("--questions", type=int, default=5, help="items, each 6 new documents of ~300 words")

    precision = kind("precision", "bf16 against fp32, both full prefill: speed and how far the answer moves")
    precision.add_argument("--data", type=Path, default=MUSIQUE, help="MuSiQue RAG jsonl: documents and questions")
    precision.add_argument("--docs", type=int, default=6, help="passages per item")
    precision.add_argument("--limit", type=int, default=10, help="items")
    precision.add_argument("--tokens", type=int, default=16, help="greedy answer tokens compared")

    every = (prefill, fidelity, sources, ttft, grammar, tiers, compressed, semantic, agents, multiagent, gateway, front)
    every += (engines, chunks, precision)
    for each in every:
        each.add_argument("--output", type=Path, default=OUTPUT, help="the BENCHMARKS.md to write the section to")


def passthrough(argv: list[str]) -> argparse.Namespace | None:
    """`kvgate bench KIND ARGS` of a benchmark with a command line of its own: ARGS handed over unparsed
    (`rest`, for `python -m kvgate.bench.<module>`'s own parser); None for any other command line."""
    if argv[:1] != ["bench"] or (kind := argv[1] if len(argv) > 1 else "") not in MODULES:
        return None
    return argparse.Namespace(command="bench", kind=kind, module=f"kvgate.bench.{MODULES[kind]}", rest=argv[2:])


def run(args: argparse.Namespace, settings: Settings, command: str) -> int:
    """Run `kvgate bench KIND` as parsed: the gateway's one way into the benchmarks (an entry point of
    `kvgate.commands`, pyproject.toml). Data that cannot give an item is the user's error (DataError:
    `kvgate: error:`, exit 2, where the CLI reports it), not a traceback."""
    from kvgate.bench.runners import RUNNERS

    return RUNNERS[f"bench {args.kind}"](args, settings, command)


add = add_bench
