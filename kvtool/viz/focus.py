"""Focus: how much of the chosen query rows' attention goes to named spans vs the rest.

share = mean over rows and heads of the attention mass on the span's tokens (per layer);
per_token = share / span length, so a short status block and long raw call records compare
fairly. A strip [layers, key blocks] of the rows' attention is kept for side-by-side plots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtool.errors import InvalidParameterError
from kvtool.viz.config import VizConfig
from kvtool.viz.probs import attention_pass
from kvtool.viz.tokens import Tokens, find_spans, span_mask


@dataclass
class FocusResult:
    label: str
    model: str
    tokens: Tokens
    rows: list[int]
    layers: list[int]
    spans: dict[str, list[tuple[int, int]]]  # name -> token ranges (empty when absent here)
    share: dict[str, np.ndarray]  # name -> [layers]
    strip: np.ndarray  # [layers, key blocks] attention mass of the rows (mean rows, heads)
    block: int

    def summary(self) -> dict:
        out = {}
        for name, ranges in self.spans.items():
            size = sum(b - a for a, b in ranges)
            share = self.share[name]
            out[name] = {"tokens": size, "ranges": [list(r) for r in ranges],
                         "share": float(share.mean()) if size else None,
                         "per_token": float(share.mean() / size) if size else None,
                         "rest": float(1 - share.mean()) if size else None,
                         "share_by_layer": np.round(share, 6).tolist() if size else None}
        return out

    def to_json(self) -> dict:
        return {"kind": "focus", "label": self.label, "model": self.model, "n_tokens": len(self.tokens),
                "rows": self.rows if len(self.rows) <= 64 else [self.rows[0], self.rows[-1], len(self.rows)],
                "layers": self.layers, "spans": self.summary()}


def resolve_spans(tokens: Tokens, specs: dict[str, list[str]], required: bool = True) -> dict[str, list]:
    """name -> token ranges, each name a union of span specs ("tag:tool_call", ...)."""
    out = {}
    for name, parts in specs.items():
        ranges = []
        for spec in parts:
            try:
                ranges += find_spans(tokens, spec)
            except InvalidParameterError:
                if required:
                    raise
        out[name] = sorted(set(ranges))
    return out


def focus(model, tokens: Tokens, spans: dict[str, list[tuple[int, int]]], rows: list[int],
          layers: list[int] | None = None, label: str = "", max_cells: int = VizConfig.strip_cells) -> FocusResult:
    if not rows:
        raise InvalidParameterError("no query rows selected")
    layers = layers if layers is not None else list(range(model.spec.num_layers))
    n = len(tokens)
    masks = {name: torch.tensor(span_mask(n, r), dtype=torch.float64) for name, r in spans.items()}
    share = {name: torch.zeros(len(layers), dtype=torch.float64) for name in spans}
    block = max(1, math.ceil(n / max_cells))
    n_kb = math.ceil(n / block)
    strip = torch.zeros(len(layers), n_kb * block, dtype=torch.float64)

    def consume(layer, part, probs):
        p = probs.mean(0).cpu().double()  # [R, S]; float64 on the host (MPS has none)
        i = layers.index(layer)
        for name, m in masks.items():
            share[name][i] += (p * m[: p.shape[1]]).sum()
        strip[i, : p.shape[1]] += p.sum(0)

    attention_pass(model, tokens.ids, layers, list(range(model.spec.num_heads)), rows, consume)
    r = len(set(rows))
    pooled = (strip / r).view(len(layers), n_kb, block).sum(-1).numpy()
    return FocusResult(label, model.name, tokens, sorted(set(rows)), layers, spans,
                       {k: (v / r).numpy() for k, v in share.items()}, pooled, block)


def plot_focus(results: list[FocusResult], path, scale: str = VizConfig.focus_scale,
               floor: float = VizConfig.log_floor):
    """One strip per context (same colour scale), spans outlined; bars of per-token attention per span."""
    from matplotlib.colors import LogNorm, Normalize

    from kvtool.viz.plots import SPAN_COLORS, pyplot, save

    plt = pyplot()
    k = len(results)
    fig = plt.figure(figsize=(7 * k + 5, 5.5), layout="constrained")
    grid = fig.add_gridspec(1, k + 1, width_ratios=[3] * k + [2])
    top = max(float(r.strip.max()) for r in results)
    norm = LogNorm(vmin=floor, vmax=max(top, 10 * floor)) if scale == "log" else Normalize(0, top)
    image = None
    names = list(results[0].spans)
    strips = []
    for j, res in enumerate(results):
        ax = fig.add_subplot(grid[0, j])
        strips.append(ax)
        vals = np.clip(res.strip, floor, None) if scale == "log" else res.strip
        image = ax.imshow(vals, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest", origin="lower",
                          extent=(0, res.strip.shape[1] * res.block, res.layers[0] - 0.5, res.layers[-1] + 0.5))
        for c, name in enumerate(names):
            for a, b in res.spans[name]:
                ax.axvspan(a, b, fill=False, edgecolor=SPAN_COLORS[c % len(SPAN_COLORS)], lw=1.2,
                           label=name if (a, b) == res.spans[name][0] else None)
        ax.set(xlabel="key position (token)", ylabel="layer",
               title=f"{res.label or 'context'}: {len(res.tokens)} tokens, rows {rows_text(res.rows)}")
        ax.legend(fontsize=7, loc="upper left")
    fig.colorbar(image, ax=strips, shrink=0.8, label=f"attention mass per {results[0].block}-token block "
                 "(mean over rows, heads)")
    bars = fig.add_subplot(grid[0, k])
    width = 0.8 / len(names)
    for c, name in enumerate(names):
        vals = [r.summary()[name]["per_token"] for r in results]
        x = np.arange(k) + c * width
        bars.bar(x, [v or 0.0 for v in vals], width, label=name, color=SPAN_COLORS[c % len(SPAN_COLORS)])
        for xi, v in zip(x, vals):
            if v is None:
                bars.text(xi, 0, "absent", ha="center", va="bottom", rotation=90, fontsize=7)
    bars.set_xticks(np.arange(k) + width * (len(names) - 1) / 2, [r.label or str(i) for i, r in enumerate(results)])
    bars.set(ylabel="attention per span token (mean layers, heads, rows)", title="focus per token")
    bars.legend(fontsize=7)
    return save(fig, path)


def rows_text(rows: list[int]) -> str:
    return f"{rows[0]}" if len(rows) == 1 else f"{rows[0]}..{rows[-1]} ({len(rows)})"
