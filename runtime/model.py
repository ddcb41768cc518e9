"""The layer loop: one forward step over a ragged batch of sequences.

Each sequence contributes a run of new tokens (a prompt chunk or one decode token).
Projections and MLPs run once over all tokens of the step; attention runs per sequence
over that sequence's own KV, so sequences of any length share a step without padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from runtime.kv import KVCache


@dataclass
class Run:
    kv: KVCache
    token_ids: list[int]
    start: int  # position of the first token; equals len(kv) before the step


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [heads, n, d], the last n positions of k, v: [kv_heads, T, d]. Causal."""
    # A batch dimension matters: on CPU, 3-D inputs fall back to SDPA's slow math kernel.
    q, k, v = q[None], k[None], v[None]
    n, total = q.shape[2], k.shape[2]
    if n == total:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    elif n == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(total - n, total, device=q.device)[:, None]
        mask = torch.arange(total, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0]


@torch.inference_mode()
def forward(model: PreTrainedModel, runs: list[Run]) -> torch.Tensor:
    """Compute the runs' tokens through every layer, appending their K/V to each run's cache.

    Returns the logits of each run's last token, [len(runs), vocab].
    """
    device = model.device
    lengths = [len(r.token_ids) for r in runs]
    ids = torch.tensor([t for r in runs for t in r.token_ids], device=device)
    positions = torch.cat([torch.arange(r.start, r.start + n, device=device) for r, n in zip(runs, lengths)])
    for r, n in zip(runs, lengths):
        r.kv.reserve(r.start + n)

    inner = model.model
    h = inner.embed_tokens(ids)  # [N, hidden]
    cos, sin = inner.rotary_emb(h[None], positions[None])
    cos, sin = cos[0], sin[0]
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()

    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(len(ids), -1, attn.head_dim)
        k = attn.k_proj(x).view(len(ids), -1, attn.head_dim)
        v = attn.v_proj(x).view(len(ids), -1, attn.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = torch.empty_like(q)
        for r, a, b in zip(runs, bounds, bounds[1:]):
            keys, values = r.kv.append(i, k[a:b].transpose(0, 1), v[a:b].transpose(0, 1))
            out[a:b] = attend(q[a:b].transpose(0, 1), keys, values, attn.scaling).transpose(0, 1)
        h = h + attn.o_proj(out.reshape(len(ids), -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))

    last = torch.tensor(bounds[1:], device=device) - 1
    return model.lm_head(inner.norm(h[last])).float()
