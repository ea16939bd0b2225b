"""Attention for a chunk of new tokens after cached ones, on the CPU, with no mask (kvtool.models.cpu_prefill).

ATen's flash kernel takes its causal path only for a square block (queries and keys from the same start); a
chunk after cached tokens needs a [t, cached + t] mask, which the kernel reads beside every score, and SDPA's
enable_gqa repeats K and V once per query head. Here the cached part is one unmasked pass per KV head whose rows
are its whole group of query heads, the chunk's own part the causal kernel, and the two outputs are merged by
their log-sum-exps (benchmarks/chunk_attention.py times it against the masked form).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int) -> torch.Tensor:
    """Causal attention [t, hq, d] of a chunk's queries q [t, hq, d] whose K/V sit in keys/values [1, hkv, cap, d]
    at slot..slot+t, after `slot` cached tokens. After cached tokens, with no mask: the cached part in one pass per
    KV head whose rows are its whole group of query heads (g t rows over keys read once, no K/V repeated per query
    head), the chunk's own part through the causal kernel, the two merged by their log-sum-exps."""
    t, hq, d = q.shape
    if slot == 0 or t == 1:  # the kernel's own causal path, or one token that sees every slot
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[:, :, : slot + t], values[:, :, : slot + t],
                                              is_causal=t > 1, enable_gqa=True)[0].transpose(0, 1)
    hkv = keys.shape[1]
    g = hq // hkv
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    grouped = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
    old, old_lse = flash(grouped, keys[:, :, :slot], values[:, :, :slot])
    old, old_lse = old.view(hkv, g, t, d).permute(2, 0, 1, 3), old_lse.view(hkv, g, t).permute(2, 0, 1)
    own_k = keys[:, :, slot : slot + t].repeat_interleave(g, 1)
    own_v = values[:, :, slot : slot + t].repeat_interleave(g, 1)
    new, new_lse = flash(q.transpose(0, 1).unsqueeze(0), own_k, own_v, is_causal=True)
    new, new_lse = new[0].transpose(0, 1).view(t, hkv, g, d), new_lse[0].transpose(0, 1).view(t, hkv, g)
    # softmax over both parts = each part's output weighted by its share of the whole exp-sum
    return torch.lerp(new, old, torch.sigmoid(old_lse - new_lse).unsqueeze(-1)).reshape(t, hq, d)
