"""Content-defined chunks: the spans a tenant's prompts repeat, found wherever they land, with no
markup from the client (a document pasted by a RAG framework, one agent's answer quoted inside
another's message, a history re-rendered as text).

A prompt's token ids are cut around every blank line, and at the end of a line or where a hash of the
last `window` tokens hits a pattern (one position in `average - minimum`), at least `minimum` and at
most `maximum` tokens apart. A cut depends only on the tokens around it, so the same text gives the
same chunks in any prompt once past its first cut: its token ids, and so its chunk keys, do not depend
on where it sits. Each new chunk's KV is kept
as its prompt computed it, keys moved to positions 0..T-1 (as in-context documents are), keyed by its
tokens and the tenant; a later prompt that holds the chunk reuses it through the document path (RoPE
shift, selective recompute, the quality gate, the cost model).

Chunks are chunk store entries, evicted by value like any other; this process also bounds how many
it keeps per tenant and in all, the one a tenant kept or found longest ago going first.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from kvgate.chunk_cache import ChunkKV, ChunkStore
from kvgate.runtime.config import ChunkConfig
from kvgate.runtime.kv import KVCache
from kvgate.runtime.spans import local

MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant (as a signed int64): multiplying mixes bits up
PRIME = 1_000_003
DEFAULT = ChunkConfig()


@dataclass(frozen=True)
class Breaks:
    """A tokenizer's paragraph breaks: tokens of whitespace with a newline, and those with two."""

    newline: frozenset[int] = frozenset()
    paragraph: frozenset[int] = frozenset()

    @classmethod
    @functools.lru_cache(maxsize=8)  # per tokenizer: decoding its vocabulary takes ~1 s, and each engine asks
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> Breaks:
        texts = {i: tokenizer.decode([i]) for i in tokenizer.get_vocab().values()}
        newline = frozenset(i for i, t in texts.items() if "\n" in t and not t.strip())
        return cls(newline, frozenset(i for i in newline if "\n\n" in texts[i]))

    @functools.cached_property
    def ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The newline tokens and the paragraph ones, sorted, as `torch.isin` takes them."""
        return torch.tensor(sorted(self.newline)), torch.tensor(sorted(self.paragraph or {-1}))


NO_BREAKS = Breaks()


def cut(token_ids: Sequence[int], config: ChunkConfig = DEFAULT, breaks: Breaks = NO_BREAKS) -> list[int]:
    """The offsets where the content cuts a run of tokens into chunks, in order: after every paragraph
    break (so that pasted documents, separated by blank lines, begin and end on a cut wherever they
    sit); and at the end of a line or where a hash of the last `window` tokens hits a pattern,
    `minimum` to `maximum` tokens apart. What follows the last cut is the run's edge: where a longer
    run would cut it is not known yet."""
    n, w = len(token_ids), config.window
    if n < w:
        return []
    t = torch.tensor(token_ids, dtype=torch.int64)
    h = torch.zeros(n - w + 1, dtype=torch.int64)
    for j in range(w):  # the hash of the window ending at token i, for i >= w - 1 (int64 wraps)
        h = h * PRIME + t[j : n - w + 1 + j]
    h = (h ^ (h >> 31)) * MIX
    h = (h >> 40) & 0xFFFFFF  # 24 bits from the top: the well mixed ones
    hashed = set((torch.nonzero(h % (config.average - config.minimum) == 0).flatten() + w).tolist())
    lines: set[int] = set()
    always: set[int] = set()  # cut whatever the distance from the last cut
    if breaks.newline:  # after the last of a run of newlines, a word following (a blank line: a paragraph)
        newline, paragraph = breaks.ids
        nl = torch.isin(t, newline)
        ends = nl[:-1] & ~nl[1:]
        lines = set((torch.nonzero(ends).flatten() + 1).tolist())
        blank = nl[1:] & (nl[:-1] | torch.isin(t[1:], paragraph))
        for end in (torch.nonzero(blank[:-1] & ~nl[2:]).flatten() + 2).tolist():
            start = end - 1
            while start > 0 and nl[start - 1]:
                start -= 1
            always |= {start, end}  # the blank line a chunk of its own: written "\n\n" or "\n", "\n"
        # A line at least `minimum` long is cut before and after, so a text that begins or ends on a line
        # break keeps its chunks whatever short line stands before or after it (a quoted answer, a document)
        breaks_at = torch.nonzero(nl).flatten()
        for start in sorted(lines):
            after = breaks_at[torch.searchsorted(breaks_at, start) :]
            end = int(after[0]) if len(after) else n
            if end - start >= config.minimum:
                always |= {start, end} - {n}
    cuts, last = [], 0
    for end in sorted(hashed | lines | always):
        while end - last > config.maximum:
            last += config.maximum
            cuts.append(last)
        if end - last >= config.minimum or (end in always and end > last):
            cuts.append(end)
            last = end
    while n - last > config.maximum:
        last += config.maximum
        cuts.append(last)
    return cuts


@dataclass
class Found:
    """A prompt in chunks after its exact head, and which a tier holds."""

    pieces: list[list[int]]
    found: list[bool]

    @property
    def reused(self) -> int:
        return sum(len(p) for p, f in zip(self.pieces, self.found) if f)


class Chunks:
    """The content-defined chunks of one model in a chunk store; thread-safe."""

    def __init__(
        self,
        store: ChunkStore,
        model: torch.nn.Module,
        model_fp: str,
        key: Callable[[list[int], str], str],
        cost: Callable[[int], float] = lambda tokens: tokens / 300,
        config: ChunkConfig = DEFAULT,
        breaks: Breaks = NO_BREAKS,
    ) -> None:
        self.store, self.model, self.model_fp, self.cost, self.config = store, model, model_fp, cost, config
        self.breaks = breaks
        self.key_of = key  # (token ids, scope) -> chunk key: the one documents use, so blends find chunks
        # tenant -> its chunk keys, oldest first; the tenants that kept one latest last
        self.kept: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self.count = 0
        self.lock = threading.Lock()

    @staticmethod
    def scope(tenant: str) -> str:
        return "chunk:" + tenant

    def key(self, token_ids: list[int], tenant: str) -> str:
        return self.key_of(token_ids, self.scope(tenant))

    def find(self, token_ids: list[int], head: int, tenant: str) -> Found:
        """The prompt cut in chunks (the edge after the last cut: one more piece); found: the chunks
        wholly after the exact `head` that some tier holds, never the one holding the last token (its
        logits start the answer). A piece not held may be held one token short: an answer that stopped
        at its length has no KV for its last token (`keep(final=True)`); its last token is then
        computed as a piece of its own."""
        pieces, found, start = [], [], 0
        for end in [*cut(token_ids, self.config, self.breaks), len(token_ids)]:
            ids = token_ids[start:end]
            if ids:
                usable = head <= start and end < len(token_ids)
                if usable and self.worth(ids) and self.touch(ids, tenant):
                    pieces.append(ids)
                    found.append(True)
                elif usable and self.worth(ids[:-1]) and self.touch(ids[:-1], tenant):
                    pieces += [ids[:-1], ids[-1:]]
                    found += [True, False]
                else:
                    pieces.append(ids)
                    found.append(False)
            start = end
        return Found(pieces, found)

    def touch(self, ids: list[int], tenant: str) -> bool:
        """Whether a tier holds the chunk; one found is the tenant's newest (the bounds drop it last)."""
        key = self.key(ids, tenant)
        if key not in self.store:
            return False
        with self.lock:
            own = self.kept.get(tenant)
            if own is not None and key in own:
                own.move_to_end(key)
        return True

    def keep(self, kv: KVCache, token_ids: list[int], tenant: str, start: int = 0, final: bool = False) -> int:
        """Store the KV of the chunks of `token_ids` from offset `start` on, as `kv` holds it (the KV
        of those tokens, in this context), keys moved to positions 0..T-1; skip those a tier holds
        and the edge, unless `final`: a finished answer ends where it ends, so what `kv` holds after
        the last cut is a chunk too (a later prompt that quotes the answer cuts it there, at the line
        or paragraph that follows). Return where the next call may start: the last cut within `kv`."""
        begin = 0
        for end in cut(token_ids, self.config, self.breaks):
            if end > len(kv):
                break
            if begin >= start and self.worth(token_ids[begin:end]):
                self.store_one(kv, token_ids[begin:end], begin, tenant)
            begin = end
        if final and begin >= start and self.worth(token_ids[begin : len(kv)]):
            self.store_one(kv, token_ids[begin : len(kv)], begin, tenant)
        return max(begin, start)

    def worth(self, ids: list[int]) -> bool:
        """Whether a chunk is long enough to keep (a paragraph break may cut a short one)."""
        return len(ids) >= self.config.minimum

    def store_one(self, kv: KVCache, ids: list[int], start: int, tenant: str) -> None:
        key = self.key(ids, tenant)
        if key in self.store:
            return
        keys, values = local(self.model, kv, start, len(ids))
        if self.store.put(ChunkKV(key, tuple(ids), keys, values, self.cost(len(ids)), self.model_fp)):
            self.remember(key, tenant)

    def remember(self, key: str, tenant: str) -> None:
        """Count a kept chunk against the bounds; drop the oldest beyond them."""
        dropped = []
        with self.lock:
            own = self.kept.setdefault(tenant, OrderedDict())
            if key not in own:
                self.count += 1
            own[key] = None
            own.move_to_end(key)
            self.kept.move_to_end(tenant)
            while len(own) > self.config.per_tenant:
                dropped.append(own.popitem(last=False)[0])
                self.count -= 1
            while self.count > self.config.total:
                oldest = next(iter(self.kept))  # the tenant that kept none for longest
                dropped.append(self.kept[oldest].popitem(last=False)[0])
                self.count -= 1
                if not self.kept[oldest]:
                    del self.kept[oldest]
        for key in dropped:
            self.store.delete(key)
