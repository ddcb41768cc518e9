"""Moving cached keys to new positions.

Keys are cached post-RoPE. A rotation by position p+d equals a rotation by d applied to the
rotation by p, so a document's keys computed at 0..T-1 can be placed at offset..offset+T-1
without recomputing them. This holds only where RoPE is a pure rotation by the position
(times fixed frequencies): the default, linear and llama3 rope types.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from kvgate.runtime.kernels import rope_shift

SHIFTABLE = {"default", "linear", "llama3"}


def rope_type(model: PreTrainedModel) -> str:
    # transformers 5 (as pinned) reads every spelling of a config's RoPE (rope_scaling, "type") into rope_parameters
    return (getattr(model.config, "rope_parameters", None) or {}).get("rope_type", "default")


def can_shift(model: PreTrainedModel) -> bool:
    return rope_type(model) in SHIFTABLE


def angles(model: PreTrainedModel, delta: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [head_dim] (fp32) of a shift by `delta` positions."""
    cos, sin = token_angles(model, torch.tensor([delta]), device)
    return cos[0], sin[0]


def token_angles(
    model: PreTrainedModel, deltas: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] (fp32) of a shift of each token by its own `deltas` [T] positions (0: none)."""
    if not can_shift(model):
        raise ValueError(f"rope type {rope_type(model)!r} does not allow shifting cached keys")
    probe = torch.empty(0, device=device)  # rotary_emb reads only its device and dtype (fp32)
    cos, sin = model.model.rotary_emb(probe, deltas.to(device)[None])  # [1, T, head_dim]
    return cos[0], sin[0]


def shift(model: PreTrainedModel, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """keys: [kv_heads, T, head_dim] cached at positions p; returns them as if cached at p + delta."""
    return rope_shift(keys, *angles(model, delta, keys.device))
