"""The `kvgate` command: serve, convert, calibrate, and the commands other packages add (entry points
of the group `kvgate.commands`: `bench`, kvgate's benchmarks, is one; the gateway names none of them).

The console script imports this module on every start, a light proxy front included: nothing here
imports torch, transformers, hnswlib or a benchmark at import time. Parsing needs only argparse (an added
command's module defines its options with argparse alone); each command imports what it runs, when it
runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.gateway.settings import Settings

# flags that are settings (they win over all) -> their group
FLAGS = {
    "host": "operations",
    "port": "operations",
    "model": "engine",
    "served_model_name": "engine",
    "workers": "proxy",
}
GROUP = "kvgate.commands"  # entry points: a module with add(sub, common), passthrough(argv) and run(args, ...)


def added() -> dict[str, ModuleType]:
    """The commands installed packages add, by name (kvgate's own `bench` among them)."""
    return {point.name: point.load() for point in entry_points(group=GROUP)}


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

    add_calibrate(sub, common)
    for command in added().values():
        command.add(sub, common)
    return parser


def musique_args(parser: argparse.ArgumentParser, limit: int, offset: int, data: Path | None = None) -> None:
    """The options of a command measuring on MuSiQue items (`data` None: the shared set, ../shared/data)."""
    parser.add_argument("--model")
    parser.add_argument("--data", type=Path, default=data, help="MuSiQue RAG jsonl (question, passages)")
    parser.add_argument("--docs", type=int, default=6, help="passages per question, as documents")
    parser.add_argument("--limit", type=int, default=limit, help="items")
    parser.add_argument("--offset", type=int, default=offset, help="first item (row) of the data file")
    parser.add_argument("--words", type=int, default=0, help="cut each passage to its first N words (0: whole)")


def percentages(text: str) -> tuple[float, ...]:
    """Percentages, comma-separated, as fractions: "0,5,10" -> (0.0, 0.05, 0.1); a usage error otherwise."""
    from kvgate.runtime.errors import DataError

    try:
        found = tuple(float(x) / 100 for x in text.split(",") if x.strip())
    except ValueError:
        found = ()
    if not found or any(not 0.0 <= r <= 1.0 for r in found):
        raise DataError(f"ratios {text!r}: percentages between 0 and 100, comma-separated")
    return found


def counts(text: str) -> tuple[int, ...]:
    """Counts of at least 1, comma-separated: "2,4,6" -> (2, 4, 6); a usage error otherwise."""
    from kvgate.runtime.errors import DataError

    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise DataError(f"{text!r}: counts (at least 1), comma-separated")
    return tuple(sorted({int(x) for x in parts}))


def add_calibrate(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """`kvgate calibrate` (runtime/calibrate.py); `common`: the options every (sub)command accepts (--config)."""
    calibrate = sub.add_parser("calibrate", parents=[common], help="pick and store the model's blend recompute ratio")
    musique_args(calibrate, limit=8, offset=100)
    calibrate.add_argument("--target", type=float, default=0.95, help="the fidelity the ratio must reach")
    calibrate.add_argument(
        "--table-docs",
        default="2,4,6",
        help="document counts the served table covers, comma-separated (each measured on its own items)",
    )
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
    calibrate.add_argument(
        "--select",
        choices=["deviation", "attention"],
        help="how blends pick the tokens they recompute (default: the server's blend_select)",
    )
    calibrate.add_argument(
        "--document-kv",
        choices=["alone", "context"],
        help="documents' KV computed alone, or as another prompt computed it (default: context where the server "
        "keeps new documents' KV as their prompt computed it, documents_in_context)",
    )
    calibrate.add_argument("--report", type=Path, help="also write the curve as a section of this BENCHMARKS.md")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it; nothing is loaded or run. Exits 2 on a usage error. A benchmark
    with a command line of its own gets the rest as given (`rest`), for its own parser."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for command in added().values():
        if (parsed := command.passthrough(argv)) is not None:
            return parsed
    return build_parser().parse_args(argv)


def flags(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags given, by their settings' groups."""
    groups: dict[str, dict[str, Any]] = {}
    for flag, group in FLAGS.items():
        if (value := getattr(args, flag, None)) is not None:
            groups.setdefault(group, {})[flag] = value
    return groups


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if hasattr(args, "rest"):  # a benchmark with a command line of its own
        return importlib.import_module(args.module).main(args.rest) or 0
    from kvgate.gateway.settings import Settings

    command = " ".join(["kvgate", *argv])  # as BENCHMARKS.md shows it
    try:
        settings = Settings.load(getattr(args, "config", None), **flags(args))
        logging.basicConfig(
            level=settings.operations.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        if args.command in COMMANDS:
            return COMMANDS[args.command](args, settings, command)
        return added()[args.command].run(args, settings, command)
    except user_errors() as exc:
        print(f"kvgate: error: {exc}", file=sys.stderr)
        return 2


def user_errors() -> tuple[type[Exception], ...]:
    """What `main` reports as `kvgate: error: ...` (exit 2), not as a traceback. Evaluated only once an
    exception reaches `main`."""
    from pydantic import ValidationError

    from kvgate.gateway.tracing import TracingUnavailable
    from kvgate.runtime.config import ModelNotFound
    from kvgate.runtime.errors import DataError

    return (ValidationError, OSError, DataError, ModelNotFound, TracingUnavailable)


# ---- what each command runs: it imports its own module, and only when it runs ---------------------


def run_serve(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.gateway.serve import serve_forever

    return serve_forever(settings)


def run_convert(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.runtime.loader import resolve

    print(resolve(settings.engine_config(), progress=True))
    return 0


def run_calibrate(args: argparse.Namespace, settings: Settings, command: str) -> int:
    from kvgate.runtime.calibrate import Calibrating, calibrate

    job = Calibrating(
        data=args.data,
        docs=args.docs,
        limit=args.limit,
        offset=args.offset,
        target=args.target,
        metric=args.metric,
        ratios=percentages(args.ratios),
        shuffle=args.shuffle,
        words=args.words,
        counts=counts(args.table_docs),
        select=args.select or settings.caches.blend_select,
        document_kv=args.document_kv or ("context" if settings.caches.documents_in_context else "alone"),
    )
    calibrate(settings.engine_config(), job, args.report, command)
    return 0


Command = Callable[[argparse.Namespace, "Settings", str], int]
COMMANDS: dict[str, Command] = {"serve": run_serve, "convert": run_convert, "calibrate": run_calibrate}


if __name__ == "__main__":
    sys.exit(main())
