"""`kvgate bench ttft-lengths`: time to first token of each reuse mode against the prompt's length.

Per MuSiQue item and length L: the question as the user turn and `docs` documents made to fill the prompt to
L tokens (each the longest run of the item's passages' words, starting at a passage of its own, whose
document ids fit (L - the chat template's tokens) / docs). As `kvgate bench ttft` does (its `prepare`):
the documents stored first, the prompt run once in full with its prefix kept; then full prefill, exact prefix
reuse (the very prompt again), naive reuse and blend at one ratio, timed interleaved, `repeats` times each,
the fastest kept, from an empty KV until the first answer token's logits exist. The documents are in their
stored order: exact prefix reuse finds the whole prompt, as a repeated request does (with the documents in
another order it finds only the chat template's head and costs what full prefill does, `kvgate bench ttft`).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from kvgate.bench.data import DataError
from kvgate.bench.plots import figure, image
from kvgate.bench.ttft import missing, prepare, room, timed
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.documents import chat_pieces, document_ids
from kvgate.runtime.fidelity import MUSIQUE, Item, make_reuser
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.progress import progress
from kvgate.runtime.report import table, write_section
from kvgate.runtime.reuse import ReuseMode

MODES = ("full", "prefix", "naive", "blend")
SHOWN = {
    "full": "full prefill",
    "prefix": "exact prefix (the same prompt again)",
    "naive": "naive (documents' KV computed alone)",
    "blend": "blend (documents' KV, some tokens recomputed)",
}


def document(loaded: LoadedModel, words: list[str], tokens: int) -> list[int]:
    """The ids of the longest document of `words`' first words that fits `tokens` (bisected)."""
    low, high = 0, len(words)
    while low < high:
        middle = (low + high + 1) // 2
        if len(document_ids(loaded.tokenizer, " ".join(words[:middle]))) <= tokens:
            low = middle
        else:
            high = middle - 1
    return document_ids(loaded.tokenizer, " ".join(words[:low]))


def item(loaded: LoadedModel, question: str, passages: list[str], docs: int, length: int) -> Item:
    """A prompt of at most `length` tokens: the question and `docs` documents sharing what is left equally."""
    head, tail = chat_pieces(loaded.tokenizer, [{"role": "user", "content": question}])
    each = (length - len(head) - len(tail)) // docs
    if each < 16:
        raise DataError(f"--lengths {length}: too short for {docs} documents and the question")
    pieces = [document(loaded, " ".join(passages[d:] + passages[:d]).split(), each) for d in range(docs)]
    return Item([head, *pieces, tail], [False, *([True] * docs), False])


def rows_of(data: Path, limit: int, offset: int) -> list[tuple[str, list[str]]]:
    """The questions and passages of rows offset..offset+limit-1."""
    found = []
    with data.open() as f:
        for n, line in enumerate(f):
            if offset <= n < offset + limit:
                row = json.loads(line)
                found.append((row["question"], row["passages"]))
    if not found:
        raise DataError(f"{data} has no items from row {offset} on")
    return found


