"""The layer loop: one forward step over a ragged batch of sequences.

Each sequence contributes a run of new tokens (a prompt chunk or one decode token).
Projections and MLPs run once over all tokens of the step; attention runs per sequence
over that sequence's own KV, so sequences of any length share a step without padding.

A prompt's KV is the same bit for bit however its prefill is split (a cached prefix continued, chunked
prefill, other sequences in the step), so that reuse called exact is exact in every dtype:
- a linear layer's rows do not depend on how many rows are computed with them, once there are at least
  `row_floor` (measured per model, dtype and thread count: CPU GEMMs take other paths for a few rows), so a
  step's rows are padded to it;
- attention of prompt rows runs in chunks that start at multiples of GRID, each by the same kernels whatever
  came before (`attend_grid`); the engine cuts prefill runs and rounds prefix hits to GRID. In bf16 on a CPU
  with AVX512-BF16, and in float32 on one with AVX512F, a kernel of kvgate's own computes every row alike
  whatever its call (runtime/cpu_attention.py): there the grid is 1 (`grid_of`), and a prompt read from prefix
  blocks computes only its last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from kvgate.runtime import cpu_attention
from kvgate.runtime.decode import Batch, Batches
from kvgate.runtime.invariance import MOST, row_floor
from kvgate.runtime.kv import KVCache
from kvgate.runtime.weights import Layer, decoder_of


@dataclass
class Run:
    kv: KVCache
    token_ids: list[int]
    start: int  # position of the first token; equals len(kv) before the step


# CPU's flash kernel, which returns the log-sum-exp beside the output (and reads KV heads as GQA groups).
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# Rows from which the merged kernels beat the masked one (measured after 3.7k cached, 1 thread: 64 rows 15 ms both,
# 256 rows 48 against 51 ms, 1024 rows 155 against 195 ms, 3.6k rows 354 against 669 ms).
MERGED_ROWS = 512
# Prompt rows are attended in chunks that begin at multiples of this (a prefix block's size).
GRID = 64


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q: [heads, n, d], the last n positions of k, v: [kv_heads, T, d]. Causal; with a sliding
    `window`, each query sees only its own position and the window - 1 before it."""
    if window is not None:  # keys out of every query's window never reach the kernel
        first = max(0, k.shape[1] - q.shape[1] - window + 1)
        k, v = k[:, first:], v[:, first:]
    if q.shape[1] == 1:
        return attend_one(q, k, v, scale)
    kernel = cpu_attention.usable(q, window)
    if kernel is not None:
        return kernel(q, k, v, k.shape[1] - q.shape[1], scale)
    # A batch dimension matters: on CPU, 3-D inputs fall back to SDPA's slow math kernel.
    q, k, v = q[None], k[None], v[None]
    n, total = q.shape[2], k.shape[2]
    if n == total and (window is None or n <= window):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    elif window is None and q.device.type == "cpu" and n >= MERGED_ROWS:
        out = attend_after(q, k, v, scale)
    else:
        rows = torch.arange(total - n, total, device=q.device)[:, None]
        cols = torch.arange(total, device=q.device)[None, :]
        mask = cols <= rows
        if window is not None:
            mask &= cols > rows - window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0]


