"""Static decoders: fixed-shape decode steps, replayed as CUDA graphs on CUDA (eager elsewhere).

A plain decode step has shapes that grow with the sequence (keys [1, H, L, D]), and at batch 1
on a GPU its ~300 small kernel launches, not the hardware, set the speed. The decoder owns
static K/V buffers of `max_len` slots per layer. For a request it copies the prefilled KV in,
then each step writes the new token's K/V at its position (index_put_ at a device-side
position) and attends over the first `bucket` slots (a multiple of `bucket_tokens`) with a
mask that hides the slots after the position. Every step of a bucket therefore runs the same
kernels on the same tensors: on CUDA each bucket is captured once into a CUDA graph and
replayed, for every later request too. The logits stay on the device, so sampling runs
there; the only host sync per token is reading the sampled id to stream it out. When the
request ends, store() appends the decoded tokens' K/V to the request's own KVCache, so the
prefix cache and everything else see an ordinary cache.

BatchedStaticDecoder does this for many sequences at once (one buffer row per sequence, the
decode steps of continuous batching); StaticDecoder is its one-slot form for Engine.generate.
The reference path (ModelRunner.forward) stays; tests hold them to the same tokens.
"""

from __future__ import annotations

import torch

from kvtool.cache.kv import KVCache
from kvtool.engine.decode_step import DecodeStep
from kvtool.errors import ContextWindowError, InvalidParameterError

MODES = ("auto", "on", "off")  # EngineConfig.fast_decode: auto = on for CUDA only


