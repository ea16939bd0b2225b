"""Defaults of the attention visualizer, in one place; the CLI and the inspector read them from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VizConfig:
    layers: str = "all"  # all | N | N,M | A:B (HF indices; negative from the end)
    heads: str = "mean"  # mean | max | all | N | N,M | A:B
    rows: str = "all"  # query rows: all | last:N | A:B | generated | reasoning | prompt-end
    max_cells: int = 512  # heatmap cells per axis; longer inputs are pooled by square blocks
    pool: str = "mass"  # mass (key-block sum, row mean) | max
    scale: str = "linear"  # linear | log
    log_floor: float = 1e-4  # smallest value shown on a log scale
    sink_first: int = 4  # "first k tokens" for sink mass
    skip_rows: int = 4  # query rows ignored at the start (they can only attend to the first tokens)
    buckets: int = 16  # absolute-position buckets
    focus_rows: str = "last:1"  # the row that predicts the next token
    needle_context: int = 2000  # filler tokens around the needle
    needle_depths: str = "0,0.25,0.5,0.75,1"
    needle_trials: int = 1  # needles per depth (each a different fact)
    temperature: float = 0.0  # for --generate: greedy, so pictures are reproducible
    strip_cells: int = 256  # key blocks in focus strips
    focus_scale: str = "log"  # the sink would wash out a linear strip
    inspect_max_tokens: int = 128  # inspector: tokens per generation unless asked
