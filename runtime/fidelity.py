"""Fidelity of reused KV: how far a reuse mode moves the answer from full prefill of the same ids.

Per item (MuSiQue passages as documents, the question as the user turn): first-token KL(full || mode),
top-1 agreement over the full-prefill answer's first 32 positions, teacher-forced on that answer (one
early difference does not decide the rest), and optionally the mode's own greedy answer. What
`kvgate calibrate` measures (runtime/calibrate.py) and the fidelity benchmarks report."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from kvgate.chunk_cache import ChunkCacheConfig, ChunkStore
from kvgate.runtime.blend import BlendConfig
from kvgate.runtime.calibration import model_fingerprint
from kvgate.runtime.documents import chat_pieces, document_ids
from kvgate.runtime.errors import DataError
from kvgate.runtime.kv import KVCache
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.model import Run, forward
from kvgate.runtime.prefix import Blocks
from kvgate.runtime.progress import progress
from kvgate.runtime.reuse import Prefilled, ReuseMode, Reuser

# The shared evaluation data beside the project (../shared/data): its MuSiQue RAG set.
MUSIQUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_rag_dev.jsonl"

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


def mode_name(reuse: ReuseMode) -> str:
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


def start(reuser: Reuser, item: Item, reuse: ReuseMode) -> tuple[KVCache, torch.Tensor, Prefilled]:
    """The prompt's KV under `reuse`, the first answer token's logits, and what the reuse prefill did.

    The first token's logits exist once this returns: it is what time to first token measures."""
    kv = reuser.new_kv()
    if reuse.mode == "prefix":  # the prefix blocks an earlier prompt left (`keep_prefix`), as the engine reads them
        prefix_blocks(reuser).attach(kv, item.ids, "")
    done = reuser.prefill(kv, item.pieces, item.documents, reuse)
    if reuse.mode == "prefix":
        done = replace(done, reused=len(kv))
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
    reuser: Reuser, kv: KVCache, first: torch.Tensor, eos: frozenset[int], tokens: int = ANSWER
) -> tuple[list[int], list[torch.Tensor]]:
    ids, logits = [], [first]
    while True:
        token = int(logits[-1].argmax())
        ids.append(token)
        if token in eos or len(ids) == tokens:
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
    return float((forced.argmax(-1) == torch.tensor(answer, device=forced.device)).float().mean())


def measure(
    reuser: Reuser,
    data: list[Item],
    modes: list[ReuseMode],
    eos: frozenset[int],
    decode: Callable[[list[int]], str],
    answers: bool = True,
    others: list[Item] | None = None,
    answer: int = ANSWER,
) -> dict[str, Scores]:
    """Every mode's scores against full prefill. Without `answers`, no greedy answer is decoded
    under the modes (exact match and ROUGE-L stay empty): what calibration needs is cheaper.
    `others`: per item, its documents in another order, whose dense prefill leaves their KV
    (as serving keeps a tenant's new documents); None: each document's KV computed alone. `answer`: the
    reference answer's tokens that are compared."""
    scores = {mode_name(m): Scores() for m in modes}
    for n, item in enumerate(progress(data, "items measured")):
        if others is not None:
            keep_context(reuser, others[n])
        ref_kv, ref_first, _ = start(reuser, item, ReuseMode("full"))
        prompt_len = len(ref_kv)
        ref_answer, ref_logits = greedy(reuser, ref_kv, ref_first, eos, answer)
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
                own, _ = greedy(reuser, kv, first, eos, answer)
                s.exact.append(float(own == ref_answer))
                s.rouge.append(rouge_l(ref_text, decode(own)))
    return scores


def load_items(
    loaded: LoadedModel, data: Path | None, docs: int, limit: int, shuffle: bool, offset: int, words: int
) -> list[Item]:
    """The items of `data` (None: the shared MuSiQue set) as `items` reads them; a usage error when none."""
    data = data or MUSIQUE
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
