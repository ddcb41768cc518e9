"""Prefill over reused document KV with selective recompute (CacheBlend).

A prompt is a list of pieces. A piece with cached KV (computed alone at positions 0..T-1) is
placed at its offset by a RoPE shift; the others are computed fresh. Reused KV lacks the
attention to the pieces before it, so the layers up to the first check layer run over every
token; at each check layer the reused tokens whose fresh keys deviate most from their reused
keys are kept (the top `ratio`), and from there on only they and the fresh tokens are computed.
Their new K/V overwrite the reused rows, and their queries attend over the whole mixed KV.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from kvgate.runtime import cpu_attention
from kvgate.runtime.invariance import MOST, row_floor
from kvgate.runtime.kernels import gather_rows, rope_shift, token_deviation
from kvgate.runtime.kv import KVCache
from kvgate.runtime.model import attend, finish_layer, logits_of, project
from kvgate.runtime.rope import token_angles
from kvgate.runtime.weights import Layer, decoder_of


@dataclass(frozen=True)
class BlendConfig:
    ratio: float = 0.15  # fraction of reused tokens recomputed after the check layers
    # Layers where tokens are selected; the ones before the first run over every token.
    # Several layers filter gradually: `widen` times more tokens are kept at each earlier one.
    check_layers: tuple[int, ...] = (1,)
    widen: float = 2.0
    first_k: int = 0  # always recompute each reused piece's first k tokens (attention sinks)
    # "deviation": CacheBlend's key deviation; "attention": deviation weighted by the attention
    # the question (the fresh tokens after the last document) pays each token at the check layer
    # (measured: lower first-token KL, lower top-1 over 32 answer tokens); "random": the baseline.
    select: str = "deviation"
    seed: int = 0  # for random selection


class Layered(Protocol):
    """Cached KV handed out layer by layer (a ChunkKV, or a Loading still reading from a lower tier)."""

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Piece:
    token_ids: list[int]
    # Keys post-RoPE at 0..T-1, [kv_heads, T, head_dim] per layer; None: computed fresh.
    cached: Layered | None = None

    @property
    def reused(self) -> bool:
        return self.cached is not None


@dataclass
class Blended:
    logits: torch.Tensor  # the last token's, [vocab]
    reused: int  # tokens whose cached KV was kept
    recomputed: int  # reused tokens computed again
    deviation: float  # mean key deviation of reused tokens at the first check layer, relative
    recomputed_mask: torch.Tensor  # [N] bool, on the CPU: the reused tokens computed again


def place(kv: KVCache, layer: int, pieces: list[Piece], start: int, shift: Shift | None) -> None:
    """Write layer `layer` of every reused piece's KV at its offset in `kv` (the pieces begin at `start`), the keys
    RoPE-shifted to their new positions as they are written (`shift`: None where none moves). Called per layer
    just before it runs, so a piece still loading is waited for one layer at a time. On a CPU each piece is one
    kernel call (runtime/cpu_place.c: copied, shifted and written into the blocks in one pass)."""
    offset = start
    for piece in pieces:
        n = len(piece.token_ids)
        if piece.cached is not None:
            keys, values = piece.cached.layer(layer)
            keys, values = keys.to(kv.device), values.to(kv.device)  # a lower tier's copy on the host
            moved = shift if shift is not None and shift.begin <= offset < shift.end else None
            angles = slice(offset - moved.begin, offset - moved.begin + n) if moved is not None else slice(0)
            kernel = cpu_attention.writer(keys, values, kv.dtype)
            if kernel is not None:
                cos, sin = (moved.cos[angles], moved.sin[angles]) if moved is not None else (None, None)
                kernel.write(keys, values, kv.writable(layer, offset, offset + n), offset, None, cos, sin)
            else:
                for rows, at_keys, at_values in kv.targets(layer, offset, offset + n):
                    if moved is not None:
                        at = slice(angles.start + rows.start, angles.start + rows.stop)
                        rope_shift(keys[:, rows], moved.cos[at], moved.sin[at], out=at_keys)
                    else:
                        at_keys.copy_(keys[:, rows])
                    at_values.copy_(values[:, rows])
        offset += n


@dataclass(frozen=True)
class Shift:
    """Where the reused keys lie in the KV, [begin, end), and each token's cos/sin [end - begin, head_dim]."""

    begin: int
    end: int
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, model: PreTrainedModel, pieces: list[Piece], start: int, device: torch.device) -> Shift | None:
        """Each reused piece's tokens moved from 0..T-1 to their offset; None where none moves."""
        deltas, offset = [], start
        for piece in pieces:
            deltas.append(torch.full((len(piece.token_ids),), offset if piece.reused else 0))
            offset += len(piece.token_ids)
        moved = torch.nonzero(torch.cat(deltas)).flatten() if deltas else torch.empty(0)
        if len(moved) == 0:
            return None
        begin, end = int(moved[0]), int(moved[-1]) + 1
        cos, sin = token_angles(model, torch.cat(deltas)[begin:end], device)
        return cls(start + begin, start + end, cos, sin)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float):
    """Queries at sorted `positions` [n] over keys 0..N-1, causal by true position.

    Queries are split in groups, each attending only to the keys up to its last position, so
    the masked-out upper triangle is mostly skipped rather than computed and thrown away."""
    n = q.shape[1]
    groups = max(1, min(8, n // 64))
    out = torch.empty_like(q)
    for rows in torch.arange(n, device=q.device).tensor_split(groups):
        if len(rows) == 0:
            continue
        pos = positions[rows]
        end = int(pos[-1]) + 1
        mask = torch.arange(end, device=q.device)[None, :] <= pos[:, None]
        out[:, rows] = F.scaled_dot_product_attention(
            q[None, :, rows], k[None, :, :end], v[None, :, :end], attn_mask=mask, scale=scale, enable_gqa=True
        )[0]
    return out


def attend_part(
    layer: Layer, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, rows: torch.Tensor, contiguous: bool
) -> torch.Tensor:
    """Attention of queries `q` [n, heads, d] at sorted positions `rows` over a layer's KV k, v [kv_heads, >= end,
    d] up to the last of them; `contiguous`: the rows are every position up to there (a plain causal block)."""
    end = int(rows[-1]) + 1
    keys, values, scale = k[:, :end], v[:, :end], layer.scale
    if contiguous:
        return attend(q.transpose(0, 1), keys, values, scale).transpose(0, 1)
    return attend_rows(q.transpose(0, 1), keys, values, rows, scale).transpose(0, 1)


def attend_blocks(
    kernel: cpu_attention.Kernel,
    table: torch.Tensor,
    kv_heads: int,
    q: torch.Tensor,
    scale: float,
    first: int,
    rows: torch.Tensor | None,
) -> torch.Tensor:
    """Queries q [m, heads, d] at positions `rows` (None: first..first+m) over a layer's KV where `table` says it
    lies, causal: the CPU kernel, each row as a prefill computes it."""
    out = torch.empty_like(q)
    kernel.paged(q.transpose(0, 1), table, kv_heads, first, scale, out.transpose(0, 1), rows)
    return out


def compute_layer(
    model: PreTrainedModel,
    kv: KVCache,
    i: int,
    h: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    total: int,
    whole: bool,
) -> Steps[torch.Tensor]:
    """Layer i for hidden states h at sorted positions `rows` (`whole`: every position from the first to `total`),
    its q, k, v [n, heads, d] projected: their K and V stored, then the rest of the layer in parts of ROWS, each
    part's work yielded (a long prompt's layer, its attention growing with the square of its length, never holds a
    step up for long); never after the model's last layer (a whole KV has its logits), where the last row alone is
    computed where that gives its same bits."""
    layers = decoder_of(model).layers
    layer, (q, k, v), final = layers[i], qkv, i == len(layers) - 1
    table = store(kv, i, rows, k, v, whole, total)
    kernel = cpu_attention.usable(q, layer.window) if table is not None else None
    if final and kernel is not None and table is not None and (floor := row_floor(model)) <= MOST:
        return last_row(layer, kernel, table, kv.kv_heads, h, q, rows, floor)
    keys, values = kv.layer(i, total) if kernel is None else (k, v)  # the kernel reads the blocks themselves
    out = torch.empty_like(h)
    for a in range(0, len(h), ROWS):
        b = min(a + ROWS, len(h))
        if kernel is not None and table is not None:
            at = None if whole else rows[a:b]
            attn = attend_blocks(kernel, table, kv.kv_heads, q[a:b], layer.scale, total - len(h) + a, at)
        else:
            attn = attend_part(layer, keys, values, q[a:b], rows[a:b], whole)
        out[a:b] = finish_layer(layer, h[a:b], attn)
        if not final or b < len(h):
            yield (b - a) / len(layers)
    return out


def last_row(
    layer: Layer,
    kernel: cpu_attention.Kernel,
    table: torch.Tensor,
    kv_heads: int,
    h: torch.Tensor,
    q: torch.Tensor,
    rows: torch.Tensor,
    floor: int,
) -> torch.Tensor:
    """The last layer for the only row whose output is read, the prompt's last (its K and V, every row's, already
    stored): as model.py's `last_layer`, the linears see `floor` rows (copies of the first before it), where each row
    is what it is among any number of rows, and the kernel computes each row alike: the same bits as every row's."""
    pick = torch.tensor([0] * (floor - 1) + [len(h) - 1], device=h.device)
    attn = attend_blocks(kernel, table, kv_heads, q[pick], layer.scale, 0, rows[pick])
    return finish_layer(layer, h[pick], attn)[-1:]


def store(
    kv: KVCache, i: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, whole: bool, total: int
) -> torch.Tensor | None:
    """Layer i's computed rows k, v [n, kv_heads, d] into `kv` at positions `rows` (`whole`: every row from rows[0]
    to `total`). On a CPU in one kernel call, which returns the layer's table (`KVCache.table`) for the attention
    kernel to read the rows where they lie; else None."""
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    kernel = cpu_attention.writer(k, v, kv.dtype)
    if kernel is not None:
        start = total - len(rows) if whole else int(rows[0])
        table = kv.writable(i, start, total)
        kernel.write(k, v, table, start, None if whole else rows)
        return table
    if whole:
        kv.write(i, total - len(rows), k, v)
    else:
        kv.scatter(i, rows, k, v)
    return None


def choose(
    deviation: torch.Tensor, reused: torch.Tensor, keep: int, forced: torch.Tensor, config: BlendConfig
) -> torch.Tensor:
    """Indices (sorted) into the current selection: all fresh and forced tokens, plus the `keep`
    reused ones that deviate most."""
    score = deviation.clone()
    if config.select == "random":
        g = torch.Generator().manual_seed(config.seed)
        score = torch.rand(len(score), generator=g).to(deviation.device)
    score[~reused] = float("-inf")
    candidates = int(reused.sum())
    top = score.topk(min(keep, candidates)).indices
    chosen = ~reused | forced
    chosen[top] = True
    return chosen.nonzero()[:, 0]


def question_attention(
    layer: Layer,
    h: torch.Tensor,
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    reused: torch.Tensor,
) -> torch.Tensor:
    """Per token, the attention the question pays it (mean over heads and question tokens): the
    question is the fresh tokens after the last reused one; keys [kv_heads, n, d] of all tokens."""
    n = len(h)
    last = int(reused.nonzero().max()) if reused.any() else -1
    t = max(1, n - 1 - last)
    q = project(layer, h[-t:], cos[-t:], sin[-t:])[0].transpose(0, 1)  # [heads, t, d]
    k = keys.repeat_interleave(q.shape[0] // keys.shape[0], 0).to(q.dtype)
    scores = (q @ k.transpose(1, 2)) * layer.scale  # [heads, t, n]
    future = torch.arange(n, device=q.device)[None, :] > torch.arange(n - t, n, device=q.device)[:, None]
    return scores.masked_fill(future, float("-inf")).softmax(-1).float().mean((0, 1))


OVERHEAD = 16  # a blend's fixed cost beyond a full prefill's, in prefill tokens (measured on CPU)


def cost(tokens: int, reused: int, layers: int, config: BlendConfig) -> float:
    """A blend's work in prefill tokens, for `tokens` prompt tokens of which `reused` have cached KV:
    every token up to the first check layer, the fresh and the recomputed ones above it."""
    below = min(config.check_layers, default=0) + 1 if reused else layers
    above = tokens - reused + reused * config.ratio
    return (tokens * below + above * (layers - below)) / layers + OVERHEAD


def first_tokens(pieces: list[Piece], k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    masks = []
    for piece in pieces:
        m = torch.zeros(len(piece.token_ids), dtype=torch.bool, device=device)
        if piece.reused:
            m[:k] = True
        masks.append(m)
    return torch.cat(masks)


ROWS = 256  # queries a blend computes between two yields

T = TypeVar("T")
Steps = Generator[float, None, T]  # yields the work done since the last yield, in prefill tokens


def drain(steps: Steps[T]) -> T:
    """Run stepwise work to its end in one go."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def prefill(model: PreTrainedModel, kv: KVCache, pieces: list[Piece], config: BlendConfig) -> Blended:
    return drain(blend(model, kv, pieces, config))


@torch.inference_mode()
def blend(model: PreTrainedModel, kv: KVCache, pieces: list[Piece], config: BlendConfig) -> Steps[Blended]:
    """Fill `kv` with the prompt's KV (reused where it can be) and return the last token's logits.
    The pieces follow whatever `kv` already holds (an exact prefix), which their tokens attend to.
    Layer by layer: after each it yields its work (the rows it computed, in whole-prompt tokens),
    so the engine can spread a long blend over steps between other sequences' decodes."""
    inner, device = model.model, model.device
    reused_all = torch.cat([torch.full((len(p.token_ids),), p.reused, device=device) for p in pieces])
    start = len(kv)
    n = len(reused_all)
    total = start + n
    kv.reserve(total)
    shift = Shift.of(model, pieces, start, kv.device)
    ids = torch.tensor([t for p in pieces for t in p.token_ids], device=device)
    h = inner.embed_tokens(ids)
    positions = torch.arange(start, total, device=device)
    cos_all, sin_all = (t[0] for t in inner.rotary_emb(h[None], positions[None]))
    forced_all = first_tokens(pieces, config.first_k, device)
    n_reused = int(reused_all.sum())
    sel = torch.arange(n, device=device)  # the tokens being computed (indices into the pieces), sorted
    checks = sorted(config.check_layers) if n_reused else []
    deviation = 0.0

    layers = decoder_of(model).layers
    cos, sin = cos_all, sin_all
    for i, layer in enumerate(layers):
        if i in checks or len(sel) < n:  # else every row is computed here before any is read: nothing to place
            place(kv, i, pieces, start, shift)
        if i in checks:
            j = checks.index(i)
            keep = round(n_reused * min(1.0, config.ratio * config.widen ** (len(checks) - 1 - j)))
            reused = reused_all[sel]
            score = torch.zeros(len(sel), device=device)
            if keep > 0 and config.select != "random":
                fresh = project(layer, h, cos, sin)[1].transpose(0, 1)  # [kv_heads, n, d]
                placed = kv.rows(start, total, i)[0]
                cached = placed if len(sel) == n else gather_rows(placed, sel)
                score = token_deviation(fresh, cached)
                if j == 0:
                    norm = cached.float().pow(2).sum((0, 2))
                    deviation = float((score[reused] / norm[reused].clamp_min(1e-12)).mean())
                if config.select == "attention":
                    score = score * question_attention(layer, h, fresh, cos, sin, reused)
            picked = choose(score, reused, keep, forced_all[sel], config)
            sel, h, cos, sin = sel[picked], h[picked], cos[picked], sin[picked]

        q, k, v = project(layer, h, cos, sin)
        h = yield from compute_layer(model, kv, i, h, (q, k, v), sel + start, total, len(sel) == n)
        kv.lengths[i] = total  # the last layer's length is the KV's: whole only once the blend is

    computed = torch.zeros(n, dtype=torch.bool, device=device)
    computed[sel] = True
    recomputed = int(reused_all[sel].sum())
    mask = (reused_all & computed).cpu()
    return Blended(logits_of(model, h[-1]), n_reused - recomputed, recomputed, deviation, mask)
