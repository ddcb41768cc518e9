"""Automatic prefix caching: every prompt's exact KV kept in blocks, found again by any later
prompt of the same tenant that begins with the same tokens (vLLM's APC, SGLang's radix tree).

A token sequence is cut in blocks of `size` tokens from its first; a block's key hashes the key of
the block before it (the first: the tenant's root) and its own tokens, so a key names one exact
context, and its KV, stored at the prompt's own positions, is reused as it is: no shift, no
recompute. Blocks are chunk store entries like any other, on its tiers, evicted by value.

A lookup walks the chain from the first block until a key is missing. There, the blocks this
process stored under the same parent (a bounded index: a radix tree one block deep) give the
longest run of tokens the prompt shares with one of them, so reuse ends on the token where two
prompts part, not on a block boundary. Another replica on the same Redis finds whole blocks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvgate.chunk_cache import ChunkKV, ChunkStore, chunk_key
from kvgate.runtime.kv import KVCache
from kvgate.runtime.reuse import Attached, snapshot

BLOCK = 64  # tokens per block: long enough that a prompt's blocks are few, short enough to share


def common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two runs share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Blocks:
    """The prefix blocks of one model in a chunk store; thread-safe."""

    def __init__(
        self,
        store: ChunkStore,
        model_fp: str,
        tokenizer_fp: str,
        cost: Callable[[int], float] = lambda tokens: tokens / 300,
        size: int = BLOCK,
        max_branches: int = 1 << 16,
        namespace: str = "block",
        grid: int = 1,
    ) -> None:
        if size < 1:
            raise ValueError(f"a block holds at least one token, got size={size}")
        self.store, self.model_fp, self.tokenizer_fp = store, model_fp, tokenizer_fp
        self.cost, self.size = cost, size  # cost: seconds to compute n tokens (an entry's value)
        self.namespace = namespace  # "block": exact KV; another: a chain of its own (a blend's KV, runtime/caching.py)
        # parent key -> {child key: its tokens}, for the children this process stored; the parents
        # seen latest last, `max_branches` children in all.
        self.children: OrderedDict[str, dict[str, tuple[int, ...]]] = OrderedDict()
        self.max_branches, self.branches = max_branches, 0
        # A read ends at a multiple of `grid` (runtime/model.py GRID): the prompt's rows after it are then
        # computed by the very kernels its whole prefill would run.
        self.grid = grid
        self.lock = threading.Lock()

    def key(self, parent: str, token_ids: Sequence[int], tenant: str) -> str:
        return chunk_key(self.model_fp, self.tokenizer_fp, token_ids, f"{self.namespace}:{tenant}:{parent}")

    def root(self, tenant: str) -> str:
        return self.key("", (), tenant)

    def attach(self, kv: KVCache, token_ids: Sequence[int], tenant: str) -> Attached:
        """Extend `kv` (holding an exact prefix of `token_ids`, maybe empty) with the stored blocks
        that continue it, up to all but the last token (its logits start the answer), ending at a
        multiple of `grid`; return how many tokens this added and where the rows that are full prefill's
        own end (a block may hold decoded rows, or rows a lossy codec read back)."""
        limit = len(token_ids) - 1
        have = before = exact = len(kv)
        exact_so_far = True
        parent, start = self.root(tenant), 0
        while start < limit:
            block = tuple(token_ids[start : start + self.size])
            key = self.key(parent, block, tenant)
            entry = self.store.get(key, self.model_fp) if len(block) == self.size else None
            n = len(block)
            if entry is None or entry.token_ids != block:
                entry, n = self.branch(parent, block)
            if entry is None:
                break
            stop = min(start + n, limit)
            if stop > have:
                skip = have - start
                kv.share(entry.keys[:, :, skip : stop - start], entry.values[:, :, skip : stop - start])
                have = stop
                if exact_so_far:
                    exact = min(stop, start + entry.exact_rows)
                    exact_so_far = exact == stop
            if n < self.size:  # the prompts part inside this block
                break
            parent, start = key, start + self.size
        matched, end = have, have - have % self.grid
        if before <= end < have:
            kv.truncate(end)
            have, exact = end, min(exact, end)
        return Attached(have - before, exact, matched)

    def branch(self, parent: str, block: tuple[int, ...]) -> tuple[ChunkKV | None, int]:
        """Of the stored children of `parent`, the one sharing the most leading tokens with
        `block`, and how many; (None, 0) for none."""
        with self.lock:
            found = dict(self.children.get(parent, {}))
        ranked = sorted(((common(tokens, block), key) for key, tokens in found.items()), reverse=True)
        for n, key in ranked:
            if n == 0:
                break
            entry = self.store.get(key, self.model_fp)
            if entry is not None and entry.token_ids[:n] == block[:n]:
                return entry, n
            self.forget(parent, key)  # evicted from every tier
        return None, 0

    def keep(self, kv: KVCache, token_ids: Sequence[int], tenant: str, start: int = 0, exact: int | None = None) -> int:
        """Store the blocks of the first len(token_ids) tokens of `kv` (exact KV of those tokens)
        from the block holding token `start` on (those before it are stored already); the last
        block may be partial; `exact`: where the rows that are full prefill's own, bit for bit, end (the
        rest were decoded, or computed over decoded rows). Return where the next call may start: the end
        of the last whole block."""
        end = min(len(token_ids), len(kv))
        parent, first = self.root(tenant), 0
        while first < end:
            block = tuple(token_ids[first : min(first + self.size, end)])
            key = self.key(parent, block, tenant)
            if first + self.size > start:
                entry = snapshot(kv, key, block, self.cost(len(block)), self.model_fp, first, exact)
                if self.store.put(entry):
                    self.remember(parent, key, block)
            if len(block) < self.size:
                break
            parent, first = key, first + self.size
        return end - end % self.size

    def remember(self, parent: str, key: str, block: tuple[int, ...]) -> None:
        with self.lock:
            siblings = self.children.setdefault(parent, {})
            if key not in siblings:
                siblings[key] = block
                self.branches += 1
            self.children.move_to_end(parent)
            while self.branches > self.max_branches:
                _, dropped = self.children.popitem(last=False)
                self.branches -= len(dropped)

    def forget(self, parent: str, key: str) -> None:
        with self.lock:
            siblings = self.children.get(parent)
            if siblings is not None and siblings.pop(key, None) is not None:
                self.branches -= 1
                if not siblings:
                    del self.children[parent]
