"""`kvgate bench fidelity`: how far each reuse mode moves the answer from full prefill.

MuSiQue passages are the documents, the question is the user turn. Full prefill of the same
token ids is the reference. For every mode, per item:
- first-token KL(reference || mode);
- top-1 agreement over the reference answer's first 32 positions, teacher-forced on the
  reference answer (so one early difference does not decide the rest);
- greedy 32-token exact match and ROUGE-L F1 against the reference's greedy answer.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from kvgate.bench.data import DataError
from kvgate.bench.report import table, write_section
from kvgate.chunk_cache import ChunkCacheConfig, ChunkStore
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.calibration import model_fingerprint
from kvgate.runtime.config import EngineConfig
from kvgate.runtime.documents import chat_pieces, document_ids
from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel, load
from kvgate.runtime.model import Run, forward
from kvgate.runtime.prefix import Blocks
from kvgate.runtime.reuse import Prefilled, Reuse, Reuser

RATIOS = (0.0, 0.05, 0.10, 0.15, 0.20, 0.30, 0.50)
ANSWER = 32


@dataclass
class Item:
    pieces: list[list[int]]
    documents: list[bool]

    @property
    def ids(self) -> list[int]:
        return [t for p in self.pieces for t in p]


def items(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    docs: int,
    limit: int,
    shuffle: bool = False,
    offset: int = 0,
    words: int = 0,
) -> Iterator[Item]:
    """MuSiQue rows offset..offset+limit-1; each passage cut to its first `words` words when given."""
    with path.open() as f:
        for n, line in enumerate(f):
            if n < offset:
                continue
            if n >= offset + limit:
                return
            row = json.loads(line)
            passages = row["passages"][:docs]
            if words:
                passages = [" ".join(p.split()[:words]) for p in passages]
            if shuffle:  # a fixed permutation per item: reproducible, and never the stored order
                g = torch.Generator().manual_seed(n)
                order = torch.randperm(len(passages), generator=g).tolist()
                if order == sorted(order):
                    order = order[1:] + order[:1]
                passages = [passages[i] for i in order]
            head, tail = chat_pieces(tokenizer, [{"role": "user", "content": row["question"]}])
            pieces = [head, *(document_ids(tokenizer, p) for p in passages), tail]
            yield Item(pieces, [False, *([True] * len(passages)), False])


def mode_name(reuse: Reuse) -> str:
    return reuse.mode if reuse.mode != "blend" else f"blend {reuse.ratio:.0%}"


@dataclass
class Scores:
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    exact: list[float] = field(default_factory=list)
    rouge: list[float] = field(default_factory=list)
    recomputed: list[float] = field(default_factory=list)
    deviation: list[float] = field(default_factory=list)  # the blend's relative key deviation at its check layer

    def mean(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.fmean(values) if values else float("nan")


def start(reuser: Reuser, item: Item, reuse: Reuse) -> tuple[KVCache, torch.Tensor, Prefilled]:
    """The prompt's KV under `reuse`, the first answer token's logits, and what the reuse prefill did.

    The first token's logits exist once this returns: it is what time to first token measures."""
    kv = reuser.new_kv()
    if reuse.mode == "prefix":  # the prefix blocks an earlier prompt left (`keep_prefix`), as the engine reads them
        prefix_blocks(reuser).attach(kv, item.ids, "")
    done = reuser.prefill(kv, item.pieces, item.documents, reuse)
    if reuse.mode == "prefix":
        done.reused = len(kv)
    ids = item.ids
    logits = done.logits
    if logits is None:
        logits = forward(reuser.model, [Run(kv, ids[len(kv) :], len(kv))])[0]
    return kv, logits, done


_BLOCKS: dict[int, Blocks] = {}


def prefix_blocks(reuser: Reuser) -> Blocks:
    """The prefix blocks over a reuser's store (one per store: its index finds where prompts part)."""
    found = _BLOCKS.get(id(reuser.store))
    if found is None or found.store is not reuser.store:
        found = _BLOCKS[id(reuser.store)] = Blocks(reuser.store, reuser.model_fp, reuser.tokenizer_fp)
    return found


def keep_prefix(reuser: Reuser, kv: KVCache, item: Item) -> None:
    """What an earlier request with this very prompt leaves: its prefix blocks."""
    prefix_blocks(reuser).keep(kv, item.ids, "")


