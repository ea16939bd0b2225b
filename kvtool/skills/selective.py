"""Selective recompute: re-run chosen tokens layer by layer over a composed cache (CacheBlend-style),
and the attention a query pays to earlier slots (what recompute_attended ranks block tokens by).

The cache holds a position-aligned sequence (slot i = position i). Tokens at slots
[start, start + n) already hold reused (relocated) KV. Running them again, each layer computes
fresh q/k/v for the active tokens, overwrites their KV in place, and lets them attend to every
slot at or before their own position, mixing reused and recomputed KV as CacheBlend does.
Layer code mirrors kvtool.models.runner (same modules, same math); tests compare the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.skill_settings import DEVIATION_SCORES


@dataclass
class SelectiveResult:
    selected: list[int]  # block-relative indices recomputed through every layer
    deviation: torch.Tensor | None  # [n] per-token KV deviation at the selection layer


def _sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a.float() - b.float()) ** 2).sum((0, 1, 3))  # [1, H, n, D] -> [n]


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _sq(a, b) / (b.float() ** 2).sum((0, 1, 3)).clamp_min(1e-12)


# How a token's deviation is scored from fresh (k, v) and reused (k0, v0) KV at the selection layer.
SCORES = {
    "kv": lambda k, v, k0, v0: _sq(k, k0) + _sq(v, v0),  # squared L2 of K and V differences
    "kv_rel": lambda k, v, k0, v0: _rel(k, k0) + _rel(v, v0),  # the same, relative to the reused norms
    "v": lambda k, v, k0, v0: _sq(v, v0),  # values only
}
assert tuple(SCORES) == DEVIATION_SCORES, "recompute_deviation's knob check names these scores"


QUERY_GROUPS = 4  # attention calls per layer of a selective pass (query_groups)


def query_groups(positions: list[int], groups: int = QUERY_GROUPS) -> list[tuple[int, int, int]]:
    """Split the active tokens into up to `groups` runs of similar size, (lo, hi, end) each: tokens
    [lo, hi) attend to slots [0, end), end = their last position + 1. Every slot past a token's own
    position is masked anyway, so a run that stops early skips keys that would add nothing: for the
    first k tokens of each of 4 blocks spread over the cache, about 40% of the keys."""
    n = len(positions)
    bounds = sorted({round(n * g / groups) for g in range(groups + 1)})
    return [(lo, hi, max(positions[lo:hi]) + 1) for lo, hi in zip(bounds, bounds[1:])]


def _layer(layer, lkv, x: torch.Tensor, pos: torch.Tensor, cos, sin, slots: torch.Tensor, groups, keep=None,
           look=None):
    """One layer for the active tokens x [1, n, hidden] at positions pos: fresh K/V written at their slots,
    attention over every slot at or before each position, a run of query_groups() at a time. keep(k, v)
    may pick a subset (indices into the n tokens) after the write, with its groups; returns (x, that
    subset or None). look(attn, q, keys, values, pos) sees the queries and what they attend to (recompute_slots)."""
    attn, chosen = layer.self_attn, None
    q, k, v = attn.qkv(layer.input_layernorm(x))  # the fused (on CPU packed) projection
    q, k = attn.rotate(q, cos, sin), attn.rotate(k, cos, sin)  # this layer's RoPE base
    if keep is not None:
        chosen = keep(k, v)
    lkv.write(pos, k, v)
    if chosen is not None:
        chosen, groups = chosen
        x, q, pos = x[:, chosen], q[:, :, chosen], pos[chosen]
        if not len(chosen):
            return x, chosen
    outs, (keys, values) = [], lkv.span(0, max(end for _, _, end in groups))  # (paged: one copy of its blocks)
    if look is not None:
        look(attn, q, keys, values, pos)
    for lo, hi, end in groups:
        mask = slots[None, :end] <= pos[lo:hi, None]  # [run, end]: causal by position
        if attn.window is not None:  # a sliding-window layer sees only its window
            mask &= slots[None, :end] > pos[lo:hi, None] - attn.window
        outs.append(F.scaled_dot_product_attention(q[:, :, lo:hi], keys[:, :, :end], values[:, :, :end],
                                                   attn_mask=mask, enable_gqa=True, scale=attn.scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return layer.finish(x, attn.o_proj(out.transpose(1, 2).reshape(1, x.shape[1], attn.num_heads * attn.head_dim))), \
        chosen


ROW_BUDGET_BYTES = 128 << 20  # scores of one block of query rows, all heads


def append_empty(runner, cache, n: int) -> None:
    """Append n slots whose K/V a pass writes, every layer's, before anything reads them."""
    shape = (runner.spec.num_layers, runner.spec.num_kv_heads, n, runner.spec.head_dim)
    empty = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
    cache.append_all(empty, empty)