def attend_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last n positions over a longer KV ([1, heads, n, d] over [1, kv_heads, T, d]),
    as two flash kernels merged by their log-sum-exp: every query over the keys before it (no mask), and
    causally over the n (is_causal). SDPA with a mask runs a kernel half as fast on CPU (measured: 3.6k rows
    after 129 cached, one layer, 1 thread: 669 ms masked, 354 ms merged; full prefill's causal 333-388 ms), which
    made a prompt continuing a short cached prefix slower than computing it whole."""
    n, total = q.shape[2], k.shape[2]
    before, before_lse = FLASH(q, k[:, :, : total - n], v[:, :, : total - n], 0.0, False, scale=scale)[:2]
    own, own_lse = FLASH(q, k[:, :, total - n :], v[:, :, total - n :], 0.0, True, scale=scale)[:2]
    top = torch.maximum(before_lse, own_lse)
    w_before, w_own = (before_lse - top).exp(), (own_lse - top).exp()
    whole = w_before + w_own
    out = before.float() * (w_before / whole)[..., None] + own.float() * (w_own / whole)[..., None]
    return out.to(q.dtype)


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head (a decode step) over every key: two small batched matmuls, each KV head
    with the query heads it serves. Measured on CPU: SDPA's flash kernel takes milliseconds a layer
    for this shape (its blocking is for long queries), which was most of a decode step."""
    heads, _, d = q.shape
    kv_heads, dtype = k.shape[0], q.dtype
    if dtype != torch.float32 and q.device.type == "cpu":  # half-precision batched matmuls are slow on CPUs
        q, k, v = q.float(), k.float(), v.float()
    grouped = q.reshape(kv_heads, heads // kv_heads, d)  # query head h reads KV head h // group
    scores = torch.bmm(grouped, k.transpose(1, 2)).mul_(scale)
    return torch.bmm(scores.softmax(-1), v).reshape(heads, 1, d).to(dtype)


def attend_grid(
    q: torch.Tensor, kv: KVCache, i: int, start: int, scale: float, window: int | None, out: torch.Tensor
) -> None:
    """`attend` of rows start..start+n ([heads, n, d]) over layer i of `kv` up to start+n into `out` [heads, n, d],
    one chunk of rows at a time, cut at multiples of GRID: a chunk's kernels and shapes depend only on where it
    begins and ends, so a prompt continued from cached KV at a multiple of GRID runs exactly the calls its whole
    prefill runs. One row (a decode step, or a prompt's last row alone in its chunk) is `attend_one` either way."""
    kernel = cpu_attention.usable(q, window)
    a, n = start, q.shape[1]
    if kernel is not None:  # every row the same whatever its call: no grid needed; the KV read where it lies
        kernel.paged(q, kv.table(i, start + n), kv.kv_heads, start, scale, out)
        return
    k, v = kv.layer(i, start + n)
    while a < start + n:
        e = start + n if n == 1 else min(start + n, (a // GRID + 1) * GRID)
        keys, values, rows = k[:, :e], v[:, :e], q[:, a - start : e - start]
        if a == 0 or e - a == 1 or window is not None or q.device.type != "cpu":
            part = attend(rows, keys, values, scale, window)
        else:  # the merged kernels at every size: one kernel for a chunk, whatever its length
            part = attend_after(rows[None], keys[None], values[None], scale)[0]
        out[:, a - start : e - start] = part
        a = e


def grid_of(model: PreTrainedModel) -> int:
    """The multiple that prompt chunks and prefix reads end at, so that a prompt's rows are the same however its
    prefill is split: 1 where the CPU kernel attends every layer (each row alike whatever its call), else GRID."""
    layers = decoder_of(model).layers
    q = torch.empty(layers[0].heads, 2, layers[0].head_dim, dtype=model.dtype, device=model.device)
    return 1 if all(cpu_attention.usable(q, layer.window) is not None for layer in layers) else GRID


def normed(norm: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    rows = cpu_attention.row_ops(h)
    return norm(h) if rows is None else rows.norm(norm, h)


def project(layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A decoder layer's q, k, v for hidden states h [n, hidden]: [n, heads, head_dim], RoPE applied. Norms and
    rotations by runtime/cpu_rows.c where it was built, for every row of every path alike (prefill, decode, blend)."""
    n, d, heads = len(h), layer.head_dim, layer.heads
    qkv = layer.qkv(normed(layer.input_norm, h)).view(n, -1, d)
    q, k, v = qkv.split((heads, layer.kv_heads, layer.kv_heads), 1)
    if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3
        return apply_rope(layer.q_norm(q), cos, sin), apply_rope(layer.k_norm(k), cos, sin), v
    rows = cpu_attention.row_ops(h)
    if rows is not None:
        qk = rows.rope(qkv[:, : heads + layer.kv_heads], cos, sin)
    else:
        qk = apply_rope(torch.cat((q, k), 1), cos, sin)  # one rotation for both
    return qk[:, :heads], qk[:, heads:], v


def finish_layer(layer: Layer, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer after attention: output projection, residuals, MLP."""
    h = h + layer.o(attn_out.reshape(len(h), -1))
    x, rows = normed(layer.post_norm, h), cpu_attention.row_ops(h)
    if rows is None or not layer.silu:
        return h + layer.mlp(x)
    return h + layer.down(rows.gated(layer.gate_up(x)))


def logits_of(model: PreTrainedModel, h: torch.Tensor) -> torch.Tensor:
    return decoder_of(model).head(normed(model.model.norm, h)).float()


def decode_layers(model: PreTrainedModel, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
    """A decode step of a batch, one new token per sequence ([sequences] ids, each at its sequence's end): the
    logits [sequences, vocab]. Device ops alone, nothing read back: what a CUDA graph captures."""
    inner = model.model
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h[None], batch.ends[None])
    batch.masks()
    for i, layer in enumerate(decoder_of(model).layers):
        q, k, v = project(layer, h, cos[0], sin[0])
        h = finish_layer(layer, h, batch.attend(i, q, k, v, layer.scale, layer.window))
    return logits_of(model, h)


@torch.inference_mode()
def forward(
    model: PreTrainedModel, runs: list[Run], every: bool = False, pad: bool = True, batches: Batches | None = None
) -> torch.Tensor:
    """Compute the runs' tokens through every layer, appending their K/V to each run's cache.

    Returns the logits of each run's last token, [len(runs), vocab]; with `every`, of every
    token, [tokens, vocab]. `pad`: to the row floor, prompt rows attended on the grid (False, or where no floor
    exists: rows that may depend on the step's other rows; a decode step's attention batched, `batches` keeping
    the batch from one such step to the next).
    """
    device = model.device
    lengths = [len(r.token_ids) for r in runs]
    floor = row_floor(model) if pad else 1
    # Where the kernels are not row-invariant at any size tried (runtime/invariance.py: AMX's bf16 GEMMs), neither
    # padding nor the grid makes a prompt's rows the same however it is split: neither is paid for.
    keep = pad and floor <= MOST
    floor = floor if keep else 1
    layers = decoder_of(model).layers
    if not keep and sum(lengths) == len(runs):  # unpadded, one token a run: a decode step, batched (runtime/decode.py)
        batches = batches or Batches()
        batch = batches.of([r.kv for r in runs], {x.window for x in layers}, layers[0].heads // layers[0].kv_heads)
        if batch is not None:
            tokens = [r.token_ids[0] for r in runs]
            logits = batches.step(model, batch, tokens, lambda ids: decode_layers(model, ids, batch))
            batch.commit()
            return logits
    for r, n in zip(runs, lengths):
        r.kv.reserve(r.start + n)

    extra = max(0, floor - sum(lengths))  # rows of nothing, so that every linear sees at least `floor`
    ids = torch.tensor([t for r in runs for t in r.token_ids] + [0] * extra, device=device)
    positions = torch.cat(
        [torch.arange(r.start, r.start + n, device=device) for r, n in zip(runs, lengths)]
        + [torch.zeros(extra, dtype=torch.long, device=device)]
    )
    inner = model.model
    h = inner.embed_tokens(ids)  # [N, hidden]
    cos, sin = inner.rotary_emb(h[None], positions[None])
    cos, sin = cos[0], sin[0]
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    last = torch.tensor(bounds[1:], device=device) - 1
    rows = torch.cat([last, last.new_zeros(max(0, floor - len(runs)))])  # the linears see at least `floor` rows
    for i, layer in enumerate(layers):
        q, k, v = project(layer, h, cos, sin)
        if i == len(layers) - 1 and not every and len(rows) < len(h) and alike(q, layer.window, keep):
            return logits_of(model, last_layer(i, layer, runs, h[rows], q[rows], k, v, bounds))[: len(runs)]
        out = torch.zeros_like(q) if extra else torch.empty_like(q)
        for r, a, b in zip(runs, bounds, bounds[1:]):
            r.kv.append(i, k[a:b].transpose(0, 1), v[a:b].transpose(0, 1))
            rows_q = q[a:b].transpose(0, 1)
            if keep:  # written in place: the kernel's rows go straight into the step's output
                attend_grid(rows_q, r.kv, i, r.start, layer.scale, layer.window, out[a:b].transpose(0, 1))
            else:
                out[a:b] = attend(rows_q, *r.kv.layer(i), layer.scale, layer.window).transpose(0, 1)
        h = finish_layer(layer, h, out)

    if every:
        return logits_of(model, h)[: bounds[-1]]
    return logits_of(model, h[rows])[: len(runs)]


def alike(q: torch.Tensor, window: int | None, keep: bool) -> bool:
    """Whether a row's attention is the same bit for bit whatever rows share its call (the CPU kernel's), and
    its linears the same among any `floor` rows (`keep`): then the last layer computes only the rows whose
    logits are asked, and every other row's there would be thrown away (its K and V are all the cache keeps)."""
    return keep and cpu_attention.usable(q, window) is not None


def last_layer(
    i: int,
    layer: Layer,
    runs: list[Run],
    h: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[int],
) -> torch.Tensor:
    """The model's last layer for the hidden states h and queries q of each run's last row (then rows of
    padding): every row's K and V appended, each last row attended, the rest of the layer over those rows."""
    out = torch.zeros_like(q)
    for j, (r, a, b) in enumerate(zip(runs, bounds, bounds[1:])):
        r.kv.append(i, k[a:b].transpose(0, 1), v[a:b].transpose(0, 1))
        row = q[j : j + 1].transpose(0, 1)
        attend_grid(row, r.kv, i, r.start + b - a - 1, layer.scale, layer.window, out[j : j + 1].transpose(0, 1))
    return finish_layer(layer, h, out)
