"""Per-layer KV containers with one small interface.

LayerKV keeps keys (post-RoPE) and values in buffers shaped [1, H_kv, capacity, D] that grow by doubling, so a
decode step appends in place instead of re-concatenating. Slot i of every layer holds the token at sequence index i.

A paged cache (KVCache.paged) holds every token in immutable [2, L, H, B, D] blocks, by reference (its first `base`
tokens; the prefix cache's on a hit), and one more block, its page, whose layer parts are the buffers (slot i: token
base + i); reserve() moves a full page to the blocks and takes a fresh one, so the prefix cache keeps a request's
full blocks without copying them. The C++ CPU ops read the blocks in place and write a prefill's K/V into them
(kvtool.models.cpu_step, cpu_prefill), as KVCache.append_all, KVCache.truncate and LayerKV.write do (skill
composition and edits); a block the cache borrowed (a prefix hit's, a fork's) is copied before such a write (copy on
write). Fresh blocks come from `take` (e.g. an Engine's BlockPool, which raises PoolExhausted when it has none left:
the scheduler reserves a step's blocks before its forward). `keys` and `values` join both parts in a copy;
LayerKV.append (the reference forward) first copies the blocks into the buffers (materialize()).
"""

from __future__ import annotations

import torch

from kvtool.errors import CacheFormatError

MIN_CAPACITY = 256