def receiver(received: torch.Tensor, first_row: int, values: bool):
    """A look for _layer that adds to received [start] the attention probability each slot before `start` gets from
    the rows at positions >= first_row, summed over heads and rows (values: each weighted by the norm of the slot's
    value in its KV head). Scores are fp32 over the keys the layer already holds, each KV head's query heads in one
    matmul (no copy of the keys per query head), a block of rows at a time; columns past a row's position (and
    outside a sliding layer's window) get nothing."""
    start = received.shape[0]

    def look(attn, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, pos: torch.Tensor) -> None:
        rows = (pos >= first_row).nonzero()[:, 0]
        hkv, end, d = keys.shape[1], keys.shape[2], keys.shape[3]
        group, scale = q.shape[1] // hkv, attn.scale or 1.0 / math.sqrt(d)
        k = keys[0].float().transpose(1, 2)  # [Hkv, D, end]
        weight = vals[0, :, :start].float().norm(dim=-1) if values and len(rows) else None  # [Hkv, start]
        slots, step = torch.arange(end, device=q.device), max(1, ROW_BUDGET_BYTES // (4 * q.shape[1] * end))
        for lo in range(0, len(rows), step):
            r = rows[lo : lo + step]
            at, qr = pos[r], q[0][:, r].float() * scale  # [R], [Hq, R, D]: query head h reads KV head h // group
            scores = torch.matmul(qr.reshape(hkv, group * len(r), d), k).view(hkv, group, len(r), end)
            hidden = slots[None, :] > at[:, None]  # [R, end]
            if attn.window is not None:
                hidden |= slots[None, :] <= at[:, None] - attn.window
            got = torch.softmax(scores.masked_fill_(hidden, float("-inf")), -1)[..., :start].sum((1, 2))  # [Hkv, start]
            received.add_((got if weight is None else got * weight).sum(0))

    return look


@torch.inference_mode()
def attention_received(runner, cache, ids: list[int], window: int, chunk: int,
                       values: bool = False) -> torch.Tensor:
    """Compute ids after what `cache` holds (they stay appended; recompute_slots, over a paged cache's blocks in
    place) and return, for every slot before them, the attention probability it receives from the last `window` of
    ids, summed over layers, heads and those rows: [start] fp32 on the runner's device (receiver() scores them).
    values=True weights each probability by the norm of the slot's value in that head: the size of what it adds to
    the output."""
    start = cache.offset
    received = torch.zeros(start, dtype=torch.float32, device=runner.device)
    append_empty(runner, cache, len(ids))
    recompute_slots(runner, cache, list(range(start, start + len(ids))), ids, chunk=chunk,
                    look=receiver(received, start + max(0, len(ids) - window), values))
    return received


@torch.inference_mode()
def recompute_slots(runner, cache, slots: list[int], ids: list[int], chunk: int | None = None,
                    rows: int = 0, look=None) -> torch.Tensor | None:
    """Run the tokens ids at cache slots `slots` (ascending; slot = position) through every layer over the
    cache as it stands: each attends to every slot at or before its own, recomputed ones included. A pass
    takes at most `chunk` tokens (all by default); a later pass attends to what the earlier ones wrote,
    which is what one pass would have seen, as every slot after a token's own is masked.
    look(attn, q, keys, values, pos), if given, sees each layer's rotated queries and the keys and values they attend
    to (receiver()). Returns the logits [rows, V] (fp32) of the last `rows` tokens, or None for rows=0."""
    if any(a >= b for a, b in zip(slots, slots[1:])):
        raise ValueError("recompute_slots: slots must be ascending and distinct")
    step, logits = chunk or max(1, len(slots)), []
    for lo in range(0, len(slots), step):
        part = slots[lo : lo + step]
        x = runner.model.embed_tokens(torch.as_tensor(ids[lo : lo + step], dtype=torch.long,
                                                      device=runner.device))[None]
        pos = torch.as_tensor(part, dtype=torch.long, device=runner.device)
        cos, sin = runner.rope_cos_sin(pos)
        everything, groups = torch.arange(part[-1] + 1, device=runner.device), query_groups(part)
        for i, layer in enumerate(runner.model.layers):
            x, _ = _layer(layer, cache[i], x, pos, cos, sin, everything, groups, look=look)
        wanted = min(len(part), max(0, lo + len(part) - (len(slots) - rows)))  # this pass's share of the last rows
        if wanted:
            logits.append(runner.head(runner.model.norm(x[0, -wanted:])))
    return torch.cat(logits) if logits else None


def recompute_most_attended(runner, cache, candidates: list[int], token_at: dict[int, int], ids: list[int], keep: int,
                            window: int, chunk: int, logits: str = "last", values: bool = True):
    """Query-guided selective recompute over any slots of `cache` (a skill block, or the tokens after an edited
    field): prefill the query `ids` once to measure the attention each candidate slot receives from its last
    `window` tokens (attention_received), then recompute the `keep` most attended candidates (token_at: slot
    -> token id) through every layer and the query with them, over the cache as it stands. The query's slots
    hold KV computed against the unrepaired cache; the pass overwrites each layer's before anything reads it.
    Returns (the chosen slots, ascending; the query's logits per `logits`: "all", "last" or "none")."""
    start = cache.offset
    received = attention_received(runner, cache, ids, window, chunk, values=values)
    slots = torch.as_tensor(candidates, dtype=torch.long)
    keep = max(0, min(keep, len(candidates)))
    chosen = slots[received[slots.to(received.device)].topk(keep).indices.cpu()].sort().values.tolist()
    rows = {"all": len(ids), "last": 1}.get(logits, 0)
    out = recompute_slots(runner, cache, chosen + list(range(start, start + len(ids))),
                          [token_at[s] for s in chosen] + list(ids), chunk=chunk, rows=rows)
    return chosen, out


@torch.inference_mode()
def recompute_selected(runner, cache, ids: list[int], start: int, ratio: float, select_layer: int = 1,
                       score: str = "kv", first: int = 0) -> SelectiveResult:
    """Recompute the block ids at slots [start, start+n) of `cache` (whose offset is start + n).

    Layers 0..select_layer run for all n tokens (their KV there becomes exact). At select_layer the
    per-token deviation (SCORES[score]) picks the ceil(ratio * n) tokens that deviate most, always
    including the first `first` tokens; only those run the remaining layers. ratio >= 1 recomputes
    every token (= full prefill).
    """
    n, end = len(ids), cache.offset
    if end != start + n:
        raise ValueError(f"the block must be the last thing in the cache: start {start} + {n} tokens != {end}")
    layers = runner.model.layers
    select_layer = min(max(select_layer, 0), len(layers) - 1)
    x = runner.model.embed_tokens(torch.as_tensor(ids, dtype=torch.long, device=runner.device))[None]
    slots = torch.arange(end, device=runner.device)
    pos = start + torch.arange(n, device=runner.device)
    found: dict = {"deviation": None, "selected": list(range(n))}

    def select(k, v):
        """At select_layer: score fresh against reused KV, keep the most deviating tokens."""
        lkv = cache[select_layer]
        deviation = SCORES[score](k, v, lkv.keys[:, :, pos], lkv.values[:, :, pos])
        keep = min(n, math.ceil(ratio * n))
        ranked = deviation.clone()
        ranked[: min(first, keep)] = float("inf")
        chosen = ranked.topk(keep).indices.sort().values
        selected = chosen.tolist()
        found.update(deviation=deviation, selected=selected, groups=query_groups([start + j for j in selected]))
        return chosen, found["groups"]

    groups = query_groups(list(range(start, end)))
    for i, layer in enumerate(layers):
        selecting = i == select_layer and ratio < 1.0
        cos, sin = runner.rope_cos_sin(pos)
        x, chosen = _layer(layer, cache[i], x, pos, cos, sin, slots, groups, select if selecting else None)
        if chosen is not None:
            pos, groups = pos[chosen], found["groups"]
            if len(chosen) == 0:
                break
    return SelectiveResult(found["selected"], found["deviation"])