def lengths_figure(
    seconds: dict[int, dict[str, list[float]]], tokens: dict[int, float], picture: Path, title: str
) -> None:
    """Mean TTFT against mean prompt tokens, one line per mode, both axes logarithmic."""
    xs = [tokens[n] for n in sorted(seconds)]
    with figure(picture, 1, (7, 4.4), title) as (ax,):
        for mode, colour in zip(seconds[min(seconds)], ("tab:red", "black", "tab:grey", "tab:blue")):
            ys = [statistics.fmean(seconds[n][mode]) for n in sorted(seconds)]
            ax.plot(xs, ys, "o-", color=colour, label=SHOWN.get(mode, mode))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
        ax.set(xlabel="prompt tokens (mean)", ylabel="mean TTFT (s, log)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)


def report(seconds: dict[int, dict[str, list[float]]], tokens: dict[int, float]) -> str:
    header = ["prompt tokens (asked / mean)", *(f"{m} TTFT (s)" for m in seconds[min(seconds)]), "blend speedup"]
    rows = []
    for n in sorted(seconds):
        means = {m: statistics.fmean(v) for m, v in seconds[n].items()}
        speedup = f"{means['full'] / means[MODES[-1]]:.2f}x" if MODES[-1] in means else "-"
        rows.append([f"{n} / {tokens[n]:.0f}", *(f"{v:.3f}" for v in means.values()), speedup])
    return table(header, rows)


def shown(
    seconds: dict[int, dict[str, list[float]]], tokens: dict[int, float], plots: Path | None, output: Path, title: str
) -> str:
    """The table, and with `plots` its figure right after it."""
    text = report(seconds, tokens)
    if plots is None:
        return text
    picture = plots / "ttft-lengths.png"
    lengths_figure(seconds, tokens, picture, title)
    return text + "\n\n" + image(picture, output, "TTFT against prompt length, per reuse mode")


def bench_ttft_lengths(
    config: EngineConfig,
    data: Path | None,
    docs: int,
    limit: int,
    lengths: tuple[int, ...],
    ratio: float,
    repeats: int,
    offset: int,
    output: Path,
    command: str,
    plots: Path | None = None,
) -> dict[int, dict[str, list[float]]]:
    """Per length, per mode: each item's fastest TTFT. `plots`: the folder of the figure (None: none)."""
    began = time.perf_counter()
    data = data or MUSIQUE
    if not data.is_file():
        raise DataError(f"{data}: no such data file (the shared MuSiQue set)")
    loaded = load(config)
    asked = rows_of(data, limit, offset)
    by_length = {n: [item(loaded, q, p, docs, n) for q, p in asked] for n in lengths}
    every = [i for found in by_length.values() for i in found]
    memory = max(config.chunk_cache.memory_bytes, room(loaded, every))
    reuser = make_reuser(loaded, BlendConfig(select=config.blend_select, ratio=ratio), memory_bytes=memory)
    prepare(reuser, every)
    if lost := missing(reuser, every):
        raise RuntimeError(f"{lost} documents or prefixes were evicted while storing them; raise the chunk cache")
    modes = [ReuseMode(m, ratio if m == "blend" else None) for m in MODES]
    seconds: dict[int, dict[str, list[float]]] = {n: {m: [] for m in MODES} for n in lengths}
    work = [(n, one) for n, found in by_length.items() for one in found]
    for n, one in progress(work, "prompts timed"):
        best = {m: float("inf") for m in MODES}
        for _ in range(repeats):
            for mode in modes:
                best[mode.mode] = min(best[mode.mode], timed(reuser, one, mode)[0])
        for m, s in best.items():
            seconds[n][m].append(s)
        print(f"{len(one.ids)} tokens: " + ", ".join(f"{m} {s:.3f} s" for m, s in best.items()), flush=True)
    tokens = {n: statistics.fmean(len(i.ids) for i in by_length[n]) for n in lengths}
    text = shown(seconds, tokens, plots, output, f"{loaded.name}, {docs} documents, blend {ratio:.0%}")
    body = (
        f"{len(asked)} MuSiQue items (rows {offset}..{offset + len(asked) - 1}), the question as the user turn and "
        f"{docs} documents filling the prompt to each length (each the longest run of the item's passages' words "
        f"fitting an equal share); model {loaded.name}, {loaded.dtype}, {torch.get_num_threads()} threads. Modes: "
        "full prefill; `prefix`, exact prefix reuse of the very prompt run before; `naive`, every document's "
        f"KV as computed alone; `blend`, {ratio:.0%} of the document tokens recomputed (selected by "
        f"{config.blend_select}). Documents in their stored order. Each mode timed {repeats} times per item, "
        "interleaved, fastest kept, then the mean over the items; TTFT = from an empty KV until the first answer "
        "token's logits exist.\n\n" + text + f"\n\nTook {time.perf_counter() - began:.0f} s."
    )
    write_section(output, "ttft-lengths", "Time to first token against prompt length", command, body)
    print(text, flush=True)
    return seconds
