"""Stalls: the inter-token gaps of a stream while a long document is ingested, and then blended,
beside the same stream's gaps alone; one engine per step budget (max_num_batched_tokens), all in
one run. The document is MuSiQue passages joined to about `--tokens` tokens.

    python -m kvgate.bench.stalls --tokens 7000 --budgets 2048,512,128,32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

from kvgate.gateway.settings import Settings
from kvgate.runtime.engine import Engine
from kvgate.runtime.fidelity import MUSIQUE
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.planner import Chat, Planner
from kvgate.runtime.report import table
from kvgate.runtime.request import Request
from kvgate.runtime.sampling import SamplingParams


def document(engine: Engine, tokens: int) -> str:
    """MuSiQue passages, in file order, until the text has about `tokens` tokens."""
    parts: list[str] = []
    with MUSIQUE.open() as lines:
        for line in lines:
            for passage in json.loads(line)["passages"]:
                parts.append(passage)
                text = "\n\n".join(parts)
                if len(engine.tokenizer.encode(text)) >= tokens:
                    return text
    raise ValueError(f"{MUSIQUE} holds fewer than {tokens} tokens")


async def gaps_during(engine: Engine, work: object) -> tuple[list[float], list[float], float]:
    """A stream's inter-token gaps alone (its first 16), then while `work` (a coroutine) runs, and
    how long the work took."""
    arrived: list[float] = []
    started = asyncio.Event()
    prompt = engine.tokenizer.encode("Count to a thousand: 1, 2, 3,")
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)

    async def stream() -> None:
        async for _ in engine.generate(Request(prompt, params)):
            arrived.append(time.perf_counter())
            if len(arrived) == 17:
                started.set()

    streaming = asyncio.create_task(stream())
    await started.wait()
    alone = [b - a for a, b in zip(arrived, arrived[1:])]
    begin = time.perf_counter()
    await work  # type: ignore[misc]
    end = time.perf_counter()
    while arrived[-1] < end:  # the gap the work ended in closes with the stream's next token
        await asyncio.sleep(0.001)
    streaming.cancel()
    during = [b - a for a, b in zip(arrived, arrived[1:]) if b > begin and a < end]
    return alone, during, end - begin


def measure(loaded: LoadedModel, budget: int, tokens: int, ratio: float) -> list[str]:
    """One budget's row, on a cache of its own: no tier holds the document an earlier row computed."""
    with tempfile.TemporaryDirectory() as cache:
        settings = Settings.load(cache_dir=cache, engine={"max_num_batched_tokens": budget})
        return measured(Engine(settings.engine_config(), loaded), tokens, ratio)


def measured(engine: Engine, tokens: int, ratio: float) -> list[str]:
    try:
        text = document(engine, tokens)
        planner = Planner(engine.reuser)
        ids = planner.tokens(text)

        async def run() -> list[str]:
            alone, ingest, ingest_s = await gaps_during(engine, engine.ingest(ids))
            chat = Chat(
                [{"role": "user", "content": "Who is mentioned first?"}],
                documents=[{"text": text}],
                mode="blend",
                ratio=ratio,
            )
            prompt, plan = planner.chat(chat)
            answer = engine.generate(Request(prompt, SamplingParams(max_tokens=1, temperature=0.0), plan))
            _, blend, blend_s = await gaps_during(engine, drain(answer))
            step = statistics.median(alone)
            return [
                str(engine.config.max_num_batched_tokens),
                str(len(ids)),
                f"{step * 1e3:.1f}",
                f"{max(ingest) * 1e3:.0f} ({max(ingest) / step:.1f}x)",
                f"{ingest_s:.1f}",
                f"{max(blend) * 1e3:.0f} ({max(blend) / step:.1f}x)",
                f"{blend_s:.1f}",
            ]

        return asyncio.run(run())
    finally:
        engine.shutdown()


async def drain(outputs: object) -> None:
    async for _ in outputs:  # type: ignore[attr-defined]
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--budgets", default="2048,512,128,32")
    parser.add_argument("--ratio", type=float, default=0.15, help="the blend's recompute ratio")
    args = parser.parse_args()
    loaded = load(Settings.load().engine_config())
    rows = [measure(loaded, int(b), args.tokens, args.ratio) for b in args.budgets.split(",")]
    head = ["max_num_batched_tokens", "document tokens", "decode step ms (alone, median)"]
    head += ["max gap, ingest ms", "ingest s", "max gap, blend ms", "blend s"]
    print(table(head, rows))


if __name__ == "__main__":
    main()
