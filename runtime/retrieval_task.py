"""A retrieval task the default model solves: reuse judged by answer accuracy, not only by KL and top-1.

Each task: `docs` documents, one of them holding a fact ("The vault code of Corvath Ennel is 4817."),
two others holding facts of the same form about other names (distractor needles, as RULER's multi-key
needle tasks have), the rest filler; the question asks for the fact by its name ("What is the vault code
of Corvath Ennel? Reply with the number only."). The documents come in two orders: `stored` (how an
earlier prompt brought them, where their KV would have been computed) and `asked` (the prompt measured),
a permutation that is never the stored order, with the fact's document at every depth in turn over the
tasks. An answer is correct when the first number in it is the fact's number (CacheBlend, ProphetKV and
CacheClip judge reuse so, on needle and RULER-style tasks).

Filler: passages of the shared MuSiQue set (../shared/data/musique_rag_dev.jsonl) when it is there,
picked by the seed, else sentences made here from a fixed vocabulary (a smoke run needs no data). Names
and numbers are made here by the seed: nothing in the tests' corpus (tests/helpers/corpus.py) or in MuSiQue holds
them, so a model cannot answer from memory. Deterministic: the same arguments give the same tasks.

`kvgate bench fidelity --retrieval N` reports it per reuse mode (`measure_tasks`); `kvgate calibrate` can
report it per ratio beside its KL and top-1 with `blend_curve` (on tasks of its own seed).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from kvgate.runtime.documents import chat_pieces, document_ids
from kvgate.runtime.fidelity import MUSIQUE, Item, greedy, keep_context, keep_prefix, mode_name, start
from kvgate.runtime.loader import LoadedModel
from kvgate.runtime.reuse import ReuseMode, Reuser

ANSWER_TOKENS = 8  # greedy tokens decoded: a 4-digit number and its punctuation fit
WORDS = 100  # words per document: ~1k-token prompts of 6 documents, which the default model mostly solves
DISTRACTORS = 2  # other documents holding a fact of the same form about another name (fewer when docs < 3)
BENCH_SEED, CALIBRATION_SEED = 0, 1  # `bench fidelity`'s tasks and `kvgate calibrate`'s: never the same

_ONSETS = "b br c cl d dr f g gr k l m n p qu r s st t th v w z".split()
_VOWELS = "a e i o u ae io ei".split()
_CODAS = "n th r l s v x m nd rk".split()
_ATTRIBUTES = ("vault code", "locker number", "badge number", "room number", "ledger number", "permit number")
_SUBJECTS = "archive,orchard,workshop,harbour office,observatory,weaving hall,granary,signal tower".split(",")
_VERBS = "was rebuilt,was painted,was inspected,was extended,was closed,was reopened,was surveyed".split(",")
_WHEN = "in spring,after the floods,before the census,during the fair,in the dry season,at midwinter".split(",")
_DETAILS = (
    "Its roof is of grey slate and its doors face east.",
    "Visitors are asked to sign the book by the door.",
    "The path to it is lined with young birch trees.",
    "A small bell above the entrance rings at noon.",
    "Its records are kept in oak boxes on the upper floor.",
    "The caretaker lives in the cottage beside it.",
    "Carts bring supplies to it twice a week.",
    "Lamps are lit along its wall at dusk.",
)


@dataclass(frozen=True)
class Task:
    question: str
    answer: str  # the fact's number, as digits
    stored: list[str] = field(default_factory=list)  # the documents, in the order an earlier prompt had them
    asked: list[str] = field(default_factory=list)  # the same documents, in the order of the prompt measured
    needle: int = 0  # the index in `asked` of the document holding the fact
    lead: str = ""  # the answer's first words, given after the generation prompt ("The vault code of X is")


def _name(rng: random.Random) -> str:
    def word() -> str:
        parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 2))]
        return "".join(parts).capitalize() + rng.choice(("", "el", "a", "is", "on"))

    return f"{word()} {word()}"


def _made_filler(rng: random.Random, words: int) -> str:
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < words:
        place = f"The {rng.choice(_SUBJECTS)} of {_name(rng).split()[0]}"
        sentences.append(f"{place} {rng.choice(_VERBS)} {rng.choice(_WHEN)}. {rng.choice(_DETAILS)}")
    return " ".join(sentences)


def _cut(text: str, words: int) -> str:
    return " ".join(text.split()[:words])


def _passages(data: Path | None) -> list[str]:
    """Every passage of the MuSiQue file, in file order; none when it is absent."""
    if data is None or not data.is_file():
        return []
    with data.open() as f:
        return [str(p) for line in f for p in json.loads(line)["passages"]]


def _insert(rng: random.Random, text: str, sentence: str) -> str:
    """`sentence` between two words of `text` after one of its sentence ends (or first, when it has none)."""
    words = text.split()
    ends = [i + 1 for i, w in enumerate(words[:-1]) if w.endswith(".") or w == "."]
    at = rng.choice(ends) if ends else 0
    return " ".join([*words[:at], sentence, *words[at:]])


def tasks(count: int, seed: int = 0, docs: int = 6, words: int = 120, data: Path | None = MUSIQUE) -> list[Task]:
    """`count` tasks of `docs` documents of about `words` words each. `seed` picks everything; sets for
    calibration and for benchmarks differ by their seed. `data`: MuSiQue passages as filler (None or a
    missing file: filler made here)."""
    if count < 0 or docs < 2 or words < 20:
        raise ValueError(f"tasks: count >= 0, docs >= 2 and words >= 20 (got {count}, {docs}, {words})")
    pool, distractors = _passages(data), min(DISTRACTORS, docs - 1)
    made: list[Task] = []
    for n in range(count):
        rng = random.Random(f"retrieval-{seed}-{n}")
        facts = random.Random(f"retrieval-facts-{seed}-{n}")  # names and numbers apart from the filler's picks
        attribute = facts.choice(_ATTRIBUTES)
        names: list[str] = []
        while len(names) < distractors + 1:
            if (name := _name(facts)) not in names:
                names.append(name)
        numbers = facts.sample(range(1000, 10000), distractors + 1)
        if pool:
            filler = [_cut(p, words) for p in rng.sample(pool, docs)]
        else:
            filler = [_made_filler(rng, words) for _ in range(docs)]
        asked_order = list(range(docs))
        while asked_order == list(range(docs)):
            asked_order = rng.sample(range(docs), docs)
        needle = n % docs  # the fact's depth in the asked prompt, in turn over the tasks
        holder = asked_order[needle]  # the stored document that holds it
        others = rng.sample([i for i in range(docs) if i != holder], distractors)
        for doc, name, number in zip([holder, *others], names, numbers):
            filler[doc] = _insert(rng, filler[doc], f"The {attribute} of {name} is {number}.")
        question = f"What is the {attribute} of {names[0]}? Reply with the number only."
        lead = f"The {attribute} of {names[0]} is"
        made.append(Task(question, str(numbers[0]), filler, [filler[i] for i in asked_order], needle, lead))
    return made


def task_item(tokenizer: PreTrainedTokenizerBase, task: Task, stored: bool = False) -> Item:
    """The task as a prompt of pieces (head, documents, the question): its asked order, or its stored one."""
    head, tail = chat_pieces(tokenizer, [{"role": "user", "content": task.question}])
    tail = tail + tokenizer.encode(task.lead, add_special_tokens=False)  # the answer's start, as RULER prompts
    documents = task.stored if stored else task.asked
    pieces = [head, *(document_ids(tokenizer, d) for d in documents), tail]
    return Item(pieces, [False, *([True] * len(documents)), False])


def correct(task: Task, text: str) -> bool:
    """Whether an answer gives the fact: the first number in it is the fact's."""
    found = re.search(r"\d+", text.replace(",", ""))
    return found is not None and found.group() == task.answer


