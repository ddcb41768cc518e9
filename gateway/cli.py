"""The `kvgate` command: serve, convert, calibrate, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvgate.gateway.settings import Settings
from kvgate.runtime.loader import ModelNotFound
from pydantic import ValidationError

# The shared evaluation data sits beside the project: ../shared/data.
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_rag_dev.jsonl"
GSM8K = DATA.with_name("gsm8k_dev.jsonl")
QQP = DATA.with_name("qqp_pairs_dev.jsonl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate", description="OpenAI-compatible gateway with KV reuse")
    parser.add_argument("--config", type=Path, help="YAML settings file (also KVGATE_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the gateway with the embedded runtime")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name")
    serve.add_argument("--workers", type=int, help="runtime worker processes behind this front (0: in-process)")

    convert = sub.add_parser("convert", help="convert the model once to the safetensors cache")
    convert.add_argument("--model")

    bench = sub.add_parser("bench", help="measurements written to benchmarks/BENCHMARKS.md")
    kinds = bench.add_subparsers(dest="kind", required=True)
    prefill = kinds.add_parser("prefill", help="prefill and decode tokens/s by prompt length")
    prefill.add_argument("--model")
    prefill.add_argument("--lengths", default="512,1024,2048,4096")
    prefill.add_argument("--decode-tokens", type=int, default=32)
    prefill.add_argument("--repeats", type=int, default=2)
    prefill.add_argument("--output", type=Path, default=Path("benchmarks/BENCHMARKS.md"))

    fidelity = kinds.add_parser("fidelity", help="how far each reuse mode moves the answer from full prefill")
    musique_args(fidelity, limit=6, offset=0)
    fidelity.add_argument("--shuffle", action="store_true", help="documents in a fixed random order per item")
    fidelity.add_argument("--ratios", default="0,5,10,15,20,30,50", help="blend recompute ratios, percent")
    fidelity.add_argument("--output", type=Path, default=Path("benchmarks/BENCHMARKS.md"))

    ttft = kinds.add_parser("ttft", help="time to first token of each reuse mode against full prefill")
    musique_args(ttft, limit=6, offset=0)
    ttft.add_argument("--ratio", type=float, help="blend recompute ratio, percent (default: the calibrated one)")
    ttft.add_argument("--ratios", default="", help="more blend ratios to time, percent, comma-separated")
    ttft.add_argument("--repeats", type=int, default=2, help="timings per mode and item; the fastest is kept")
    ttft.add_argument("--output", type=Path, default=Path("benchmarks/BENCHMARKS.md"))

    tiers = kinds.add_parser("tiers", help="load bandwidth of each chunk cache tier, and TTFT of a blend from it")
    musique_args(tiers, limit=3, offset=0)
    tiers.add_argument("--ratio", type=float, default=15.0, help="blend recompute ratio, percent")
    tiers.add_argument("--repeats", type=int, default=2, help="timings per load and prefill; the fastest is kept")
    tiers.add_argument("--redis-url", help="an existing Redis (default: a redis-server started for the run)")
    tiers.add_argument("--output", type=Path, default=Path("benchmarks/BENCHMARKS.md"))

    semantic = kinds.add_parser("semantic", help="semantic cache: hit precision/recall, traps, lookup latency")
    semantic.add_argument("--data", type=Path, default=QQP, help="QQP pairs jsonl (a, b, duplicate)")
    semantic.add_argument("--limit", type=int, default=20000, help="pairs (the first rows of the data file)")
    semantic.add_argument("--traps", type=int, default=1000, help="synthetic traps per type")
    semantic.add_argument("--sizes", default="1000,10000,100000", help="cache sizes for the latency, entries")
    semantic.add_argument("--queries", type=int, default=1000, help="lookups timed at each size")
    semantic.add_argument("--gateway", type=int, default=8, help="questions asked through the gateway (0: none)")
    semantic.add_argument("--output", type=Path, default=Path("benchmarks/BENCHMARKS.md"))

    agents = kinds.add_parser("agents", help="agent programs: JCT of TTL pins and program FCFS, live and simulated")
    agents.add_argument("--programs", type=int, default=10, help="programs run live through the gateway")
    agents.add_argument("--rate", type=float, default=0.125, help="program arrivals per second (Poisson)")
    agents.add_argument("--memory-mb", type=int, default=160, help="the KV memory tier's budget, MiB")
    agents.add_argument("--fixed-ttl", type=float, default=4.0, help="the TTL of the fixed-TTL policy, seconds")
    agents.add_argument("--output-tokens", type=int, default=16, help="tokens each turn generates")
    agents.add_argument("--seed", type=int, default=0)
    agents.add_argument("--data", type=Path, default=DATA, help="MuSiQue jsonl: the text of prompts and tool results")
    agents.add_argument("--sim-programs", type=int, default=300, help="programs in the simulator (0: no simulation)")
    agents.add_argument("--output", type=Path, default=Path("benchmarks/BENCHMARKS.md"))

    multiagent = kinds.add_parser("multiagent", help="agents reading each other's answers: KVCOMM against dense")
    multiagent.add_argument("--data", type=Path, default=GSM8K, help="GSM8K jsonl: the questions")
    multiagent.add_argument("--questions", type=int, default=8)
    multiagent.add_argument("--agents", type=int, default=5, help="2 to 5")
    multiagent.add_argument("--ratio", type=float, default=0.15, help="span tokens blend and kvcomm recompute")
    multiagent.add_argument("--written", type=int, default=128, help="tokens each agent's answer has at most")
    multiagent.add_argument("--output", type=Path, default=Path("benchmarks/BENCHMARKS.md"))

    gateway = kinds.add_parser("gateway", help="latency proxy mode adds, against calling the upstream directly")
    gateway.add_argument("--requests", type=int, default=2000, help="timed requests per path")
    gateway.add_argument("--output", type=Path, default=Path("benchmarks/BENCHMARKS.md"))

    calibrate = sub.add_parser("calibrate", help="pick and store the model's blend recompute ratio")
    musique_args(calibrate, limit=8, offset=100)
    calibrate.add_argument("--target", type=float, default=0.95, help="the fidelity the ratio must reach")
    calibrate.add_argument(
        "--metric",
        choices=["top1", "kl"],
        default="top1",
        help="top1: mean teacher-forced top-1 agreement over 32 answer positions, at least the target; "
        "kl: mean first-token KL, at most the target",
    )
    calibrate.add_argument("--ratios", default="0,5,10,15,20,30,50", help="candidate ratios, percent")
    calibrate.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="documents in a fixed random order per item (default: yes, as requests cite them in any order)",
    )
    calibrate.add_argument("--report", type=Path, help="also write the curve as a section of this BENCHMARKS.md")

    args = parser.parse_args(argv)
    flags = {k: getattr(args, k, None) for k in ("host", "port", "model", "served_model_name", "workers")}
    try:
        settings = Settings.load(args.config, **flags)
        return run(args, settings, argv)
    except (ValidationError, ModelNotFound, OSError) as exc:
        print(f"kvgate: error: {exc}", file=sys.stderr)
        return 2


def musique_args(parser: argparse.ArgumentParser, limit: int, offset: int) -> None:
    parser.add_argument("--model")
    parser.add_argument("--data", type=Path, default=DATA, help="MuSiQue RAG jsonl (question, passages)")
    parser.add_argument("--docs", type=int, default=6, help="passages per question, as documents")
    parser.add_argument("--limit", type=int, default=limit, help="items")
    parser.add_argument("--offset", type=int, default=offset, help="first item (row) of the data file")
    parser.add_argument("--words", type=int, default=0, help="cut each passage to its first N words (0: whole)")


def check_numbers(args: argparse.Namespace) -> None:
    from kvgate.bench.fidelity import DataError

    for name in ("docs", "limit", "repeats"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise DataError(f"--{name} must be at least 1")
    if getattr(args, "offset", 0) < 0 or getattr(args, "words", 0) < 0:
        raise DataError("--offset and --words cannot be negative")
    ratio = getattr(args, "ratio", None)
    if ratio is not None and not 0.0 <= ratio <= 100.0:
        raise DataError("--ratio is a percentage between 0 and 100")


def run(args: argparse.Namespace, settings: Settings, argv: list[str] | None) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "convert":
        from kvgate.runtime.loader import resolve

        print(resolve(settings.engine_config(), progress=True))
        return 0
    command = " ".join(["kvgate", *(argv if argv is not None else sys.argv[1:])])
    if args.command == "calibrate" or (
        args.command == "bench" and args.kind in ("fidelity", "ttft", "tiers", "semantic")
    ):
        from kvgate.bench.fidelity import DataError

        try:
            return measure(args, settings, command)
        except DataError as exc:
            print(f"kvgate: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "bench" and args.kind == "agents":
        from kvgate.bench.agents import bench_agents

        bench_agents(
            settings,
            args.programs,
            args.rate,
            args.memory_mb,
            args.fixed_ttl,
            args.output_tokens,
            args.seed,
            args.data,
            args.sim_programs,
            args.output,
            command,
        )
        return 0
    if args.command == "bench" and args.kind == "multiagent":
        from kvgate.bench.multiagent import bench_multiagent

        checks = [
            (args.data.is_file(), f"{args.data} is missing (the shared evaluation data)"),
            (2 <= args.agents <= 5, "--agents must be 2 to 5"),
            (args.questions >= 1 and args.written >= 1, "--questions and --written must be at least 1"),
            (0 <= args.ratio <= 1, "--ratio must be within 0 and 1"),
        ]
        if problem := next((message for ok, message in checks if not ok), ""):
            print(f"kvgate: error: {problem}", file=sys.stderr)
            return 2
        config = settings.engine_config()
        bench_multiagent(config, args.data, args.questions, args.agents, args.ratio, args.output, command, args.written)
        return 0
    if args.command == "bench" and args.kind == "gateway":
        from kvgate.bench.gateway import bench_gateway

        for name, found in bench_gateway(args.requests, args.output, command).items():
            print(f"{name}: p50 {found['p50']:.2f} ms, p99 {found['p99']:.2f} ms")
        return 0
    if args.command == "bench":
        from kvgate.bench.prefill import bench_prefill

        lengths = [int(x) for x in args.lengths.split(",")]
        bench_prefill(settings.engine_config(), lengths, args.decode_tokens, args.repeats, args.output, command)
        return 0
    from kvgate.gateway.serve import serve_forever

    return serve_forever(settings)


def measure(args: argparse.Namespace, settings: Settings, command: str) -> int:
    """`kvgate calibrate`, `kvgate bench fidelity` and `kvgate bench ttft`."""
    from kvgate.bench.fidelity import parse_ratios

    check_numbers(args)
    if args.command == "calibrate":
        from kvgate.bench.calibrate import calibrate

        calibrate(
            settings.engine_config(),
            args.data,
            args.docs,
            args.limit,
            args.offset,
            args.target,
            args.metric,
            parse_ratios(args.ratios),
            args.shuffle,
            args.words,
            args.report,
            command,
        )
        return 0
    if args.command == "bench" and args.kind == "fidelity":
        from kvgate.bench.fidelity import bench_fidelity

        bench_fidelity(
            settings.engine_config(),
            args.data,
            args.docs,
            args.limit,
            parse_ratios(args.ratios),
            args.shuffle,
            args.words,
            args.offset,
            args.output,
            command,
        )
        return 0
    if args.command == "bench" and args.kind == "ttft":
        from kvgate.bench.ttft import bench_ttft

        bench_ttft(
            settings.engine_config(),
            args.data,
            args.docs,
            args.limit,
            None if args.ratio is None else args.ratio / 100,
            parse_ratios(args.ratios) if args.ratios.strip() else [],
            args.repeats,
            args.words,
            args.offset,
            args.output,
            command,
        )
        return 0
    if args.command == "bench" and args.kind == "tiers":
        from kvgate.bench.tiers import bench_tiers

        bench_tiers(
            settings.engine_config(),
            args.data,
            args.docs,
            args.limit,
            args.ratio / 100,
            args.repeats,
            args.redis_url,
            args.output,
            command,
        )
        return 0
    if args.command == "bench" and args.kind == "semantic":
        from kvgate.bench.fidelity import DataError
        from kvgate.bench.semantic import bench_semantic

        try:
            sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        except ValueError:
            raise DataError(f"--sizes {args.sizes!r}: entry counts, comma-separated") from None
        bench_semantic(
            args.data, args.limit, args.traps, sizes, args.queries, args.gateway, settings, args.output, command
        )
        return 0
    raise AssertionError(f"not a measurement: {args.command}")


if __name__ == "__main__":
    sys.exit(main())
