"""`kvgate bench fidelity`: how far each reuse mode moves the answer from full prefill.

MuSiQue passages are the documents, the question is the user turn. Full prefill of the same
token ids is the reference. For every mode, per item:
- first-token KL(reference || mode);
- top-1 agreement over the reference answer's first 32 positions, teacher-forced on the
  reference answer (so one early difference does not decide the rest);
- greedy 32-token exact match and ROUGE-L F1 against the reference's greedy answer.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.bench.plots import TARGET, figure, image
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.fidelity import ANSWER, Scores, load_items, make_reuser, measure
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.report import table, write_section
from kvgate.runtime.retrieval_task import ANSWER_TOKENS, BENCH_SEED, WORDS, Accuracy, kept, measure_tasks
from kvgate.runtime.reuse import ReuseMode, Reuser

if TYPE_CHECKING:
    from matplotlib.axes import Axes

TARGET_TOP1, TARGET_KL = 0.95, 0.05  # the fidelity targets, drawn on the plot


def plot(scores: dict[str, Scores], path: Path, title: str = "") -> None:
    blends = [(float(name.split()[1].rstrip("%")), s) for name, s in scores.items() if name.startswith("blend")]
    with figure(path, 2, (10, 4), title) as axes:
        draw(scores, blends, *axes)


def draw(scores: dict[str, Scores], blends: list[tuple[float, Scores]], left: Axes, right: Axes) -> None:
    x = [r for r, _ in blends]
    left.plot(x, [100 * s.mean("top1") for _, s in blends], "o-", label="blend: top-1 agreement (teacher-forced)")
    if any(s.rouge for _, s in blends):
        left.plot(x, [100 * s.mean("rouge") for _, s in blends], "s--", label="blend: greedy-32 ROUGE-L")
    right.plot(x, [s.mean("kl") for _, s in blends], "o-", label="blend: first-token KL")
    for name, style in (("naive", ":"), ("prefix", "-.")):
        if name in scores:
            left.axhline(100 * scores[name].mean("top1"), linestyle=style, color="grey", label=f"{name}: top-1")
            right.axhline(scores[name].mean("kl"), linestyle=style, color="grey", label=f"{name}: KL")
    left.axhline(100 * TARGET_TOP1, **TARGET, label="target")
    right.axhline(TARGET_KL, **TARGET, label="target")
    left.set(xlabel="recompute ratio (%)", ylabel="% of the reference (full prefill)", ylim=(0, 101))
    right.set(xlabel="recompute ratio (%)", ylabel="KL(full || reuse), first token", ylim=(0, None))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def answered(found: Accuracy | None, full: Accuracy | None) -> list[str]:
    """A mode's retrieval columns: accuracy, the share of full prefill's right answers kept, equal answers."""
    if found is None or full is None:
        return []
    right, of = kept(full, found)
    n = len(found.correct)
    return [f"{sum(found.correct)} of {n} ({100 * found.rate:.0f}%)", f"{right} of {of}", f"{sum(found.same)} of {n}"]


def report(scores: dict[str, Scores], retrieval: dict[str, Accuracy] | None = None, answer: int = ANSWER) -> str:
    full = (retrieval or {}).get("full")
    rows = [
        [
            name,
            f"{100 * s.mean('recomputed'):.1f}%",
            f"{s.mean('kl'):.3f}",
            f"{100 * s.mean('top1'):.1f}%",
            f"{100 * s.mean('exact'):.0f}%",
            f"{s.mean('rouge'):.3f}",
            f"{s.mean('deviation'):.3g} / {max(s.deviation, default=0.0):.3g}",
            *answered((retrieval or {}).get(name), full),
        ]
        for name, s in scores.items()
    ]
    header = [
        "mode",
        "document tokens recomputed",
        "first-token KL",
        f"top-1 ({answer}, forced)",
        f"greedy-{answer} exact",
        "ROUGE-L",
        "key deviation mean / max",
    ]
    if retrieval:  # full prefill's own row: the accuracy every mode is held to (its other columns by definition)
        rows.insert(0, ["full (the reference)", "100.0%", "0", "100.0%", "100%", "1.000", "-", *answered(full, full)])
        header += ["retrieval: answers right", "... of full prefill's right kept", "... equal to full prefill's"]
    return table(header, rows)


def retrieval_accuracy(
    loaded: LoadedModel, reuser: Reuser, data: Path, modes: list[ReuseMode], count: int, docs: int, words: int,
    context: bool,
) -> tuple[dict[str, Accuracy], str]:  # fmt: skip
    """Every mode's answer accuracy on `count` retrieval tasks (runtime/retrieval_task.py), and what they were."""
    scores, items = measure_tasks(loaded, reuser, modes, count, BENCH_SEED, docs, words, data, context)
    tokens = statistics.fmean(len(i.ids) for i in items)
    filler = f"passages of `{data.name}`" if data.is_file() else "filler sentences made by the generator"
    kv = "a dense prefill of the documents in their stored order" if context else "each document computed alone"
    described = (
        f"Retrieval: {len(items)} tasks (runtime/retrieval_task.py, seed {BENCH_SEED}), {docs} documents of "
        f"{words} words ({filler}), one holding the fact asked for and up to two holding facts of the same form "
        f"about other names, asked in another order than the stored one (documents' KV: {kv}), the fact at "
        f"every depth in turn; {tokens:.0f} prompt tokens on average. An answer is right when its first number "
        f"is the fact's (greedy, {ANSWER_TOKENS} tokens, after the answer's lead words as RULER prompts). Full "
        f"prefill answers {sum(scores['full'].correct)} of {len(items)} right; each mode's count, how many of "
        "those it keeps, and how many of its answers equal full prefill's are the last three columns."
    )
    return scores, described


