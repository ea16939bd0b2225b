"""The static decoders' step: the runner's layer math for one token per row, in few kernels.

At batch 1 on a GPU the number of kernels, not the bytes read, sets the decode speed, and the
reference layer (kvtool.models.runner) spends many on casts and small elementwise ops. Here,
per layer: RMSNorm with its weight in one op; one QKV matmul; Qwen3's q and k norms as one
normalisation over all q and k heads times a per-head weight table; RoPE for q and k at once
(x * cos + roll(x, D/2) * sin_signed, the rotate_half identity); the new K/V written in place;
attention as one SDPA call whose "query length" is the GQA group, so K/V are never repeated and
the additive mask (built once per step) hides the window's slots after each row's position.
About 18 kernels a layer where the reference launches ~45 in bf16. The math is the reference's;
only rounding order differs (fp32 agrees to ~1e-6; tests hold both paths to the same tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DecodeStep:
    def __init__(self, runner):
        s = runner.spec
        self.runner, self.model = runner, runner.model
        self.hq, self.hkv, self.d = s.num_heads, s.num_kv_heads, s.head_dim
        self.group = self.hq // self.hkv
        half = self.d // 2
        self.sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(runner.device, runner.dtype)
        self.qk_weight = None
        if s.qk_norm:  # [Hq + Hkv, D]: q_norm's weight for every q head, then k_norm's for every kv head
            self.qk_weight = [torch.cat([layer.self_attn.q_norm.weight.expand(self.hq, self.d),
                                         layer.self_attn.k_norm.weight.expand(self.hkv, self.d)]).detach()
                              for layer in self.model.layers]

    def signed_sin(self, sin: torch.Tensor) -> torch.Tensor:
        """The sin table with its first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin."""
        return sin * self.sign

    @staticmethod
    def mask(window: torch.Tensor, pos: torch.Tensor, dtype) -> torch.Tensor:
        """Additive mask [rows, 1, 1, bucket]: 0 at slots <= the row's position, -inf after."""
        bias = torch.zeros(pos.shape[0], 1, 1, window.shape[0], dtype=dtype, device=pos.device)
        return bias.masked_fill_((window[None] > pos[:, None])[:, None, None], float("-inf"))

    def __call__(self, tokens, pos, rows, keys, values, bucket: int, cos, sin_signed, window) -> torch.Tensor:
        """tokens, pos, rows [n]; keys/values per layer [slots, Hkv, max_len + 1, D]; cos, sin_signed
        [max_len + 1, D]; window = arange(max_len + 1). Returns logits [n, V] (fp32)."""
        m, n = self.model, tokens.shape[0]
        hq, hkv, d = self.hq, self.hkv, self.d
        x = m.embed_tokens(tokens)  # [n, hidden]
        c, s = cos[pos][:, None], sin_signed[pos][:, None]  # [n, 1, D]
        bias = self.mask(window[:bucket], pos, x.dtype)
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = F.rms_norm(x, x.shape[-1:], layer.input_layernorm.weight, layer.input_layernorm.eps)
            if attn._wqkv is not None:
                qkv = F.linear(h, attn._wqkv, attn._bqkv).view(n, hq + 2 * hkv, d)
            else:
                qkv = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], -1).view(n, hq + 2 * hkv, d)
            qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]
            if self.qk_weight is not None:
                qk = F.rms_norm(qk, (d,), eps=attn.q_norm.eps) * self.qk_weight[i]
            qk = torch.addcmul(qk * c, qk.roll(d // 2, -1), s)
            keys[i][rows, :, pos] = qk[:, hq:]
            values[i][rows, :, pos] = v
            q = qk[:, :hq].reshape(n, hkv, self.group, d)  # a kv head's q heads as its query rows
            out = F.scaled_dot_product_attention(q, keys[i][:n, :, :bucket], values[i][:n, :, :bucket],
                                                 attn_mask=bias)
            x = x + attn.o_proj(out.reshape(n, hq * d))
            h = F.rms_norm(x, x.shape[-1:], layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            x = x + mlp(h)
        h = F.rms_norm(x, x.shape[-1:], m.norm.weight, m.norm.eps)
        return F.linear(h, self.runner.output_weight).float()
