"""Position bias: attention mass by absolute key-position bucket and by query-key distance.

Absolute buckets are `n_buckets` equal slices of the input; distance buckets are log2-spaced
(0, 1, 2-3, 4-7, ...). `density` divides each bucket's mass by the keys it holds that the query
rows could see, so early buckets are not favoured just for being visible to every row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtool.errors import InvalidParameterError
from kvtool.viz.config import VizConfig
from kvtool.viz.probs import attention_pass


@dataclass
class PositionResult:
    model: str
    n_tokens: int
    n_rows: int
    layers: list[int]
    bucket: int  # tokens per absolute bucket
    by_position: np.ndarray  # [layers, buckets] mean mass per query row (heads averaged)
    position_density: np.ndarray  # [layers, buckets] mass per visible key
    by_distance: np.ndarray  # [layers, log2 buckets]
    distance_density: np.ndarray

    def to_json(self) -> dict:
        edges = [[b * self.bucket, min(self.n_tokens, (b + 1) * self.bucket)] for b in range(self.by_position.shape[1])]
        dist = [[0, 0]] + [[2 ** (b - 1), 2 ** b - 1] for b in range(1, self.by_distance.shape[1])]
        r = lambda a: np.round(a, 6).tolist()  # noqa: E731
        return {"kind": "position", "model": self.model, "n_tokens": self.n_tokens, "rows": self.n_rows,
                "layers": self.layers, "position_buckets": edges, "distance_buckets": dist,
                "by_position_mean": r(self.by_position.mean(0)),
                "position_density_mean": r(self.position_density.mean(0)),
                "by_distance_mean": r(self.by_distance.mean(0)),
                "distance_density_mean": r(self.distance_density.mean(0)),
                "by_position": r(self.by_position), "by_distance": r(self.by_distance)}


def position_stats(model, ids: list[int], rows: list[int], n_buckets: int = VizConfig.buckets,
                   layers: list[int] | None = None) -> PositionResult:
    n = len(ids)
    if not 1 <= n_buckets <= n:
        raise InvalidParameterError(f"--buckets {n_buckets} must be in 1..{n} (the input has {n} tokens)")
    if not rows:
        raise InvalidParameterError("no query rows selected")
    layers = layers if layers is not None else list(range(model.spec.num_layers))
    bucket = math.ceil(n / n_buckets)
    nb, nd = math.ceil(n / bucket), int(math.log2(n)) + 2
    key_bucket = torch.arange(n) // bucket
    pos_mass = torch.zeros(len(layers), nb, dtype=torch.float64)
    dist_mass = torch.zeros(len(layers), nd, dtype=torch.float64)

    def consume(layer, part, probs):
        p = probs.mean(0).cpu().double()  # [R, S]; float64 on the host (MPS has none)
        s = p.shape[1]
        i = layers.index(layer)
        pos_mass[i].index_add_(0, key_bucket[:s], p.sum(0))
        dist_mass[i].index_add_(0, distance_bucket(part, s).flatten(), p.flatten())

    attention_pass(model, ids, layers, list(range(model.spec.num_heads)), rows, consume)
    row_t = torch.as_tensor(sorted(set(rows)), dtype=torch.float64)
    lo = torch.arange(nb, dtype=torch.float64) * bucket  # keys row r sees in [lo, hi): clamp(r + 1, lo, hi) - lo
    pos_keys = ((row_t[:, None] + 1).clamp(lo, (lo + bucket).clamp(max=n)) - lo).sum(0)
    dlo = torch.tensor([0.0] + [2.0 ** (b - 1) for b in range(1, nd)], dtype=torch.float64)
    dhi = torch.tensor([1.0] + [2.0 ** b for b in range(1, nd)], dtype=torch.float64)
    dist_keys = ((row_t[:, None] + 1).clamp(dlo, dhi) - dlo).sum(0)  # distances 0..r, as for positions
    r = len(row_t)
    return PositionResult(model.name, n, r, layers, bucket, (pos_mass / r).numpy(),
                          (pos_mass / pos_keys.clamp(min=1)).numpy(), (dist_mass / r).numpy(),
                          (dist_mass / dist_keys.clamp(min=1)).numpy())


def distance_bucket(rows: torch.Tensor, s: int) -> torch.Tensor:
    """[R, S] log2 bucket of (row - key): 0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3 ...; future keys -> 0."""
    d = (rows[:, None] - torch.arange(s)[None, :]).clamp(min=0)
    return torch.where(d == 0, 0, torch.floor(torch.log2(d.double())).long() + 1)


def plot_position(res: PositionResult, path):
    from kvtool.viz.plots import pyplot, save

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    third = max(1, len(res.layers) // 3)
    groups = {"all layers": slice(None), "early": slice(0, third), "middle": slice(third, 2 * third),
              "late": slice(2 * third, None)}
    centers = (np.arange(res.by_position.shape[1]) + 0.5) * res.bucket
    for name, sl in groups.items():
        if res.position_density[sl].size:
            a.plot(centers, res.position_density[sl].mean(0), "o-" if name == "all layers" else "--", label=name)
            b.plot(np.arange(res.distance_density.shape[1]), res.distance_density[sl].mean(0),
                   "o-" if name == "all layers" else "--", label=name)
    a.set(xlabel="key position (token)", ylabel="attention per key (mean over rows, heads)", yscale="log",
          title=f"by absolute position: {res.model}, {res.n_tokens} tokens, {res.n_rows} query rows")
    nd = res.distance_density.shape[1]
    b.set_xticks(range(nd), ["0", "1"] + [f"{2 ** (k - 1)}-{2 ** k - 1}" for k in range(2, nd)], rotation=45)
    b.set(xlabel="query-key distance (tokens)", ylabel="attention per key", yscale="log", title="by distance")
    a.legend(fontsize=8)
    return save(fig, path)
