"""The `kvgate` command: serve, convert, calibrate, bench.

The console script imports this module on every start, a light proxy front included: nothing here
imports torch, transformers, hnswlib or a benchmark at import time. Parsing needs only argparse (the
bench options are kvgate.bench.commands, argparse only, imported by `build_parser`: the gateway imports
kvgate.bench only inside this module's functions, tests/test_layers.py); each command imports what it
runs, when it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.gateway.settings import Settings

FLAGS = ("host", "port", "model", "served_model_name", "workers")  # flags that are settings (they win over all)


def global_options() -> argparse.ArgumentParser:
    """The options accepted anywhere: before the command, after it, after the bench kind."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand without --config must not reset the one given before it (argparse copies a
    # subparser's defaults over the namespace).
    common.add_argument(
        "--config", type=Path, default=argparse.SUPPRESS, help="YAML settings file (also KVGATE_CONFIG)"
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    from kvgate.bench.commands import add_bench, add_calibrate

    common = global_options()
    parser = argparse.ArgumentParser(
        prog="kvgate", description="OpenAI-compatible gateway with KV reuse", parents=[common]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", parents=[common], help="start the gateway with the embedded runtime")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name")
    serve.add_argument("--workers", type=int, help="runtime worker processes behind this front (0: in-process)")

    convert = sub.add_parser("convert", parents=[common], help="convert the model once to the safetensors cache")
    convert.add_argument("--model")

    add_bench(sub, common)
    add_calibrate(sub, common)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it; nothing is loaded or run. Exits 2 on a usage error. A benchmark
    with a command line of its own gets the rest as given (`rest`), for its own parser."""
    from kvgate.bench.commands import MODULES

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (kind := argv[1] if len(argv) > 1 else "") in MODULES:
        return argparse.Namespace(command="bench", kind=kind, module=f"kvgate.bench.{MODULES[kind]}", rest=argv[2:])
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if hasattr(args, "rest"):  # a benchmark with a command line of its own
        return importlib.import_module(args.module).main(args.rest) or 0
    from kvgate.gateway.settings import Settings

    command = " ".join(["kvgate", *argv])  # as BENCHMARKS.md shows it
    try:
        settings = Settings.load(getattr(args, "config", None), **{k: getattr(args, k, None) for k in FLAGS})
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        name = f"bench {args.kind}" if args.command == "bench" else args.command
        return COMMANDS[name](args, settings, command)
    except user_errors() as exc:
        print(f"kvgate: error: {exc}", file=sys.stderr)
        return 2


def user_errors() -> tuple[type[Exception], ...]:
    """What `main` reports as `kvgate: error: ...` (exit 2), not as a traceback. Evaluated only once an
    exception reaches `main`: a ModelNotFound can only come from kvgate.runtime.loader (torch), so it is
    among them only when that module was imported."""
    from pydantic import ValidationError

    from kvgate.bench.data import DataError

    loader = sys.modules.get("kvgate.runtime.loader")
    return (ValidationError, OSError, DataError, *((loader.ModelNotFound,) if loader else ()))


def check_numbers(args: argparse.Namespace) -> None:
    from kvgate.bench.data import DataError

    for name in ("docs", "limit", "repeats", "requests", "batch", "tokens", "max_tokens"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise DataError(f"--{name} must be at least 1")
    if getattr(args, "offset", 0) < 0 or getattr(args, "words", 0) < 0:
        raise DataError("--offset and --words cannot be negative")
    ratio = getattr(args, "ratio", None)
    if ratio is not None and not 0.0 <= ratio <= 100.0:
        raise DataError("--ratio is a percentage between 0 and 100")


# ---- what each command runs: it imports its own module, and only when it runs ---------------------


def run_serve(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.gateway.serve import serve_forever

    return serve_forever(settings)


def run_convert(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.runtime.loader import resolve

    print(resolve(settings.engine_config(), progress=True))
    return 0


def run_calibrate(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.calibrate import calibrate
    from kvgate.bench.data import parse_ratios

    check_numbers(args)
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
        args.table_docs,
        args.select or settings.blend_select,
        args.document_kv or ("context" if settings.documents_in_context else "alone"),
    )
    return 0


def run_grammar(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.grammar import bench_grammar

    check_numbers(args)
    print(bench_grammar(settings, args.requests, args.batch, args.tokens, args.max_tokens, args.output, command))
    return 0


def run_prefill(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.prefill import bench_prefill

    check_numbers(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    bench_prefill(settings.engine_config(), lengths, args.decode_tokens, args.repeats, args.output, command)
    return 0


def run_fidelity(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.commands import blend_options
    from kvgate.bench.data import parse_ratios
    from kvgate.bench.fidelity import bench_fidelity
    from kvgate.runtime.blend import BlendConfig

    check_numbers(args)
    ratios = parse_ratios(args.ratios)
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
    from kvgate.bench.data import parse_ratios
    from kvgate.bench.ttft import bench_ttft

    check_numbers(args)
    ratio = None if args.ratio is None else args.ratio / 100
    more = parse_ratios(args.ratios) if args.ratios.strip() else []
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
    )
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
    from kvgate.bench.data import DataError
    from kvgate.bench.semantic import bench_semantic

    check_numbers(args)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        raise DataError(f"--sizes {args.sizes!r}: entry counts, comma-separated") from None
    asked = args.gateway
    bench_semantic(
        args.data, args.limit, args.traps, sizes, args.queries, asked, settings, args.output, command, args.fit_verifier
    )
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
    from kvgate.bench.data import DataError
    from kvgate.bench.multiagent import bench_multiagent

    checks = [
        (args.data.is_file(), f"{args.data} is missing (the shared evaluation data)"),
        (2 <= args.agents <= 5, "--agents must be 2 to 5"),
        (args.questions >= 1 and args.written >= 1, "--questions and --written must be at least 1"),
        (0 <= args.ratio <= 1, "--ratio must be within 0 and 1"),
    ]
    if problem := next((message for ok, message in checks if not ok), ""):
        raise DataError(problem)
    config = settings.engine_config()
    bench_multiagent(config, args.data, args.questions, args.agents, args.ratio, args.output, command, args.written)
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
        from kvgate.bench.data import DataError

        raise DataError(f"--before {args.before}: not a checkout with gateway/cli.py")
    print(bench_front(args.before, args.runs, args.output, command))
    return 0


def run_engines(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.data import DataError
    from kvgate.bench.engines import bench_engines
    from kvgate.runtime.config import user_cache_dir
    from kvgate.runtime.loader import resolve

    if not args.data.is_file() or args.repeats < 1 or args.cores < 0:
        raise DataError(f"need --data (a file: {args.data}), --repeats >= 1 and --cores >= 0")
    model = Path(resolve(settings.engine_config()))
    venv = args.venv or user_cache_dir() / "vllm-venv"
    print(bench_engines(model, args.data, venv, args.repeats, args.cores, args.kvgate_dtype, args.output, command))
    return 0


def run_chunks(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.chunks import bench_chunks
    from kvgate.bench.data import DataError

    if not args.data.is_file() or args.questions < 1:
        raise DataError(f"need --data (a file: {args.data}) and --questions >= 1")
    print(bench_chunks(settings, args.data, args.questions, args.output, command))
    return 0


def run_precision(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.bench.data import DataError
    from kvgate.bench.precision import bench_precision

    if not args.data.is_file() or min(args.docs, args.limit, args.tokens) < 1:
        raise DataError(f"need --data (a file: {args.data}) and --docs, --limit, --tokens >= 1")
    config = settings.engine_config()
    print(bench_precision(config, args.data, args.docs, args.limit, args.tokens, args.output, command))
    return 0


Command = Callable[[argparse.Namespace, "Settings", str], int]
COMMANDS: dict[str, Command] = {
    "serve": run_serve,
    "convert": run_convert,
    "calibrate": run_calibrate,
    "bench prefill": run_prefill,
    "bench grammar": run_grammar,
    "bench fidelity": run_fidelity,
    "bench error-sources": run_error_sources,
    "bench ttft": run_ttft,
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


if __name__ == "__main__":
    sys.exit(main())
