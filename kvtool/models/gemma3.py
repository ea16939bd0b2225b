"""Gemma 3's decoder (text only) on the layers of kvtool.models.layers.

What differs from Llama/Qwen: RMSNorm scales by (1 + weight), computed in fp32; the embedding is
multiplied by sqrt(hidden); q and k are RMS-normed per head; attention scales by
1/sqrt(query_pre_attn_scalar); sliding-window layers (each query sees itself and the window - 1 slots
before it) interleave with global layers, and the two kinds rotate with their own RoPE base;
attention and MLP outputs are normed before their residual adds; the MLP gates with tanh-GELU; the
output head is the embedding. Names match HF's Gemma3ForCausalLM, so weights load by name.

The KV cache keeps every token on every layer (slot = position): a sliding layer reads only its
window of it, so the prefix cache, skill relocation and edits handle both kinds of layer alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.kernels.linear import linear
from kvtool.models.layers import MLP, Attention, DecoderLayer
from kvtool.models.rope import apply_rope
from kvtool.models.spec import SLIDING, ModelSpec

GLOBAL_ROPE, LOCAL_ROPE = 0, 1  # index into the (global, local) cos/sin pairs the runner builds


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(hidden), the scale rounded to the weights' dtype as HF does."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__(vocab, hidden)
        self.scale = hidden**0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


class GemmaAttention(Attention):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec)
        self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.sliding = spec.layer_types[layer] == SLIDING
        self.window = spec.sliding_window if self.sliding else None
        self.scale = spec.query_pre_attn_scalar ** -0.5
        self.rope_index = LOCAL_ROPE if self.sliding else GLOBAL_ROPE

    def rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return apply_rope(x, cos[self.rope_index], sin[self.rope_index])


class GemmaMLP(MLP):
    def forward(self, x):
        gate, up = (self.gate_proj(x), self.up_proj(x)) if self._wgu is None else linear(x, self._wgu).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, layer: int):
        nn.Module.__init__(self)
        eps, hidden = spec.rms_norm_eps, spec.hidden_size
        self.self_attn = GemmaAttention(spec, layer)
        self.mlp = GemmaMLP(spec)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaBackbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = ScaledEmbedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)


def is_gemma(spec: ModelSpec) -> bool:
    return spec.model_type == "gemma3_text"
