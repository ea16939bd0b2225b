"""StaticDecoder: fixed-shape bs=1 decode, replayed as CUDA graphs on CUDA (eager elsewhere).

A plain decode step has shapes that grow with the sequence (keys [1, H, L, D]), and at batch 1
on a GPU its ~300 small kernel launches, not the hardware, set the speed. The decoder owns
static K/V buffers of `max_len` slots per layer. For a request it copies the prefilled KV in,
then each step writes the new token's K/V at its position (index_copy_ with a device-side
position) and attends over the first `bucket` slots (a multiple of `bucket_tokens`) with a
mask that hides the slots after the position. Every step of a bucket therefore runs the same
kernels on the same tensors: on CUDA each bucket is captured once into a CUDA graph and
replayed, for every later request too. The logits stay on the device, so sampling runs
there; the only host sync per token is reading the sampled id to stream it out. When the
request ends, store() appends the decoded tokens' K/V to the request's own KVCache, so the
prefix cache and everything else see an ordinary cache.

The reference path (ModelRunner.forward) stays; tests hold the two to the same greedy tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtool.cache.kv import KVCache
from kvtool.errors import ContextWindowError
from kvtool.models.rope import apply_rope

MODES = ("auto", "on", "off")  # EngineConfig.fast_decode: auto = on for CUDA only


def fast_decode_enabled(mode: str, device: torch.device) -> bool:
    if mode not in MODES:
        from kvtool.errors import InvalidParameterError

        raise InvalidParameterError(f"fast_decode must be one of {', '.join(MODES)}; got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


class StaticDecoder:
    def __init__(self, runner, max_len: int, bucket_tokens: int = 256, graphs: bool | None = None):
        s = runner.spec
        if max_len < 1 or bucket_tokens < 1:
            raise ValueError(f"max_len and bucket_tokens must be >= 1 (got {max_len}, {bucket_tokens})")
        self.runner, self.max_len, self.bucket_tokens = runner, max_len, bucket_tokens
        dev, dtype = runner.device, runner.dtype
        shape = (1, s.num_kv_heads, max_len, s.head_dim)
        # zeros, not empty: masked slots must hold finite values (0 * NaN would leak through softmax)
        self.k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(s.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(s.num_layers)]
        self.cos, self.sin = runner.rope_cos_sin(torch.arange(max_len, device=dev))
        self.slots = torch.arange(max_len, device=dev)
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.use_graphs = dev.type == "cuda" if graphs is None else graphs
        if self.use_graphs and dev.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.length = 0  # tokens in the buffers for the current request
        self.start = 0  # tokens the request's cache held when load() copied it in
        self.busy = False

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._graphs)

    def fits(self, total_tokens: int) -> bool:
        return total_tokens <= self.max_len

    def load(self, cache: KVCache) -> None:
        """Take a request: copy its prefilled KV into the static buffers."""
        n = cache.offset
        if n >= self.max_len:
            raise ContextWindowError(f"the static decoder holds {self.max_len} tokens; this cache has {n}")
        for i, layer in enumerate(cache.layers):
            self.k[i][:, :, :n] = layer.keys
            self.v[i][:, :, :n] = layer.values
        self.length = self.start = n
        self.busy = True

    @torch.inference_mode()
    def step(self, token_id: int) -> torch.Tensor:
        """Run token_id at the next position; return its logits [1, V] (fp32, on the device)."""
        if self.length >= self.max_len:
            raise ContextWindowError(f"the static decoder is full ({self.max_len} tokens)")
        bucket = min(self.max_len, (self.length // self.bucket_tokens + 1) * self.bucket_tokens)
        self.token.fill_(token_id)
        self.pos.fill_(self.length)
        logits = self._replay(bucket) if self.use_graphs else self._forward(bucket)
        self.length += 1
        return logits

    def store(self, cache: KVCache) -> None:
        """Release the request: append the KV of the tokens decoded since load() to its cache."""
        try:
            if cache.offset != self.start:
                raise ValueError(f"the cache changed while decoding ({cache.offset} != {self.start} tokens)")
            for i, layer in enumerate(cache.layers):
                layer.append(self.k[i][:, :, self.start : self.length], self.v[i][:, :, self.start : self.length])
        finally:
            self.busy = False

    def _forward(self, bucket: int) -> torch.Tensor:
        """One token through the model with static shapes (reads self.token / self.pos)."""
        runner, m = self.runner, self.runner.model
        x = m.embed_tokens(self.token)[None]  # [1, 1, hidden]
        cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)
        mask = (self.slots[:bucket] <= self.pos)[None, None, None]  # [1, 1, 1, bucket]
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, v)
            out = F.scaled_dot_product_attention(q, self.k[i][:, :, :bucket], self.v[i][:, :, :bucket],
                                                 attn_mask=mask, enable_gqa=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return F.linear(m.norm(x[0]), runner.output_weight).float()

    def _replay(self, bucket: int) -> torch.Tensor:
        if bucket not in self._graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up outside the graph (allocator, cuBLAS handles)
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(bucket)
            self._pool = self._pool or graph.pool()
            self._graphs[bucket] = (graph, out)
        graph, out = self._graphs[bucket]
        graph.replay()
        return out
