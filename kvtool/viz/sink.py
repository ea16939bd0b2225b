"""Attention sinks: the mass every layer and head puts on token 0 and on the first k tokens,
averaged over the query rows past the first `skip` (those can only look at the first tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtool.errors import InvalidParameterError
from kvtool.viz.config import VizConfig
from kvtool.viz.probs import attention_pass
from kvtool.viz.tokens import Tokens


@dataclass
class SinkResult:
    model: str
    n_tokens: int
    k: int
    skip: int
    layers: list[int]
    token0: np.ndarray  # [layers, heads] mean attention on token 0
    first_k: np.ndarray  # [layers, heads] mean attention on tokens 0..k-1

    @property
    def late_layers(self) -> list[int]:
        """The last third of the model's layers (of those measured)."""
        cut = (2 * (max(self.layers) + 1)) // 3
        return [i for i, layer in enumerate(self.layers) if layer >= cut]

    def to_json(self) -> dict:
        late = self.late_layers
        t0 = self.token0.mean(1)
        return {"kind": "sink", "model": self.model, "n_tokens": self.n_tokens, "k": self.k, "skip": self.skip,
                "rows": self.n_tokens - self.skip,
                "layers": [{"layer": layer, "token0": float(t0[i]), "first_k": float(self.first_k[i].mean()),
                            "token0_per_head": self.token0[i].round(6).tolist(),
                            "first_k_per_head": self.first_k[i].round(6).tolist()}
                           for i, layer in enumerate(self.layers)],
                "late_layers": [self.layers[i] for i in late],
                "late_token0_min": float(t0[late].min()) if late else None,
                "late_token0_max": float(t0[late].max()) if late else None,
                "late_layers_token0_ge_0_5": int((t0[late] >= 0.5).sum()) if late else 0}


def sink_stats(model, tokens: Tokens, k: int = VizConfig.sink_first, skip: int = VizConfig.skip_rows,
               layers: list[int] | None = None) -> SinkResult:
    n = len(tokens)
    if not 1 <= k <= n:
        raise InvalidParameterError(f"--first {k} must be in 1..{n} (the input has {n} tokens)")
    if not 0 <= skip < n:
        raise InvalidParameterError(f"--skip {skip} leaves no query rows: the input has {n} tokens")
    layers = layers if layers is not None else list(range(model.spec.num_layers))
    heads = list(range(model.spec.num_heads))
    t0 = torch.zeros(len(layers), len(heads), dtype=torch.float64)
    tk = torch.zeros_like(t0)

    def consume(layer, part, probs):
        i = layers.index(layer)
        t0[i] += probs[:, :, 0].sum(1).cpu().double()
        tk[i] += probs[:, :, :k].sum((1, 2)).cpu().double()

    attention_pass(model, tokens.ids, layers, heads, list(range(skip, n)), consume)
    rows = n - skip
    return SinkResult(model.name, n, k, skip, layers, (t0 / rows).numpy(), (tk / rows).numpy())


def sink_table(res: SinkResult) -> str:
    lines = [f"{res.model}: {res.n_tokens} tokens, rows {res.skip}..{res.n_tokens - 1}",
             f"{'layer':>5}  {'token0':>7}  {f'first{res.k}':>7}  token0 per head"]
    for i, layer in enumerate(res.layers):
        heads = " ".join(f"{v:.2f}" for v in res.token0[i])
        lines.append(f"{layer:>5}  {res.token0[i].mean():7.3f}  {res.first_k[i].mean():7.3f}  {heads}")
    return "\n".join(lines)


def plot_sink(res: SinkResult, path):
    from kvtool.viz.plots import pyplot, save

    plt = pyplot()
    fig, (ax, hm) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    ax.plot(res.layers, res.token0.mean(1), "o-", label="token 0 (mean over heads)")
    ax.fill_between(res.layers, res.token0.min(1), res.token0.max(1), alpha=0.2, label="token 0, head min..max")
    ax.plot(res.layers, res.first_k.mean(1), "s--", label=f"first {res.k} tokens")
    ax.axhline(0.5, color="grey", lw=0.6, ls=":")
    ax.set(xlabel="layer (HF index)", ylabel="attention mass", ylim=(0, 1.02),
           title=f"attention sink: {res.model}, {res.n_tokens} tokens, rows ≥ {res.skip}")
    ax.legend(fontsize=8)
    image = hm.imshow(res.token0.T, aspect="auto", cmap="viridis", vmin=0, vmax=1, origin="lower",
                      extent=(res.layers[0] - 0.5, res.layers[-1] + 0.5, -0.5, res.token0.shape[1] - 0.5))
    hm.set(xlabel="layer", ylabel="head", title="mass on token 0 per head")
    fig.colorbar(image, ax=hm)
    return save(fig, path)