def fast_decode_enabled(mode: str, device: torch.device, spec=None) -> bool:
    """Whether the static decoders run; never for a model with sliding-window layers (spec.layer_types), whose
    layers they do not implement: its steps take the reference forward."""
    if mode not in MODES:
        raise InvalidParameterError(f"fast_decode must be one of {', '.join(MODES)}; got {mode!r}")
    if spec is not None and spec.layer_types:
        return False
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def padded_length(tokens: int, max_len: int) -> int:
    """The static prefill length for `tokens`: a power of two (at least 16) up to 512, then a multiple of 512,
    so few shapes cover every length and long prompts waste at most 511 padded tokens, not up to half."""
    padded = max(16, 1 << (tokens - 1).bit_length()) if tokens <= 512 else -(-tokens // 512) * 512
    return min(max_len, padded)


class StaticDecoder:
    """The engine's bs=1 fast path: one BatchedStaticDecoder slot, kept across requests (graphs included)."""

    def __init__(self, runner, max_len: int, bucket_tokens: int = 256, graphs: bool | None = None):
        self.batched = BatchedStaticDecoder(runner, 1, max_len, bucket_tokens, graphs)
        self.max_len, self.use_graphs = max_len, self.batched.use_graphs

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(key[1] for key in self.batched._graphs if key[0] != "extend")

    @property
    def busy(self) -> bool:
        return not self.batched.free

    @property
    def length(self) -> int:
        return self.batched.length[0]

    def fits(self, total_tokens: int) -> bool:
        return total_tokens <= self.max_len

    def load(self, cache: KVCache) -> None:
        """Take a request: copy its prefilled KV into the static buffers (ContextWindowError if it does not fit)."""
        self.batched.load(cache)

    def extend(self, ids: list[int]) -> torch.Tensor:
        """Prefill ids (the prompt, or its part after a prefix hit) at the next positions; logits [1, V] of the last."""
        return self.batched.extend(0, ids)

    def step(self, token_id: int) -> torch.Tensor:
        """Run token_id at the next position; return its logits [1, V] (fp32, on the device)."""
        return self.batched.step({0: token_id})[0]

    def release(self) -> None:
        """Drop the request without handing its KV back (a benchmark's throwaway prompt)."""
        if self.busy:
            self.batched.release(0)

    def store(self, cache: KVCache) -> None:
        """Release the request: append the KV of the tokens decoded since load() to its cache."""
        if cache.offset != self.batched.start[0]:
            self.release()
            raise ValueError(f"the cache changed while decoding ({cache.offset} != {self.batched.start[0]} tokens)")
        self.batched.store(0, cache)


def prefill_logits(runner, cache: KVCache, ids: list[int], chunk: int,
                   decoder: StaticDecoder | None = None) -> torch.Tensor:
    """Logits [1, V] of the last of ids run after what `cache` holds: through `decoder` (its rows take the
    cache's KV, then ids) when given, else the reference prefill into the cache itself."""
    if decoder is None:
        return runner.prefill(ids, cache, chunk=chunk)
    decoder.load(cache)
    return decoder.extend(ids)


def static_decoder_for(runner, tokens: int, mode: str = "auto") -> StaticDecoder | None:
    """A StaticDecoder of `tokens` slots where fast decode `mode` is on for the runner's device, else None."""
    return StaticDecoder(runner, tokens) if fast_decode_enabled(mode, runner.device, runner.spec) else None


class BatchedStaticDecoder:
    """StaticDecoder for many sequences at once: the decode steps of continuous batching.

    Each running request owns one row ("slot") of static K/V buffers [slots, H_kv, max_len, D]. A step
    runs the first `rows` slots (a power of two covering every occupied slot), each at its own
    position (kvtool.engine.decode_step): per-row RoPE, K/V written in place, one attention call over
    a `bucket`-slot window with a per-row mask. Shapes depend only on (rows, bucket), so on CUDA each
    pair is captured once as a CUDA graph. Rows not stepped this time (free, or held by a request
    that is not decoding now) compute on a dummy token and write it to a scratch position (index
    max_len) that no window covers, so their K/V stays intact."""

    def __init__(self, runner, slots: int, max_len: int, bucket_tokens: int = 256, graphs: bool | None = None):
        s = runner.spec
        if slots < 1 or max_len < 1 or bucket_tokens < 1:
            raise ValueError(f"slots, max_len and bucket_tokens must be >= 1 (got {slots}, {max_len}, {bucket_tokens})")
        self.runner, self.slots, self.max_len, self.bucket_tokens = runner, slots, max_len, bucket_tokens
        dev, dtype = runner.device, runner.dtype
        shape = (slots, s.num_kv_heads, max_len + 1, s.head_dim)  # + the scratch position
        self.k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(s.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(s.num_layers)]
        self.step_fn = DecodeStep(runner)
        self.cos, sin = runner.rope_cos_sin(torch.arange(max_len + 1, device=dev))
        self.sin_signed = self.step_fn.signed_sin(sin)
        self.window = torch.arange(max_len + 1, device=dev)
        self.rows = torch.arange(slots, device=dev)
        self.token = torch.zeros(slots, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.ext_token = torch.zeros(max_len, dtype=torch.long, device=dev)  # extend(): tokens, positions,
        self.ext_pos = torch.zeros(max_len, dtype=torch.long, device=dev)  # and the index of the last real one
        self.ext_last = torch.zeros(1, dtype=torch.long, device=dev)
        self.use_graphs = dev.type == "cuda" if graphs is None else graphs
        if self.use_graphs and dev.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (rows, bucket) / extend keys
        self._pool = None
        self.length = [0] * slots  # tokens held per slot
        self.start = [0] * slots  # tokens the request's cache held at load()
        self.free = list(range(slots))

    def fits(self, total_tokens: int) -> bool:
        return total_tokens <= self.max_len and bool(self.free)

    def load(self, cache: KVCache) -> int:
        """Take a request: copy its KV into the lowest free slot; return the slot."""
        n = cache.offset
        if n >= self.max_len or not self.free:
            raise ContextWindowError(f"the static decoder holds {self.max_len} tokens a slot"
                                     f"{'' if self.free else ', and none is free'}; this cache has {n}")
        slot = min(self.free)
        self.free.remove(slot)
        for i, layer in enumerate(cache.layers):
            self.k[i][slot, :, :n] = layer.keys[0]
            self.v[i][slot, :, :n] = layer.values[0]
        self.length[slot] = self.start[slot] = n
        return slot

    def release(self, slot: int) -> None:
        """Free a slot without handing its KV back."""
        self.free.append(slot)

    def store(self, slot: int, cache: KVCache) -> None:
        """Release a slot: append the KV decoded since load() to the request's cache."""
        try:
            a, b = self.start[slot], self.length[slot]
            for i, layer in enumerate(cache.layers):
                layer.append(self.k[i][slot : slot + 1, :, a:b], self.v[i][slot : slot + 1, :, a:b])
        finally:
            self.release(slot)

    def tokens(self, slot: int) -> int:
        return self.length[slot]

    def step(self, tokens: dict[int, int]) -> dict[int, torch.Tensor]:
        """Run one token per slot ({slot: token id}); return {slot: logits [1, V]} (fp32, on the device)."""
        rows = self.step_rows(tokens)
        return {s: rows[s : s + 1] for s in tokens}

    @torch.inference_mode()
    def step_rows(self, tokens: dict[int, int]) -> torch.Tensor:
        """step() returning the logits as one tensor [rows, V], row s for slot s (rows not stepped hold
        garbage), so a caller sampling many slots indexes them in one op rather than slicing each."""
        if any(self.length[s] >= self.max_len for s in tokens):
            raise ContextWindowError(f"a slot of the batched static decoder is full ({self.max_len} tokens)")
        used = max(tokens) + 1
        rows = min(self.slots, 1 << (used - 1).bit_length())
        longest = max(self.length[s] for s in tokens)
        bucket = min(self.max_len, (longest // self.bucket_tokens + 1) * self.bucket_tokens)
        tok, pos = [0] * rows, [self.max_len] * rows  # rows not stepped write to the scratch position
        for s, t in tokens.items():
            tok[s], pos[s] = t, self.length[s]
        self.token[:rows].copy_(torch.tensor(tok), non_blocking=True)
        self.pos[:rows].copy_(torch.tensor(pos), non_blocking=True)
        logits = (self._replay((rows, bucket), lambda: self._forward(rows, bucket)) if self.use_graphs
                  else self._forward(rows, bucket))
        for s in tokens:
            self.length[s] += 1
        return logits

    @torch.inference_mode()
    def extend(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Run a slot's next len(ids) tokens (a prompt, or its part after a prefix hit); logits [1, V] of the last.

        The tokens are padded (padded_length) so lengths share shapes (and CUDA graphs).
        From an empty slot: positions 0..T-1 and one causal attention call (padding sits after the real
        tokens, so no real token sees it). Otherwise the padding writes to the scratch position and
        attention runs over a bucket window with a mask."""
        t, start = len(ids), self.length[slot]
        if t < 1:
            raise ValueError("extend() needs at least one token")
        if start + t > self.max_len:
            raise ContextWindowError(f"a slot of the static decoder holds {self.max_len} tokens; "
                                     f"{start} + {t} do not fit")
        padded = padded_length(t, self.max_len)
        causal = start == 0
        if causal:
            window, pos = padded, list(range(padded))
        else:
            window = min(self.max_len, -(-(start + t) // self.bucket_tokens) * self.bucket_tokens)
            pos = list(range(start, start + t)) + [self.max_len] * (padded - t)
        self.ext_token[:padded].copy_(torch.tensor(list(ids) + [0] * (padded - t)), non_blocking=True)
        self.ext_pos[:padded].copy_(torch.tensor(pos), non_blocking=True)
        self.ext_last.fill_(t - 1)

        def run():
            return self.step_fn.extend(self.ext_token[:padded], self.ext_pos[:padded], self.ext_last, slot, self.k,
                                       self.v, window, causal, self.cos, self.sin_signed, self.window)

        logits = self._replay(("extend", slot, padded, window, causal), run) if self.use_graphs else run()
        self.length[slot] = start + t
        return logits

    def _forward(self, rows: int, bucket: int) -> torch.Tensor:
        return self.step_fn(self.token[:rows], self.pos[:rows], self.rows[:rows], self.k, self.v, bucket,
                            self.cos, self.sin_signed, self.window)

    def _replay(self, key, fn) -> torch.Tensor:
        """Run fn through the CUDA graph captured for `key` (capturing it on first use)."""
        if key not in self._graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = fn()
            self._pool = self._pool or graph.pool()
            self._graphs[key] = (graph, out)
        graph, out = self._graphs[key]
        graph.replay()
        return out
