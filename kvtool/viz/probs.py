"""Reference attention probabilities, computed inside the forward's tap.

The fused path (SDPA) never materialises probabilities. Here softmax(q_rot·kᵀ/√d) with a
causal mask is recomputed in fp32 for the asked-for query rows of the asked-for layers,
inside the tap, and handed to a consumer that reduces it at once — so only one layer's rows
(split to a byte budget) are alive at a time. Layer and head indices are Hugging Face's;
query head h reads kv head h // (Hq / Hkv).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from kvtool.errors import ContextWindowError, InvalidParameterError

# consume(layer, rows [R] long slot indices, probs [h, R, S] fp32); S = keys so far, future keys are 0.
Consumer = Callable[[int, torch.Tensor, torch.Tensor], None]
ROW_BUDGET_BYTES = 256 << 20  # scores + probs of one row block, all selected heads
VIZ_CHUNK = 512  # tokens per forward when collecting probabilities (smaller than the engine's: bounds memory)


class _Done(Exception):
    """Raised by the tap after the last selected layer: later layers are not needed."""


def check_ids(model, ids: Sequence[int]) -> list[int]:
    ids = [int(t) for t in ids]
    if not ids:
        raise InvalidParameterError("the input is empty; give a prompt or messages with at least one token")
    window = model.context_window
    if len(ids) > window:
        raise ContextWindowError(f"the input has {len(ids)} tokens; {model.name}'s context window is {window} "
                                 "tokens; shorten the input (or --generate fewer tokens)")
    vocab = model.spec.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidParameterError(f"token ids must be in [0, {vocab}); got {bad[:5]}")
    return ids


def check_layers_heads(model, layers: Sequence[int], heads: Sequence[int]) -> None:
    spec = model.spec
    for what, idx, n in (("layer", layers, spec.num_layers), ("head", heads, spec.num_heads)):
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            raise InvalidParameterError(f"{what} {bad[0]} is out of range: {model.name} has {n} {what}s "
                                        f"(0..{n - 1}, Hugging Face numbering)")
        if not idx:
            raise InvalidParameterError(f"no {what}s selected")


def reference_probs(q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, scale: float | None = None,
                    window: int | None = None) -> torch.Tensor:
    """q [h, R, D], keys [h, S, D] (already GQA-expanded), rows [R] slot indices -> probs [h, R, S] fp32.
    scale defaults to 1/sqrt(D); a sliding-window layer's window hides slots at or before row - window."""
    q, keys = q.float(), keys.float()
    scores = torch.matmul(q, keys.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    slots = torch.arange(keys.shape[1], device=q.device)[None, :]
    hidden = slots > rows[:, None]
    if window is not None:
        hidden |= slots <= rows[:, None] - window
    scores.masked_fill_(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1)


def attention_pass(model, ids: Sequence[int], layers: Sequence[int], heads: Sequence[int],
                   rows: Sequence[int] | None, consume: Consumer, chunk: int | None = None,
                   full: bool = False, budget_bytes: int = ROW_BUDGET_BYTES):
    """Run the forward over `ids`, calling consume() with the probabilities of `rows` (None = all).

    full=False stops each chunk after the last selected layer and returns None;
    full=True runs every layer and returns (last-token logits [1, V], cache) for decoding on.
    """
    ids = check_ids(model, ids)
    layers, heads = sorted(set(layers)), list(heads)
    check_layers_heads(model, layers, heads)
    runner, spec = model.runner, model.spec
    n = len(ids)
    row_t = torch.arange(n) if rows is None else torch.as_tensor(sorted(set(rows)), dtype=torch.long)
    if row_t.numel() and not 0 <= int(row_t.min()) <= int(row_t.max()) < n:
        raise InvalidParameterError(f"query rows must be in [0, {n}); got {int(row_t.min())}..{int(row_t.max())}")
    group = spec.num_heads // spec.num_kv_heads
    head_t = torch.tensor(heads, dtype=torch.long, device=runner.device)
    selected, last_layer = set(layers), max(layers)

    def tap(t) -> None:
        if t.layer in selected:
            end = t.cache[t.layer].offset
            start = end - t.q_rot.shape[2]
            mine = row_t[(row_t >= start) & (row_t < end)]
            if mine.numel():
                keys = t.cache[t.layer].keys[0].index_select(0, head_t // group)  # [h, S, D]
                step = max(1, budget_bytes // (8 * len(heads) * end))
                for i in range(0, mine.numel(), step):
                    part = mine[i : i + step].to(runner.device)
                    q = t.q_rot[0].index_select(0, head_t).index_select(1, part - start)
                    attn = runner.model.layers[t.layer].self_attn
                    consume(t.layer, part.cpu(), reference_probs(q, keys, part, attn.scale, attn.window))
        if not full and t.layer == last_layer:
            raise _Done

    chunk = chunk or VIZ_CHUNK
    cache = runner.new_cache(n + 1)
    logits = None
    for begin in range(0, n, chunk):
        try:
            out = runner.forward(ids[begin : begin + chunk], cache, logits="last" if full else "none", tap=tap)
            logits = out if out is not None else logits
        except _Done:
            pass
    return (logits, cache) if full else None


def attention_rows(model, ids: Sequence[int], layers: Sequence[int], heads: Sequence[int],
                   rows: Sequence[int]) -> torch.Tensor:
    """Dense probabilities [len(layers), len(heads), len(rows), len(ids)] (short inputs; tests, inspector)."""
    layers, rows = sorted(set(layers)), sorted(set(rows))
    out = torch.zeros(len(layers), len(heads), len(rows), len(ids))
    where = {r: i for i, r in enumerate(rows)}

    def consume(layer, part, probs):
        idx = torch.tensor([where[int(r)] for r in part])
        out[layers.index(layer), :, idx, : probs.shape[-1]] = probs.cpu()

    attention_pass(model, ids, layers, heads, rows, consume)
    return out


def reduce_heads(probs: torch.Tensor, how: str, dim: int = 0) -> torch.Tensor:
    """Aggregate over heads: "mean" or "max"."""
    if how == "mean":
        return probs.mean(dim)
    if how == "max":
        return probs.amax(dim)
    raise InvalidParameterError(f"unknown aggregate {how!r}; use mean or max")


def attention_row(model, ids: Sequence[int], query: int, layer: int | str, head: int | str) -> list[float]:
    """One query row over keys 0..query; layer/head an index or "mean"/"max" over all of them."""
    from kvtool.viz.select import AGGREGATES

    ids = check_ids(model, ids)
    if not 0 <= query < len(ids):
        raise InvalidParameterError(f"query {query} is out of range: the input has {len(ids)} tokens "
                                    f"(0..{len(ids) - 1})")
    for name, value in (("layer", layer), ("head", head)):
        if isinstance(value, str) and value not in AGGREGATES:
            raise InvalidParameterError(f"{name} must be an index or one of {', '.join(AGGREGATES)}; got {value!r}")
    spec = model.spec
    layers = list(range(spec.num_layers)) if isinstance(layer, str) else [layer]
    heads = list(range(spec.num_heads)) if isinstance(head, str) else [head]
    probs = attention_rows(model, ids[: query + 1], layers, heads, [query])[:, :, 0]  # [L, H, S]
    row = reduce_heads(probs, head, 1) if isinstance(head, str) else probs[:, 0]
    row = reduce_heads(row, layer, 0) if isinstance(layer, str) else row[0]
    return row.tolist()
