"""`kvgate bench ...`: the command kvgate's benchmarks add to the CLI (entry point `bench` of the group
`kvgate.commands`, pyproject.toml): `add` (its argparse options), `passthrough` and `run`.

The CLI loads this module on every start (a proxy front included), so it imports no benchmark, no torch
and nothing of kvgate but the CLI's shared options; `run` imports the runner (benchmarks/runners.py)
when a command runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
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
    "exact": "exactness",
    "decode": "decode_step",
    "gpu": "gpu",
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


def selects(text: str) -> tuple[str, ...]:
    """Blend selection methods, comma-separated: "attention,random" -> ("attention", "random")."""
    found = tuple(x.strip() for x in text.split(",") if x.strip())
    if not found or not set(found) <= {"deviation", "attention", "random"}:
        raise argparse.ArgumentTypeError(f"{text!r}: deviation, attention or random, comma-separated")
    return found


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
    for name, module in MODULES.items():  # listed here; `kvgate` hands them their arguments unparsed
        kinds.add_parser(name, add_help=False, help=f"python -m kvgate.bench.{module} (its own options: --help)")
    for name, (text, options) in KINDS.items():
        parser = kinds.add_parser(name, parents=[common], help=text)
        options(parser)
        parser.add_argument("--output", type=Path, default=OUTPUT, help="the BENCHMARKS.md to write the section to")


def plot_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plot",
        nargs="?",
        const="",
        metavar="DIR",
        help="draw the section's figures as PNGs into DIR (alone: beside --output), each shown in the section "
        "after the table it is drawn from",
    )


def prefill_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model")
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each sequence decoded in a batch")
    parser.add_argument("--streams", default="1,2,4,8,16", help="sequences decoding together, comma-separated")
    plot_option(parser)


def answer_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--answer", type=int, help="the reference answer's tokens compared, greedy and teacher-forced (default 32)"
    )


def fidelity_options(parser: argparse.ArgumentParser) -> None:
    musique_args(parser, limit=6, offset=0, data=MUSIQUE)
    answer_option(parser)
    parser.add_argument("--shuffle", action="store_true", help="documents in a fixed random order per item")
    parser.add_argument("--ratios", default="0,5,10,15,20,30,50", help="blend recompute ratios, percent")
    # The blend's other settings (BlendConfig); any given names the section, so variants do not overwrite it.
    parser.add_argument(
        "--select", choices=["deviation", "attention", "random"], help="how the blend picks tokens to recompute"
    )
    parser.add_argument("--first-k", type=count, help="always recompute each document's first N tokens")
    parser.add_argument("--check-layers", type=layers, help="layers where tokens are selected, e.g. 1,4")
    parser.add_argument("--widen", type=float, help="tokens kept at each earlier check layer, times")
    parser.add_argument(
        "--document-kv",
        choices=["alone", "context"],
        default="alone",
        help="each document's KV computed alone, or from a dense prefill of the same documents in the other order",
    )
    parser.add_argument(
        "--retrieval",
        type=count,
        default=0,
        help="also score every mode by answer accuracy on this many retrieval tasks (a fact in one of --docs "
        "documents, asked for; runtime/retrieval_task.py), against full prefill's (0: none; 24 in BENCHMARKS.md)",
    )
    parser.add_argument("--retrieval-words", type=int, default=100, help="words per retrieval document (>= 20)")
    plot_option(parser)


def error_sources_options(parser: argparse.ArgumentParser) -> None:
    musique_args(parser, limit=6, offset=0, data=MUSIQUE)
    parser.add_argument("--shuffle", action="store_true", help="documents in a fixed random order per item")


def ttft_options(parser: argparse.ArgumentParser) -> None:
    musique_args(parser, limit=6, offset=0, data=MUSIQUE)
    parser.add_argument("--ratio", type=float, help="blend recompute ratio, percent (default: the calibrated one)")
    parser.add_argument("--ratios", default="", help="more blend ratios to time, percent, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="timings per mode and item; the fastest is kept")
    parser.add_argument(
        "--also-select",
        type=selects,
        default=(),
        metavar="METHOD[,METHOD]",
        help="blends selecting their tokens by these methods too (deviation, attention, random), at the same ratios",
    )
    plot_option(parser)


def ttft_lengths_options(parser: argparse.ArgumentParser) -> None:
    musique_args(parser, limit=3, offset=0, data=MUSIQUE)
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="prompt tokens, comma-separated")
    parser.add_argument("--ratio", type=float, default=15.0, help="blend recompute ratio, percent")
    parser.add_argument("--repeats", type=int, default=2, help="timings per mode and item; the fastest is kept")
    plot_option(parser)


def grammar_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=1000, help="forced calls, and as many json_schema answers")
    parser.add_argument("--batch", type=int, default=16, help="requests decoding together")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per sequence when timing steps")
    parser.add_argument("--max-tokens", type=int, default=160, help="max_tokens of each checked request")


def tiers_options(parser: argparse.ArgumentParser) -> None:
    musique_args(parser, limit=3, offset=0, data=MUSIQUE)
    parser.add_argument("--ratio", type=float, default=15.0, help="blend recompute ratio, percent")
    parser.add_argument("--repeats", type=int, default=2, help="timings per load and prefill; the fastest is kept")
    parser.add_argument("--redis-url", help="an existing Redis (default: a redis-server started for the run)")


def compressed_options(parser: argparse.ArgumentParser) -> None:
    musique_args(parser, limit=6, offset=0, data=MUSIQUE)
    parser.add_argument("--ratio", type=float, default=15.0, help="blend recompute ratio, percent")
    parser.add_argument("--repeats", type=int, default=2, help="timings per load and blend; the fastest is kept")
    parser.add_argument("--redis-url", help="an existing Redis (default: a redis-server started for the run)")


def semantic_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=QQP, help="QQP pairs jsonl (a, b, duplicate)")
    parser.add_argument("--limit", type=int, default=20000, help="pairs (the first rows of the data file)")
    parser.add_argument("--traps", type=int, default=1000, help="synthetic traps per type")
    parser.add_argument("--sizes", default="1000,10000,100000", help="cache sizes for the latency, entries")
    parser.add_argument("--queries", type=int, default=1000, help="lookups timed at each size")
    parser.add_argument("--gateway", type=int, default=8, help="questions asked through the gateway (0: none)")
    parser.add_argument(
        "--fit-verifier",
        type=Path,
        metavar="PATH",
        help="first fit the verifier on the fit half, write it to PATH and measure it "
        "(semantic_cache/verifier.npz is the one shipped)",
    )
    plot_option(parser)


def agents_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--programs", type=int, default=10, help="programs run live through the gateway")
    parser.add_argument("--rate", type=float, default=0.125, help="program arrivals per second (Poisson)")
    parser.add_argument("--memory-mb", type=int, default=160, help="the KV memory tier's budget, MiB")
    parser.add_argument("--fixed-ttl", type=float, default=4.0, help="the TTL of the fixed-TTL policy, seconds")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens each turn generates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workloads",
        type=count,
        default=1,
        help="live workloads (seeds from --seed), every policy on each, pooled (0: simulation only)",
    )
    parser.add_argument(
        "--client",
        choices=["agents-sdk", "openai"],
        default="agents-sdk",
        help="what drives each program's tool loop: the OpenAI Agents SDK (no kvgate field), or the openai SDK "
        "with kvgate's program header",
    )
    parser.add_argument(
        "--data", type=Path, default=MUSIQUE, help="MuSiQue jsonl: the text of prompts and tool results"
    )
    parser.add_argument(
        "--sim-programs",
        type=int,
        default=300,
        help="programs in the simulator (0: no simulation; with --sweep 0 too, the live run writes a section of "
        "its own, agents-live-PROGRAMS)",
    )
    parser.add_argument(
        "--sweep",
        type=int,
        default=0,
        metavar="PROGRAMS",
        help="also simulate every regime of arrival rate x memory x tool-duration spread with PROGRAMS programs "
        "each, and check decided pins against the best of off and fixed (0: no sweep)",
    )
    parser.add_argument(
        "--policies",
        type=policies,
        default=None,
        help="the live policies, comma-separated pins+queue[+in flight per context memory holds] "
        "(e.g. off+program,decide+program+2; default: all six without a limit; "
        "off+fcfs, the baseline, always runs)",
    )


def multiagent_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=GSM8K, help="GSM8K jsonl: the questions")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--agents", type=int, default=5, help="2 to 5")
    parser.add_argument("--ratio", type=float, default=0.15, help="span tokens blend and kvcomm recompute")
    parser.add_argument("--written", type=int, default=128, help="tokens each agent's answer has at most")
    parser.add_argument("--repeats", type=int, default=2, help="timings per mode and turn; the fastest is kept")
    answer_option(parser)
    plot_option(parser)


def gateway_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per path")
    parser.add_argument("--litellm", type=Path, help="LiteLLM's proxy command (default: a venv of its own)")
    parser.add_argument("--no-litellm", action="store_true", help="no LiteLLM row")


def front_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit, measured beside this one")
    parser.add_argument("--runs", type=int, default=5, help="starts of each front; the median is kept")


def engines_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vs", choices=["vllm"], default="vllm", help="the engine to measure against")
    parser.add_argument("--model", help="the HF directory both serve (default: the one `kvgate convert` writes)")
    parser.add_argument("--data", type=Path, default=MUSIQUE, help="MuSiQue RAG jsonl: documents and questions")
    parser.add_argument("--repeats", type=int, default=3, help="requests per row and engine (new documents each)")
    parser.add_argument("--words", type=int, default=300, help="words per document (300: ~2.8k-token RAG prompts)")
    parser.add_argument(
        "--cores",
        type=int,
        default=0,
        help="both engines computing on cores 0..N-1 (taskset, kvgate's threads, vLLM's OMP binding; "
        "0: each engine's own defaults)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="both engines' dtype: auto (each its own), float32, bfloat16; comma-separated: one section each",
    )
    parser.add_argument(
        "--venv", type=Path, help="vLLM's virtualenv, made on first use (default: the user cache's vllm-venv)"
    )
    parser.add_argument(
        "--streams",
        default="1,8",
        help="concurrent streams of the decode rows, comma-separated (1: 128 tokens, more: 64 tokens each)",
    )
    plot_option(parser)


def chunks_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=MUSIQUE, help="MuSiQue RAG jsonl: documents and questions")
    parser.add_argument("--questions", type=int, default=5, help="items, each 6 new documents of ~300 words")


def precision_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=MUSIQUE, help="MuSiQue RAG jsonl: documents and questions")
    parser.add_argument("--docs", type=int, default=6, help="passages per item")
    parser.add_argument("--limit", type=int, default=10, help="items")
    parser.add_argument("--tokens", type=int, default=16, help="greedy answer tokens compared")


KINDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {  # kind: its help, its options
    "prefill": ("prefill and decode tokens/s by prompt length", prefill_options),
    "fidelity": ("how far each reuse mode moves the answer from full prefill", fidelity_options),
    "error-sources": ("where the error of reused document KV comes from: repairs and an oracle", error_sources_options),
    "ttft": ("time to first token of each reuse mode against full prefill", ttft_options),
    "ttft-lengths": ("time to first token of each reuse mode against prompt length", ttft_lengths_options),
    "grammar": ("constrained decoding: forced calls and json_schema answers checked, cost per step", grammar_options),
    "tiers": ("load bandwidth of each chunk cache tier, and TTFT of a blend from it", tiers_options),
    "compressed": ("compressed document KV on disk and Redis: size, load, blend TTFT, fidelity", compressed_options),
    "semantic": ("semantic cache: hit precision/recall, traps, lookup latency", semantic_options),
    "agents": ("agent programs: JCT of TTL pins and program FCFS, live and simulated", agents_options),
    "multiagent": ("agents reading each other's answers: KVCOMM against dense", multiagent_options),
    "gateway": ("latency proxy mode adds, against calling the upstream directly", gateway_options),
    "front": ("start-up time and memory of a proxy-mode front (no model, no semantic cache)", front_options),
    "engines": ("kvgate's default server against vLLM's CPU build, side by side, in one run", engines_options),
    "chunks": ("documents pasted into the prompt, found by their content, against full prefill", chunks_options),
    "precision": ("bf16 against fp32, both full prefill: speed and how far the answer moves", precision_options),
}


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
