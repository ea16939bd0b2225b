"""Attention heatmaps: query rows x key positions, per layer/head or aggregated (mean, max).

Long inputs are pooled by square blocks on the fly, inside the attention pass, so an 8k x 8k
layer never exists at once: a cell is the mean over its query rows of the attention mass on
its key block (pool="mass"), or the largest single probability in it (pool="max").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtool.errors import InvalidParameterError
from kvtool.viz.config import VizConfig
from kvtool.viz.probs import attention_pass, reduce_heads
from kvtool.viz.tokens import Tokens, label

POOLS = ("mass", "max")
SCALES = ("linear", "log")
LABEL_LIMIT = 80  # token labels on the axes up to this many tokens, positions beyond


@dataclass
class HeatmapData:
    tokens: Tokens
    rows: list[int]  # query rows (token indices), in order
    block: int
    pool: str
    titles: list[str]
    values: np.ndarray  # [panels, row blocks, key blocks]; NaN where the whole cell is in the future
    meta: dict = field(default_factory=dict)

    def to_json(self, with_values: bool = False) -> dict:
        out = {**self.meta, "n_tokens": len(self.tokens), "rows": [self.rows[0], self.rows[-1], len(self.rows)],
               "block": self.block, "pool": self.pool, "shape": list(self.values.shape),
               "panels": [{"title": t, "max": float(np.nanmax(v))} for t, v in zip(self.titles, self.values)]}
        if with_values:
            out["values"] = np.where(np.isnan(self.values), None, np.round(self.values, 6)).tolist()
        return out


class BlockPool:
    """Consumer for attention_pass: pools [h, R, S] probabilities into panels of blocks."""

    def __init__(self, n_keys: int, rows: list[int], layers: list[int], heads: list[int], head_agg: str | None,
                 layer_agg: str | None, block: int, pool: str):
        self.rows, self.block, self.pool = rows, block, pool
        self.layers, self.head_agg, self.layer_agg = layers, head_agg, layer_agg
        self.n_heads = 1 if head_agg else len(heads)
        n_panels = (1 if layer_agg else len(layers)) * self.n_heads
        self.n_kb = math.ceil(n_keys / block)
        self.n_rb = math.ceil(len(rows) / block)
        self.acc = torch.zeros(n_panels, self.n_rb, self.n_kb)
        self.row_index = {r: i for i, r in enumerate(rows)}

    def __call__(self, layer: int, part: torch.Tensor, probs: torch.Tensor) -> None:
        p = reduce_heads(probs, self.head_agg)[None] if self.head_agg else probs  # [h, R, S]
        h, r, s = p.shape
        p = torch.nn.functional.pad(p, (0, self.n_kb * self.block - s))
        p = p.view(h, r, self.n_kb, self.block)
        p = (p.sum(-1) if self.pool == "mass" else p.amax(-1)).float().cpu()  # [h, R, KB]
        rb = torch.tensor([self.row_index[int(x)] // self.block for x in part])
        first = 0 if self.layer_agg else self.layers.index(layer) * self.n_heads
        target = self.acc[first : first + h]
        if self.pool == "mass":
            target.index_add_(1, rb, p)
        else:
            target.index_reduce_(1, rb, p, "amax")

    def finish(self) -> np.ndarray:
        out = self.acc.clone()
        if self.pool == "mass":
            counts = torch.bincount(torch.arange(len(self.rows)) // self.block, minlength=self.n_rb).float()
            out /= counts[None, :, None] * (len(self.layers) if self.layer_agg == "mean" else 1)
        last_row = torch.tensor([self.rows[min(len(self.rows), (i + 1) * self.block) - 1] for i in range(self.n_rb)])
        future = torch.arange(self.n_kb)[None, :] * self.block > last_row[:, None]
        out[:, future] = float("nan")
        return out.numpy()


def compute_heatmap(model, tokens: Tokens, layers: list[int], heads: list[int], head_agg: str | None = None,
                    layer_agg: str | None = None, rows: list[int] | None = None, max_cells: int = VizConfig.max_cells,
                    pool: str = VizConfig.pool) -> HeatmapData:
    if pool not in POOLS:
        raise InvalidParameterError(f"unknown pool {pool!r}; use one of {', '.join(POOLS)}")
    if max_cells < 1:
        raise InvalidParameterError(f"max_cells must be >= 1; got {max_cells}")
    if layer_agg == "max" and pool == "mass":
        pool = "max"  # a max over layers of masses is not a mass; keep max all the way
    rows = rows if rows is not None else list(range(len(tokens)))
    n = len(tokens)
    block = max(1, math.ceil(max(n, len(rows)) / max(1, max_cells)))
    pooler = BlockPool(n, rows, layers, heads, head_agg, layer_agg, block, pool)
    attention_pass(model, tokens.ids, layers, heads, rows, pooler)
    lnames = [layer_agg] if layer_agg else [str(x) for x in layers]
    hnames = [head_agg] if head_agg else [str(x) for x in heads]
    local = model.spec.sliding_layers  # sliding-window layers: a query sees only its last `window` keys
    lnames = [f"{ln} (local, window {model.spec.sliding_window})" if ln.isdigit() and int(ln) in local else ln
              for ln in lnames]
    titles = [f"layer {ln} · head {hn}" for ln in lnames for hn in hnames]
    meta = {"model": model.name, "layers": layers, "heads": heads, "head_agg": head_agg, "layer_agg": layer_agg,
            "sliding_layers": [x for x in layers if x in local], "sliding_window": model.spec.sliding_window}
    return HeatmapData(tokens, rows, block, pool, titles, pooler.finish(), meta)


def generation_marks(tokens: Tokens) -> list[int]:
    """Token indices where generated output starts and where generated reasoning ends."""
    n0 = tokens.n_prompt
    if n0 >= len(tokens):
        return []
    marks = [n0]
    reasoning = [i for i in range(n0, len(tokens)) if tokens.channels[i] == "reasoning"]
    if reasoning and reasoning[-1] + 1 < len(tokens):
        marks.append(reasoning[-1] + 1)
    return marks


def plot_heatmap(data: HeatmapData, path, scale: str = VizConfig.scale, highlight: list[tuple[int, int]] | None = None,
                 vmax: float | None = None, floor: float = VizConfig.log_floor, title: str | None = None):
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.ticker import FuncFormatter

    from kvtool.viz.plots import SPAN_COLORS, pyplot, save

    if scale not in SCALES:
        raise InvalidParameterError(f"unknown scale {scale!r}; use linear or log")
    plt = pyplot()
    p = len(data.titles)
    cols = min(p, 4)
    rows_n = math.ceil(p / cols)
    n, nr, b = len(data.tokens), len(data.rows), data.block
    labelled = b == 1 and max(n, nr) <= LABEL_LIMIT
    side = 9.0 if labelled else 5.0
    fig, axes = plt.subplots(rows_n, cols, figsize=(side * cols + 1.5, side * rows_n), squeeze=False)
    top = vmax if vmax is not None else float(np.nanmax(data.values)) or 1.0
    norm = LogNorm(vmin=floor, vmax=max(top, floor * 10)) if scale == "log" else Normalize(0.0, top)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#eeeeee")
    image = None
    for k, ax in enumerate(axes.flat):
        if k >= p:
            ax.axis("off")
            continue
        vals = data.values[k]
        if scale == "log":
            vals = np.where(np.isnan(vals), np.nan, np.clip(vals, floor, None))
        image = ax.imshow(vals, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest",
                          extent=(0, data.values.shape[2] * b, data.values.shape[1] * b, 0))
        ax.set_title(data.titles[k], fontsize=9)
        ax.set_xlabel("key position (token)")
        ax.set_ylabel("query position (token)")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: str(data.rows[min(nr - 1, max(0, int(y)))])))
        if labelled:
            labels = [label(t) for t in data.tokens.pieces]
            ax.set_xticks(np.arange(n) + 0.5, labels, rotation=90, fontsize=6)
            ax.set_yticks(np.arange(nr) + 0.5, [labels[r] for r in data.rows], fontsize=6)
        for a in generation_marks(data.tokens):  # where the reasoning / output triangles begin
            ax.axvline(a, color="white", ls="--", lw=0.8)
            inside = [i for i, r in enumerate(data.rows) if r >= a]
            if inside:
                ax.axhline(inside[0], color="white", ls="--", lw=0.8)
        for c, (a, e) in enumerate(highlight or []):
            color = SPAN_COLORS[c % len(SPAN_COLORS)]
            ax.axvspan(a, e, fill=False, edgecolor=color, lw=1.2)
            inside = [i for i, r in enumerate(data.rows) if a <= r < e]
            if inside:
                ax.axhspan(inside[0], inside[-1] + 1, fill=False, edgecolor=color, lw=1.2)
    what = "attention probability" if b == 1 else (
        f"attention mass on a {b}-token key block (mean over its query rows)" if data.pool == "mass"
        else f"max attention probability in a {b}x{b} block")
    fig.colorbar(image, ax=axes, shrink=0.8, label=what)
    fig.suptitle(title or f"{data.meta.get('model', '')}: {n} tokens" + (f", {b}x{b} blocks" if b > 1 else ""))
    return save(fig, path)