@dataclass
class Accuracy:
    correct: list[bool] = field(default_factory=list)  # per task: the mode's greedy answer is right
    same: list[bool] = field(default_factory=list)  # per task: the mode's greedy answer is full prefill's

    @property
    def rate(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else float("nan")


def kept(full: Accuracy, mode: Accuracy) -> tuple[int, int]:
    """Of the tasks full prefill answers right, how many the mode answers right too: (kept, of)."""
    pairs = [m for f, m in zip(full.correct, mode.correct) if f]
    return sum(pairs), len(pairs)


def accuracy(
    reuser: Reuser,
    found: list[Task],
    items: list[Item],
    modes: list[ReuseMode],
    eos: frozenset[int],
    decode: Callable[[list[int]], str],
    stored: list[Item] | None = None,
    tokens: int = ANSWER_TOKENS,
) -> dict[str, Accuracy]:
    """Full prefill's accuracy ("full") and every mode's, greedy, over the tasks and their prompts
    (`items`, from task_item). `stored`: per task, its documents in the stored order, densely prefilled
    first so the documents' KV is what that prompt computed (a server keeping a tenant's documents);
    None: each document's KV computed alone, as the reuser does on a miss."""
    scores = {"full": Accuracy(), **{mode_name(m): Accuracy() for m in modes}}
    for n, (task, item) in enumerate(zip(found, items)):
        if stored is not None:
            keep_context(reuser, stored[n])
        kv, first, _ = start(reuser, item, ReuseMode("full"))
        truth, _ = greedy(reuser, kv, first, eos, tokens)
        keep_prefix(reuser, kv, item)  # what an earlier identical request leaves, for `prefix`
        scores["full"].correct.append(correct(task, decode(truth)))
        scores["full"].same.append(True)
        for mode in modes:
            kv, first, _ = start(reuser, item, mode)
            own, _ = greedy(reuser, kv, first, eos, tokens)
            scores[mode_name(mode)].correct.append(correct(task, decode(own)))
            scores[mode_name(mode)].same.append(own == truth)
        print(f"retrieval {n + 1}/{len(found)}: {len(item.ids)} prompt tokens, full {decode(truth)!r}", flush=True)
    return scores


def measure_tasks(
    loaded: LoadedModel,
    reuser: Reuser,
    modes: list[ReuseMode],
    count: int,
    seed: int,
    docs: int = 6,
    words: int = WORDS,
    data: Path | None = MUSIQUE,
    context: bool = False,
) -> tuple[dict[str, Accuracy], list[Item]]:
    """`count` tasks made and scored under every mode (`accuracy`); `context`: the documents' KV from a dense
    prefill of their stored order. The scores, and the prompts (for their lengths)."""
    found = tasks(count, seed, docs, words, data)
    items = [task_item(loaded.tokenizer, t) for t in found]
    stored = [task_item(loaded.tokenizer, t, stored=True) for t in found] if context else None
    decode = loaded.tokenizer.decode
    return accuracy(reuser, found, items, modes, loaded.eos_token_ids, decode, stored), items


def blend_curve(
    loaded: LoadedModel,
    reuser: Reuser,
    ratios: tuple[float, ...],
    count: int,
    docs: int = 6,
    data: Path | None = MUSIQUE,
    context: bool = False,
) -> tuple[Accuracy, dict[float, Accuracy]]:
    """Full prefill's accuracy and each blend ratio's, on calibration's own tasks (CALIBRATION_SEED): what
    `kvgate calibrate` reports beside KL and top-1 (a ratio's share of full prefill's right answers kept:
    `kept(full, curve[ratio])`)."""
    ordered = sorted(set(ratios))
    scores, _ = measure_tasks(loaded, reuser, [ReuseMode("blend", r) for r in ordered], count, CALIBRATION_SEED,
                              docs, WORDS, data, context)  # fmt: skip
    return scores["full"], {r: scores[mode_name(ReuseMode("blend", r))] for r in ordered}
