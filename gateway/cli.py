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
        if args.command in COMMANDS:
            return COMMANDS[args.command](args, settings, command)
        from kvgate.bench.commands import run  # `kvgate calibrate` and `kvgate bench KIND`

        return run(f"bench {args.kind}" if args.command == "bench" else args.command, args, settings, command)
    except user_errors() as exc:
        print(f"kvgate: error: {exc}", file=sys.stderr)
        return 2


def user_errors() -> tuple[type[Exception], ...]:
    """What `main` reports as `kvgate: error: ...` (exit 2), not as a traceback. Evaluated only once an
    exception reaches `main`: a ModelNotFound can only come from kvgate.runtime.loader (torch), so it is
    among them only when that module was imported."""
    from pydantic import ValidationError

    loader = sys.modules.get("kvgate.runtime.loader")
    return (ValidationError, OSError, *((loader.ModelNotFound,) if loader else ()))


# ---- what each command runs: it imports its own module, and only when it runs ---------------------


def run_serve(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.gateway.serve import serve_forever

    return serve_forever(settings)


def run_convert(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.runtime.loader import resolve

    print(resolve(settings.engine_config(), progress=True))
    return 0


Command = Callable[[argparse.Namespace, "Settings", str], int]
COMMANDS: dict[str, Command] = {"serve": run_serve, "convert": run_convert}


if __name__ == "__main__":
    sys.exit(main())