def changed(blend: BlendConfig) -> dict[str, object]:
    """The fields of `blend` (the ratio aside: each row has its own) that differ from BlendConfig()'s."""
    default = BlendConfig()
    return {
        f.name: getattr(blend, f.name)
        for f in fields(blend)
        if f.name != "ratio" and getattr(blend, f.name) != getattr(default, f.name)
    }


def variant(blend: BlendConfig) -> str:
    """The blend settings as a section name's suffix: "" for the defaults, "-first_k4", "-check_layers1_8-widen2"."""

    def text(value: object) -> str:
        if isinstance(value, tuple):
            return "_".join(map(str, value))
        return f"{value:g}" if isinstance(value, float) else f"_{value}" if isinstance(value, str) else str(value)

    return "".join(f"-{name}{text(value)}" for name, value in changed(blend).items())


def bench_fidelity(
    config: EngineConfig,
    data: Path,
    docs: int,
    limit: int,
    ratios: list[float],
    shuffle: bool,
    words: int,
    offset: int,
    output: Path,
    command: str,
    blend: BlendConfig | None = None,
    context: bool = False,
    retrieval: int = 0,
    retrieval_words: int = WORDS,
    answer: int = ANSWER,
    plots: Path | None = None,
) -> dict[str, Scores]:
    """`blend`: the blend's settings besides the ratio (default BlendConfig()); any other names the
    section (`fidelity-shuffled-first_k4`), so a variant does not overwrite the default run.
    `context`: documents' KV from a dense prefill of the same documents in the other order (the
    stored one for shuffled items, the shuffled one otherwise), section suffix `-context`. `retrieval`:
    retrieval tasks (of `docs` documents of `retrieval_words` words) whose answer accuracy each mode is
    also scored by (0: none). `plots`: the folder of the figure (None: beside `output`)."""
    began = time.perf_counter()
    blend = blend or BlendConfig()
    loaded = load(config)
    data_items = load_items(loaded, data, docs, limit, shuffle, offset, words)
    reuser = make_reuser(loaded, blend)
    modes = [ReuseMode("prefix"), ReuseMode("naive"), *(ReuseMode("blend", r) for r in ratios)]
    decode = loaded.tokenizer.decode
    others = load_items(loaded, data, docs, limit, not shuffle, offset, words) if context else None
    scores = measure(reuser, data_items, modes, loaded.eos_token_ids, decode, others=others, answer=answer)
    found, retrieved = None, ""
    if retrieval:
        found, retrieved = retrieval_accuracy(loaded, reuser, data, modes, retrieval, docs, retrieval_words, context)
    name = ("fidelity-shuffled" if shuffle else "fidelity") + variant(blend) + ("-context" if context else "")
    settings = ", ".join(f"{k}={v!r}" for k, v in changed(blend).items())
    order = "shuffled (a fixed permutation per item)" if shuffle else "in their stored order"
    picture = (plots or output.parent) / f"{name}.png"
    arranged = "shuffled" if shuffle else "in stored order"
    plot(scores, picture, f"{loaded.name}, {len(data_items)} MuSiQue items, {docs} documents {arranged}")
    tokens = statistics.fmean(len(i.ids) for i in data_items)
    cut = f", each cut to its first {words} words" if words else ""
    body = (
        f"{len(data_items)} MuSiQue items (rows {offset}..{offset + len(data_items) - 1} of `{data.name}`), "
        f"{docs} passages each as documents{cut}, {order}; the question is the user turn; "
        f"{tokens:.0f} prompt tokens on average. Model {loaded.name}, {loaded.dtype}. "
        "The reference is full prefill of the same token ids (by definition KL 0, top-1 100%). "
        "`prefix` reuses the exact prefix a previous identical request left, so it is exact; `naive` "
        "reuses every document's KV as computed alone (no layer recomputed); `blend r%` runs the layers "
        "before its first check layer (layer 1 by default) over every token, computes the check layer's keys "
        "for every token, and from there on recomputes only the fresh tokens and the r% of document tokens "
        "its `select` picks (by default: whose keys deviate most), plus each document's first `first_k` "
        f"(`BlendConfig({settings})` otherwise). Top-1: agreement with the reference's argmax "
        f"over the reference answer's first {answer} positions, teacher-forced on the reference answer. "
        f"Greedy-{answer} exact / ROUGE-L: the mode's own greedy answer against the reference's. "
        "Key deviation: the blend's relative key deviation of document tokens at its first check layer "
        "(what calibration bounds)."
        + (f" {retrieved}" if retrieved else "")
        + "\n\n"
        + report(scores, found, answer)
        + f"\n\n{image(picture, output, 'fidelity against recompute ratio')}\n\n"
        f"Took {time.perf_counter() - began:.0f} s."
    )
    title = "Fidelity of reuse, documents " + ("shuffled" if shuffle else "in stored order")
    title += f", blend with {settings}" if settings else ""
    title += ", documents' KV from a dense prefill in the other order" if context else ""
    write_section(output, name, title, command, body)
    print(report(scores, found, answer), flush=True)
    return scores