class LayerKV:
    blocks: list[torch.Tensor] | tuple = ()  # [2, L, H, B, D] blocks holding tokens 0..base-1 (KVCache.paged)
    layer = base = shared = 0  # this layer's index in them, the tokens they hold, those the prefix cache holds
    page = take = None  # a paged cache's block whose layer parts are the buffers, and its source of fresh ones
    borrowed: set[int] | frozenset = frozenset()  # indices of blocks others hold too: copied before a write
    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 capacity: int = MIN_CAPACITY):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self._k = torch.empty(1, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self._v = torch.empty_like(self._k)
        self.offset = 0  # tokens stored

    @property
    def capacity(self) -> int:
        return self.base + self._k.shape[2]

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, H, end - start, D] of tokens [start, end): views of the buffers, or one copy where
        the span reaches into shared blocks."""
        own = slice(max(start - self.base, 0), max(end - self.base, 0))
        if start >= self.base or end <= start:  # (a page's views must not outlive it: copies)
            k, v = self._k[:, :, own], self._v[:, :, own]
            return (k, v) if self.page is None else (k.clone(), v.clone())
        size, stop = self.blocks[0].shape[3], min(end, self.base)
        parts = [blk[:, self.layer] for blk in self.blocks[start // size : (stop - 1) // size + 1]]  # [2, H, B, D]
        parts[-1] = parts[-1][:, :, : stop - (stop - 1) // size * size]
        parts[0] = parts[0][:, :, start % size :]
        return (torch.cat([p[0] for p in parts] + [self._k[0, :, own]], 1)[None],
                torch.cat([p[1] for p in parts] + [self._v[0, :, own]], 1)[None])

    @property
    def keys(self) -> torch.Tensor:
        return self.span(0, self.offset)[0]

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers [1, H, capacity - base, D]: slot i holds token base + i, and slots
        from `offset - base` on are free."""
        return self._k, self._v

    @property
    def values(self) -> torch.Tensor:
        return self.span(0, self.offset)[1]

    def fresh(self) -> torch.Tensor:
        """A new block like a paged cache's page, from its source (e.g. its pool)."""
        with torch.inference_mode(False):  # made inside a forward, it stays writable outside one
            return self.take() if self.take else torch.empty_like(self.page)

    def write(self, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite the KV of the tokens at positions `at` [n] (each below capacity) with k, v [1, H, n, D] in place:
        a paged cache's through its blocks, a borrowed block first replaced by a copy of its own for every layer."""
        k, v = k.to(self._k.dtype), v.to(self._k.dtype)  # (e.g. fp32 KV into an engine's bf16 blocks: rounded)
        if not self.blocks:  # every token in the buffers
            self._k[:, :, at - self.base], self._v[:, :, at - self.base] = k, v
            return
        size = self.blocks[0].shape[3]
        which = at // size
        for j in which.unique().tolist():
            pick = (which == j).nonzero()[:, 0]
            if j * size >= self.base:  # the buffers (the page)
                self._k[:, :, at[pick] - self.base], self._v[:, :, at[pick] - self.base] = k[:, :, pick], v[:, :, pick]
                continue
            part = self.own(j)[:, self.layer]  # [2, H, B, D]
            part[0][:, at[pick] - j * size], part[1][:, at[pick] - j * size] = k[0][:, pick], v[0][:, pick]

    def own(self, j: int) -> torch.Tensor:
        """Block j to write into: a borrowed one is first replaced by a copy of its own (every layer's)."""
        if j in self.borrowed:
            self.blocks[j] = self.fresh().copy_(self.blocks[j])
            self.borrowed.discard(j)
        return self.blocks[j]

    def materialize(self) -> None:
        """Copy the blocks' tokens into buffers of its own (a paged cache's page's too), which then hold every token
        from slot 0."""
        if self.base or self.page is not None:
            (k, v), capacity = self.span(0, self.offset), self.capacity
            self.base, self.blocks, self.offset, self.shared, self.page, self.take = 0, (), 0, 0, None, None
            self.borrowed = frozenset()
            self._k, self._v = self._k[:, :, :0], self._v[:, :, :0]
            self.reserve(capacity)  # the room it had: a prefill that follows need not grow it
            self.append(k, v)

    def reserve(self, total: int) -> None:
        if total <= self.capacity:
            return
        new_cap = max(total, 2 * self.capacity) - self.base
        with torch.inference_mode(False):  # grown inside a forward, it stays writable outside one
            k = torch.empty(1, self.num_kv_heads, new_cap, self.head_dim, dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
        n = self.offset - self.base
        k[:, :, :n] = self._k[:, :, :n]
        v[:, :, :n] = self._v[:, :, :n]
        self._k, self._v = k, v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [1, H, T, D]; return views of all keys and values so far."""
        self.materialize()
        n = k.shape[2]
        self.reserve(self.offset + n)
        self._k[:, :, self.offset : self.offset + n] = k
        self._v[:, :, self.offset : self.offset + n] = v
        self.offset += n
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot truncate a cache of {self.offset} tokens to {length}")
        if length < self.base:
            self.materialize()
        self.offset = length

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tokens (not of the reserved capacity)."""
        return 2 * self.offset * self.num_kv_heads * self.head_dim * self._k.element_size()

    def state(self) -> dict[str, torch.Tensor]:
        return {"keys": self.keys.clone(), "values": self.values.clone()}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "LayerKV":
        try:
            k, v = state["keys"], state["values"]
        except KeyError as exc:
            raise CacheFormatError(f"layer state is missing {exc.args[0]!r}") from None
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != 1:
            raise CacheFormatError(f"layer state keys {tuple(k.shape)} / values {tuple(v.shape)} are not [1, H, T, D]")
        layer = cls(k.shape[1], k.shape[3], k.dtype, k.device, capacity=max(MIN_CAPACITY, k.shape[2]))
        layer.append(k, v)
        return layer


class KVCache:
    """The KV of one sequence: a LayerKV per layer, all of the same length."""

    def __init__(self, layers: list[LayerKV]):
        self.layers = layers

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device, capacity: int = MIN_CAPACITY):
        return cls([LayerKV(num_kv_heads, head_dim, dtype, device, capacity) for _ in range(num_layers)])

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerKV:
        return self.layers[i]

    @property
    def offset(self) -> int:
        return self.layers[0].offset if self.layers else 0

    @property
    def own_tokens(self) -> int:  # all but those of the prefix cache's blocks it starts with
        return self.offset - self.layers[0].shared if self.layers else 0

    def reserve(self, total: int) -> None:
        """Room for `total` tokens. A paged cache moves each full page to its blocks and takes a fresh page."""
        first = self.layers[0] if self.layers else None
        while first is not None and first.page is not None and total > first.capacity:
            page, fresh = first.page, first.fresh()
            first.blocks.append(page)
            for i, layer in enumerate(self.layers):
                if layer.page is page:
                    layer.page, layer.base, layer._k, layer._v = fresh, layer.base + page.shape[3], *fresh[:, i : i + 1]
        for layer in self.layers:
            layer.reserve(total)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens. A paged cache drops the blocks past them and copies the first tokens of
        the block they end in into a fresh page (the block stays as it is: others may read it)."""
        if self._paged() and 0 <= length < self.layers[0].base:
            first, size = self.layers[0], self.layers[0].page.shape[3]
            page, keep = first.fresh(), length // size
            page[:, :, :, : length % size] = first.blocks[keep][:, :, :, : length % size]
            del first.blocks[keep:]
            first.borrowed.intersection_update(range(keep))
            for i, layer in enumerate(self.layers):
                layer.page, layer.base, layer._k, layer._v = page, keep * size, *page[:, i : i + 1]
                layer.shared = min(layer.shared, length)
        for layer in self.layers:
            layer.truncate(length)

    @property
    def block_size(self) -> int | None:  # tokens per block of a paged cache (else None)
        return self.layers[0].page.shape[3] if self._paged() else None

    def lend(self, j: int, n: int) -> list[torch.Tensor]:
        """Full blocks j..j+n-1 (before the page) for other caches to read by reference (borrow()); this one copies
        them before it writes them from now on."""
        self.layers[0].borrowed.update(range(j, j + n))
        return self.layers[0].blocks[j : j + n]

    def borrow(self, blocks: list[torch.Tensor]) -> None:
        """Take blocks another cache lent as the next tokens, by reference: from a block boundary before the page
        (reserve() made room), in place of the unwritten blocks there."""
        first, size = self.layers[0], self.block_size
        if size is None or self.offset % size or self.offset + len(blocks) * size > first.base:
            raise ValueError(f"borrow: {len(blocks)} blocks cannot go at token {self.offset} of this cache")
        j = self.offset // size
        first.blocks[j : j + len(blocks)] = blocks
        first.borrowed.update(range(j, j + len(blocks)))
        for layer in self.layers:
            layer.offset += len(blocks) * size

    def _paged(self) -> bool:  # every layer writes into the same page (a paged cache none materialized)
        return bool(self.layers) and self.layers[0].page is not None and all(
            layer.page is self.layers[0].page for layer in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def append_all(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append stacked per-layer KV shaped [L, H, T, D] (e.g. from a prefix-cache hit)."""
        if keys.shape[0] != len(self.layers):
            raise ValueError(f"got KV for {keys.shape[0]} layers, cache has {len(self.layers)}")
        if not self._paged():
            for layer, k, v in zip(self.layers, keys, values):
                layer.append(k.unsqueeze(0), v.unsqueeze(0))
            return
        first, at, n = self.layers[0], self.offset, keys.shape[2]
        self.reserve(at + n)  # a paged cache writes through its blocks, every layer's at once
        size = first.page.shape[3]
        for j in range(at // size, (at + n - 1) // size + 1):
            lo, hi = max(at, j * size), min(at + n, (j + 1) * size)
            block = first.page if j * size >= first.base else first.own(j)
            for i, kv in enumerate((keys, values)):
                block[i, :, :, lo - j * size : hi - j * size] = kv[:, :, lo - at : hi - at]
        for layer in self.layers:
            layer.offset += n

    def stacked(self, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [start, end) as [L, H, T, D] copies."""
        end = self.offset if end is None else end
        spans = [layer.span(start, end) for layer in self.layers]
        return torch.stack([k[0] for k, _ in spans]), torch.stack([v[0] for _, v in spans])

    @classmethod
    def paged(cls, blocks: list[torch.Tensor], page: torch.Tensor, filled: int, shared: int, take=None) -> "KVCache":
        """A cache whose tokens are all in blocks [2, L, H, B, D]: the full ones (read in place and never written
        again; the prefix cache holds the first `shared` tokens), then `page`, whose first `filled` tokens are
        written and which takes the next ones (reserve() moves it to `blocks`, a list it appends to, when full, and
        takes a fresh page from `take`, e.g. BlockStore.take)."""
        base, borrowed = len(blocks) * page.shape[3], set(range(len(blocks)))  # (a list that grows, a set that shrinks)
        cache = cls.empty(page.shape[1], page.shape[2], page.shape[4], page.dtype, page.device, capacity=0)
        for i, layer in enumerate(cache.layers):
            layer.blocks, layer.layer, layer.base, layer.page, layer.shared = blocks, i, base, page, shared
            layer._k, layer._v, layer.offset, layer.take = page[0, i : i + 1], page[1, i : i + 1], base + filled, take
            layer.borrowed = borrowed
        return cache

    def fork(self, blocks: list[torch.Tensor] = (), shared: int = 0) -> "KVCache":
        """A copy for another sequence: a paged cache's reads the same full blocks in place (the first of them
        replaced by `blocks`, the prefix cache's own of the same tokens, of which it holds `shared`) and copies only
        the page; any other cache is copied whole."""
        first = self.layers[0] if self.layers else None
        if first is None or first.page is None:
            return self.clone()
        blocks, page = list(blocks) + first.blocks[len(blocks) :], first.fresh().copy_(first.page)
        first.borrowed.update(range(len(first.blocks)))  # both read them now
        return KVCache.paged(blocks, page, self.offset - first.base, shared, first.take)

    def state(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, layer in enumerate(self.layers):
            for name, t in layer.state().items():
                out[f"layers.{i}.{name}"] = t
        return out

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "KVCache":
        n = len({key.split(".")[1] for key in state if key.startswith("layers.")})
        try:
            layers = [LayerKV.from_state({"keys": state[f"layers.{i}.keys"], "values": state[f"layers.{i}.values"]})
                      for i in range(n)]
        except KeyError as exc:
            raise CacheFormatError(f"cache state is missing {exc.args[0]!r}") from None
        if len({layer.offset for layer in layers}) > 1:
            raise CacheFormatError("cache state layers have different lengths")
        return cls(layers)

    def clone(self) -> "KVCache":
        return KVCache.from_state(self.state()) if self.layers else KVCache([])
