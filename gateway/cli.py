"""The `kvgate` command: serve, convert, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from gateway.settings import Settings
from runtime.loader import ModelNotFound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate", description="OpenAI-compatible gateway with KV reuse")
    parser.add_argument("--config", type=Path, help="YAML settings file (also KVGATE_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the gateway with the embedded runtime")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name")

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

    args = parser.parse_args(argv)
    flags = {k: getattr(args, k, None) for k in ("host", "port", "model", "served_model_name")}
    try:
        settings = Settings.load(args.config, **flags)
        return run(args, settings, argv)
    except (ValidationError, ModelNotFound, OSError) as exc:
        print(f"kvgate: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, settings: Settings, argv: list[str] | None) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "convert":
        from runtime.loader import resolve

        print(resolve(settings.engine_config(), progress=True))
        return 0
    if args.command == "bench":
        from benchmarks.prefill import bench_prefill

        lengths = [int(x) for x in args.lengths.split(",")]
        bench_prefill(
            settings.engine_config(),
            lengths,
            args.decode_tokens,
            args.repeats,
            args.output,
            " ".join(["kvgate", *(argv if argv is not None else sys.argv[1:])]),
        )
        return 0
    return serve_forever(settings)


def serve_forever(settings: Settings) -> int:
    import uvicorn

    from gateway.app import create_app
    from runtime.engine import Engine
    from runtime.loader import resolve

    resolve(settings.engine_config(), progress=True)  # convert once, with a progress bar, before loading
    engine = Engine(settings.engine_config())
    app = create_app(settings, engine)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
