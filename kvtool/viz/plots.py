"""Matplotlib (Agg) figures saved as PNG or SVG by file extension; role/channel colours shared with the page."""

from __future__ import annotations

from pathlib import Path

from kvtool.errors import InvalidParameterError

FORMATS = ("png", "svg")
SPAN_COLORS = ("#ff1493", "#ff7f0e", "#00e5ff", "#d62728", "#9467bd")  # visible on viridis


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_output(path: str | Path) -> Path:
    p = Path(path)
    if p.suffix.lower().lstrip(".") not in FORMATS:
        raise InvalidParameterError(f"output {path} must end in .png or .svg")
    return p


def save(fig, path: str | Path) -> Path:
    p = check_output(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=150, bbox_inches="tight", format=p.suffix.lower().lstrip("."))
    pyplot().close(fig)
    return p
