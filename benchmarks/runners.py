"""What each `kvgate bench KIND` runs, given its parsed arguments and the settings.

The one way in (`kvgate.bench.commands.run`, the `bench` command's entry point): each runner imports
its benchmark when it runs, so importing this module loads nothing heavy."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.bench.data import DataError
from kvgate.gateway.cli import counts, percentages

if TYPE_CHECKING:
    from kvgate.gateway.settings import Settings


BLEND = ("select", "first_k", "check_layers", "widen")  # the BlendConfig fields `bench fidelity` takes


def blend_options(args: argparse.Namespace) -> dict[str, object]:
    """The BlendConfig fields given on the command line (none: the defaults throughout)."""
    return {name: getattr(args, name) for name in BLEND if getattr(args, name, None) is not None}


def answer_tokens(args: argparse.Namespace) -> dict[str, int]:
    """--answer where given; else the bench's own default."""
    return {} if args.answer is None else {"answer": args.answer}


def plots(args: argparse.Namespace) -> Path | None:
    """Where `--plot` puts the figures: None without it; given no folder, beside the BENCHMARKS.md written."""
    if args.plot is None:
        return None
    return args.output.parent if args.plot == "" else Path(args.plot)


def check_numbers(args: argparse.Namespace) -> None:
    for name in ("docs", "limit", "repeats", "requests", "batch", "tokens", "max_tokens", "answer", "context"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise DataError(f"--{name} must be at least 1")
    if getattr(args, "offset", 0) < 0 or getattr(args, "words", 0) < 0:
        raise DataError("--offset and --words cannot be negative")
    ratio = getattr(args, "ratio", None)
    if ratio is not None and not 0.0 <= ratio <= 100.0:
        raise DataError("--ratio is a percentage between 0 and 100")


def run_grammar(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.grammar import bench_grammar

    check_numbers(args)
    print(bench_grammar(settings, args.requests, args.batch, args.tokens, args.max_tokens, args.output, command))
    return 0


def run_prefill(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.prefill import bench_prefill

    check_numbers(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    config = settings.engine_config()
    bench_prefill(
        config, lengths, args.decode_tokens, args.repeats, args.output, command, args.context, counts(args.streams),
        plots(args),
    )  # fmt: skip
    return 0


def run_fidelity(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.fidelity import bench_fidelity
    from kvgate.runtime.blend import BlendConfig

    check_numbers(args)
    if args.retrieval and (args.docs < 2 or args.retrieval_words < 20):
        raise DataError("--retrieval needs --docs >= 2 and --retrieval-words >= 20")
    ratios = list(percentages(args.ratios))
    config = settings.engine_config()
    bench_fidelity(
        config,
        args.data,
        args.docs,
        args.limit,
        ratios,
        args.shuffle,
        args.words,
        args.offset,
        args.output,
        command,
        BlendConfig(**blend_options(args)),
        args.document_kv == "context",
        args.retrieval,
        args.retrieval_words,
        **answer_tokens(args),
        plots=plots(args),
    )
    return 0


def run_error_sources(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.error_sources import bench_error_sources

    check_numbers(args)
    config = settings.engine_config()
    bench_error_sources(
        config, args.data, args.docs, args.limit, args.shuffle, args.words, args.offset, args.output, command
    )
    return 0


def run_ttft(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.ttft import bench_ttft

    check_numbers(args)
    ratio = None if args.ratio is None else args.ratio / 100
    more = list(percentages(args.ratios)) if args.ratios.strip() else []
    config = settings.engine_config()
    bench_ttft(
        config,
        args.data,
        args.docs,
        args.limit,
        ratio,
        more,
        args.repeats,
        args.words,
        args.offset,
        args.output,
        command,
        args.also_select,
        plots(args),
    )
    return 0


def run_ttft_lengths(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.ttft_lengths import bench_ttft_lengths

    check_numbers(args)
    lengths = counts(args.lengths)
    config = settings.engine_config()
    bench_ttft_lengths(
        config, args.data, args.docs, args.limit, lengths, args.ratio / 100, args.repeats, args.offset, args.output,
        command, plots(args),
    )  # fmt: skip
    return 0


def run_tiers(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.tiers import bench_tiers

    check_numbers(args)
    config = settings.engine_config()
    bench_tiers(
        config, args.data, args.docs, args.limit, args.ratio / 100, args.repeats, args.redis_url, args.output, command
    )
    return 0


def run_compressed(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.compressed import bench_compressed

    check_numbers(args)
    config = settings.engine_config()
    bench_compressed(
        config,
        args.data,
        args.docs,
        args.limit,
        args.offset,
        args.words,
        args.ratio / 100,
        args.repeats,
        args.redis_url,
        args.output,
        command,
    )
    return 0


def run_semantic(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.semantic import bench_semantic

    check_numbers(args)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        raise DataError(f"--sizes {args.sizes!r}: entry counts, comma-separated") from None
    asked = args.gateway
    bench_semantic(
        args.data, args.limit, args.traps, sizes, args.queries, asked, settings, args.output, command,
        args.fit_verifier, plots(args),
    )  # fmt: skip
    return 0


def run_agents(args: argparse.Namespace, settings: Settings, command: str) -> int:
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
        args.client,
        args.sweep,
        args.policies,
        args.workloads,
    )
    return 0


def run_multiagent(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.multiagent import bench_multiagent

    checks = [
        (args.data.is_file(), f"{args.data} is missing (the shared evaluation data)"),
        (2 <= args.agents <= 5, "--agents must be 2 to 5"),
        (args.questions >= 1 and args.written >= 1, "--questions and --written must be at least 1"),
        (0 <= args.ratio <= 1, "--ratio must be within 0 and 1"),
    ]
    if problem := next((message for ok, message in checks if not ok), ""):
        raise DataError(problem)
    check_numbers(args)
    config = settings.engine_config()
    bench_multiagent(
        config, args.data, args.questions, args.agents, args.ratio, args.output, command, args.written,
        args.repeats, **answer_tokens(args), plots=plots(args),
    )  # fmt: skip
    return 0


def run_gateway(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.gateway import bench_gateway

    for name, found in bench_gateway(args.requests, args.output, command, args.litellm, not args.no_litellm).items():
        print(f"{name}: p50 {found['p50']:.2f} ms, p99 {found['p99']:.2f} ms")
    return 0


def run_front(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.front import bench_front

    check_numbers(args)
    if args.before is not None and not (args.before / "gateway" / "cli.py").is_file():
        raise DataError(f"--before {args.before}: not a checkout with gateway/cli.py")
    print(bench_front(args.before, args.runs, args.output, command))
    return 0


def run_engines(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.engines import bench_engines
    from kvgate.runtime.config import user_cache_dir
    from kvgate.runtime.loader import resolve

    if not args.data.is_file() or args.repeats < 1 or args.cores < 0 or args.words < 1:
        raise DataError(f"need --data (a file: {args.data}), --repeats >= 1, --words >= 1 and --cores >= 0")
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not dtypes or not set(dtypes) <= {"auto", "float32", "bfloat16"}:
        raise DataError(f"--dtype {args.dtype!r}: auto, float32 or bfloat16, comma-separated")
    model = Path(resolve(settings.engine_config()))
    venv = args.venv or user_cache_dir() / "vllm-venv"
    streams = counts(args.streams)
    print(
        bench_engines(
            model, args.data, venv, args.repeats, args.cores, dtypes, args.words, args.output, command, streams,
            plots(args),
        )
    )  # fmt: skip
    return 0


def run_chunks(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.chunks import bench_chunks

    if not args.data.is_file() or args.questions < 1:
        raise DataError(f"need --data (a file: {args.data}) and --questions >= 1")
    print(bench_chunks(settings, args.data, args.questions, args.output, command))
    return 0


def run_precision(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.precision import bench_precision

    if not args.data.is_file() or min(args.docs, args.limit, args.tokens) < 1:
        raise DataError(f"need --data (a file: {args.data}) and --docs, --limit, --tokens >= 1")
    config = settings.engine_config()
    print(bench_precision(config, args.data, args.docs, args.limit, args.tokens, args.output, command))
    return 0


Runner = Callable[[argparse.Namespace, "Settings", str], int]
RUNNERS: dict[str, Runner] = {
    "bench prefill": run_prefill,
    "bench grammar": run_grammar,
    "bench fidelity": run_fidelity,
    "bench error-sources": run_error_sources,
    "bench ttft": run_ttft,
    "bench ttft-lengths": run_ttft_lengths,
    "bench tiers": run_tiers,
    "bench compressed": run_compressed,
    "bench semantic": run_semantic,
    "bench agents": run_agents,
    "bench multiagent": run_multiagent,
    "bench gateway": run_gateway,
    "bench front": run_front,
    "bench engines": run_engines,
    "bench chunks": run_chunks,
    "bench precision": run_precision,
}