def greedy(
    reuser: Reuser, kv: KVCache, first: torch.Tensor, eos: frozenset[int]
) -> tuple[list[int], list[torch.Tensor]]:
    ids, logits = [], [first]
    while True:
        token = int(logits[-1].argmax())
        ids.append(token)
        if token in eos or len(ids) == ANSWER:
            return ids, logits
        logits.append(forward(reuser.model, [Run(kv, [token], len(kv))])[0])


def teacher_forced(reuser: Reuser, kv: KVCache, first: torch.Tensor, answer: list[int]) -> torch.Tensor:
    """Logits at every answer position given the reference answer so far: [len(answer), vocab]."""
    if len(answer) == 1:
        return first[None]
    rest = forward(reuser.model, [Run(kv, answer[:-1], len(kv))], every=True)
    return torch.cat([first[None], rest])


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p, q = reference.float().log_softmax(-1), other.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def rouge_l(reference: str, candidate: str) -> float:
    a, b = reference.split(), candidate.split()
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        prev = row
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(b), lcs / len(a)
    return 2 * precision * recall / (precision + recall)


def keep_context(reuser: Reuser, other: Item) -> None:
    """Store each document's KV as a dense prefill of `other` computed it (runtime/reuse.py)."""
    kv = reuser.new_kv()
    forward(reuser.model, [Run(kv, other.ids, 0)])
    wanted = {reuser.key(p) for p, d in zip(other.pieces, other.documents) if d}
    reuser.keep_in_context(kv, other.pieces, other.documents, wanted, "", float)


def document_tokens(item: Item) -> int:
    return sum(len(p) for p, d in zip(item.pieces, item.documents) if d)


def top1(forced: torch.Tensor, answer: list[int]) -> float:
    return float((forced.argmax(-1) == torch.tensor(answer)).float().mean())


def measure(
    reuser: Reuser,
    data: list[Item],
    modes: list[Reuse],
    eos: frozenset[int],
    decode,
    answers: bool = True,
    others: list[Item] | None = None,
) -> dict[str, Scores]:
    """Every mode's scores against full prefill. Without `answers`, no greedy answer is decoded
    under the modes (exact match and ROUGE-L stay empty): what calibration needs is cheaper.
    `others`: per item, its documents in another order, whose dense prefill leaves their KV
    (as serving keeps a tenant's new documents); None: each document's KV computed alone."""
    scores = {mode_name(m): Scores() for m in modes}
    for n, item in enumerate(data):
        if others is not None:
            keep_context(reuser, others[n])
        ref_kv, ref_first, _ = start(reuser, item, Reuse("full"))
        prompt_len = len(ref_kv)
        ref_answer, ref_logits = greedy(reuser, ref_kv, ref_first, eos)
        ref_logits = torch.stack(ref_logits)
        keep_prefix(reuser, ref_kv, item)  # what an earlier request with this prompt leaves
        ref_text = decode(ref_answer)
        for mode in modes:
            kv, first, done = start(reuser, item, mode)
            forced = teacher_forced(reuser, kv, first, ref_answer)
            s = scores[mode_name(mode)]
            s.kl.append(kl(ref_logits[0], first))
            s.top1.append(top1(forced, ref_answer))
            s.recomputed.append(done.recomputed / max(1, document_tokens(item)))
            s.deviation.append(done.deviation)
            if answers:
                kv.truncate(prompt_len)
                answer, _ = greedy(reuser, kv, first, eos)
                s.exact.append(float(answer == ref_answer))
                s.rouge.append(rouge_l(ref_text, decode(answer)))
        print(f"item {n + 1}/{len(data)}: {prompt_len} prompt tokens", flush=True)
    return scores


TARGET_TOP1, TARGET_KL = 0.95, 0.05  # the fidelity targets, drawn on the plot


