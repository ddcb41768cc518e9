"""The model's weights as the engine computes with them, built once per model from the transformers modules.

Per decoder layer, q, k and v are one linear and gate and up another (fewer, larger GEMMs: a decode step is
a few hundred small calls, each paying its own dispatch). On CPU each weight is laid out once in oneDNN's
blocked format, which `torch.nn.functional.linear` would otherwise reorder at every call: measured on a 2-core
AVX512-BF16 CPU for the default model's 211 linears of a decode step, 25.8 ms a step with F.linear, 17.5 ms
fused and prepacked (bf16, one row); float32 52 against 31 ms. Rows stay what they are among any others
(runtime/invariance.py measures it for these linears). The transformers model stays as it was: the tests'
reference, and its weights are what a checkpoint's fingerprint reads.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.activations import SiLUActivation


def onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this device's linears of `dtype` go through oneDNN with prepacked weights: CPU fp32 always, bf16
    where the CPU computes it (emulated elsewhere, where oneDNN's bf16 path is no faster than torch's own)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x W^T + b over the rows of x [n, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.packed = onednn(weight.dtype, weight.device)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def joined(cls, *linears: torch.nn.Linear) -> Linear:
        """One linear computing the outputs of several over the same input, side by side."""
        weight = torch.cat([linear.weight for linear in linears])
        biases = [linear.bias for linear in linears]
        if all(b is None for b in biases):
            return cls(weight)
        bias = torch.cat([weight.new_zeros(m.out_features) if b is None else b for b, m in zip(biases, linears)])
        return cls(weight, bias)


@dataclass(frozen=True)
class Layer:
    input_norm: torch.nn.Module
    qkv: Linear  # q, k, v side by side: [n, (heads + 2 * kv_heads) * head_dim]
    q_norm: torch.nn.Module | None  # Qwen3's per-head norms, before RoPE
    k_norm: torch.nn.Module | None
    o: Linear
    post_norm: torch.nn.Module
    gate_up: Linear  # gate and up side by side
    down: Linear
    act: torch.nn.Module
    silu: bool  # act is SiLU: the gated product may be computed in one pass
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int | None  # a sliding attention window; None: full attention

    @classmethod
    def of(cls, layer: torch.nn.Module) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        head_dim = attn.head_dim
        return cls(
            input_norm=layer.input_layernorm,
            qkv=Linear.joined(attn.q_proj, attn.k_proj, attn.v_proj),
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
            o=Linear(attn.o_proj.weight, attn.o_proj.bias),
            post_norm=layer.post_attention_layernorm,
            gate_up=Linear.joined(mlp.gate_proj, mlp.up_proj),
            down=Linear(mlp.down_proj.weight, mlp.down_proj.bias),
            act=mlp.act_fn,
            silu=isinstance(mlp.act_fn, (torch.nn.SiLU, SiLUActivation)),
            heads=attn.q_proj.out_features // head_dim,
            kv_heads=attn.k_proj.out_features // head_dim,
            head_dim=head_dim,
            scale=attn.scaling,
            window=window_of(layer),
        )

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def window_of(layer: torch.nn.Module) -> int | None:
    """A layer's sliding attention window, or None for full attention."""
    attn = layer.self_attn
    # Qwen2/3 set it per layer (None on their full-attention layers); Mistral's config holds one for all.
    return attn.sliding_window if hasattr(attn, "sliding_window") else getattr(attn.config, "sliding_window", None)


@dataclass(frozen=True)
class Decoder:
    layers: tuple[Layer, ...]
    head: Linear  # the LM head

    @classmethod
    def of(cls, model: PreTrainedModel) -> Decoder:
        with torch.no_grad():
            layers = tuple(Layer.of(layer) for layer in model.model.layers)
            head = model.lm_head
            return cls(layers, Linear(head.weight, getattr(head, "bias", None)))


_decoders: weakref.WeakKeyDictionary[PreTrainedModel, Decoder] = weakref.WeakKeyDictionary()


def decoder_of(model: PreTrainedModel) -> Decoder:
    """The model's Decoder, built at its first use (seconds for a large model) and kept while the model lives."""
    decoder = _decoders.get(model)
    if decoder is None:
        decoder = _decoders[model] = Decoder.of(model)
    return decoder