def plot(scores: dict[str, Scores], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blends = [(float(name.split()[1].rstrip("%")), s) for name, s in scores.items() if name.startswith("blend")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r for r, _ in blends]
    left.plot(x, [100 * s.mean("top1") for _, s in blends], "o-", label="blend: top-1 agreement (teacher-forced)")
    if any(s.rouge for _, s in blends):
        left.plot(x, [100 * s.mean("rouge") for _, s in blends], "s--", label="blend: greedy-32 ROUGE-L")
    right.plot(x, [s.mean("kl") for _, s in blends], "o-", label="blend: first-token KL")
    for name, style in (("naive", ":"), ("prefix", "-.")):
        if name in scores:
            left.axhline(100 * scores[name].mean("top1"), linestyle=style, color="grey", label=f"{name}: top-1")
            right.axhline(scores[name].mean("kl"), linestyle=style, color="grey", label=f"{name}: KL")
    left.axhline(100 * TARGET_TOP1, linestyle="--", color="tab:red", linewidth=0.8, label="target")
    right.axhline(TARGET_KL, linestyle="--", color="tab:red", linewidth=0.8, label="target")
    left.set(xlabel="recompute ratio (%)", ylabel="% of the reference (full prefill)", ylim=(0, 101))
    right.set(xlabel="recompute ratio (%)", ylabel="KL(full || reuse), first token", ylim=(0, None))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(scores: dict[str, Scores]) -> str:
    rows = [
        [
            name,
            f"{100 * s.mean('recomputed'):.1f}%",
            f"{s.mean('kl'):.3f}",
            f"{100 * s.mean('top1'):.1f}%",
            f"{100 * s.mean('exact'):.0f}%",
            f"{s.mean('rouge'):.3f}",
            f"{s.mean('deviation'):.3g} / {max(s.deviation, default=0.0):.3g}",
        ]
        for name, s in scores.items()
    ]
    header = [
        "mode",
        "document tokens recomputed",
        "first-token KL",
        "top-1 (32, forced)",
        "greedy-32 exact",
        "ROUGE-L",
        "key deviation mean / max",
    ]
    return table(header, rows)


def load_items(
    loaded: LoadedModel, data: Path, docs: int, limit: int, shuffle: bool, offset: int, words: int
) -> list[Item]:
    if not data.is_file():
        raise FileNotFoundError(f"{data}: no such data file (the shared MuSiQue set)")
    found = list(items(data, loaded.tokenizer, docs, limit, shuffle, offset, words))
    if not found:
        raise DataError(f"{data} has no items from row {offset} on")
    return found


def make_reuser(
    loaded: LoadedModel,
    blend: BlendConfig | None = None,
    deviation_limit: float | None = None,
    memory_bytes: int | None = None,
) -> Reuser:
    store = ChunkStore.from_config(ChunkCacheConfig(memory_bytes=memory_bytes) if memory_bytes else None)
    return Reuser(
        loaded.model,
        loaded.tokenizer,
        store,
        model_fingerprint(loaded),
        blend or BlendConfig(),
        deviation_limit=deviation_limit,
    )


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
) -> dict[str, Scores]:
    """`blend`: the blend's settings besides the ratio (default BlendConfig()); any other names the
    section (`fidelity-shuffled-first_k4`), so a variant does not overwrite the default run.
    `context`: documents' KV from a dense prefill of the same documents in the other order (the
    stored one for shuffled items, the shuffled one otherwise), section suffix `-context`."""
    began = time.perf_counter()
    blend = blend or BlendConfig()
    loaded = load(config)
    data_items = load_items(loaded, data, docs, limit, shuffle, offset, words)
    reuser = make_reuser(loaded, blend)
    modes = [Reuse("prefix"), Reuse("naive"), *(Reuse("blend", r) for r in ratios)]
    decode = loaded.tokenizer.decode
    others = load_items(loaded, data, docs, limit, not shuffle, offset, words) if context else None
    scores = measure(reuser, data_items, modes, loaded.eos_token_ids, decode, others=others)
    name = ("fidelity-shuffled" if shuffle else "fidelity") + variant(blend) + ("-context" if context else "")
    settings = ", ".join(f"{k}={v!r}" for k, v in changed(blend).items())
    order = "shuffled (a fixed permutation per item)" if shuffle else "in their stored order"
    picture = output.parent / f"{name}.png"
    picture.parent.mkdir(parents=True, exist_ok=True)
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
        f"over the reference answer's first {ANSWER} positions, teacher-forced on the reference answer. "
        f"Greedy-{ANSWER} exact / ROUGE-L: the mode's own greedy answer against the reference's. "
        "Key deviation: the blend's relative key deviation of document tokens at its first check layer "
        "(what calibration bounds).\n\n"
        + report(scores)
        + f"\n\n![fidelity against recompute ratio]({picture.name})\n\n"
        f"Took {time.perf_counter() - began:.0f} s."
    )
    title = "Fidelity of reuse, documents " + ("shuffled" if shuffle else "in stored order")
    title += f", blend with {settings}" if settings else ""
    title += ", documents' KV from a dense prefill in the other order" if context else ""
    write_section(output, name, title, command, body)
    print(report(scores), flush=True)
    return scores
