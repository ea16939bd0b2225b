"""Grouped bar charts for benchmark records: one panel per metric, one bar per engine."""

from __future__ import annotations

import textwrap
from pathlib import Path


def bar_panels(path: str | Path, title: str, panels: dict[str, dict[str, float | None]]) -> Path:
    """panels: {metric label: {engine: value}}; missing values (None) are left out of their panel, and a panel
    with no value at all (a workload the run left out) is not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {metric: values for metric, values in panels.items() if any(v is not None for v in values.values())}
    if not panels:
        raise ValueError(f"{title}: no values to plot")
    engines = list(dict.fromkeys(e for values in panels.values() for e, v in values.items() if v is not None))
    colors = {e: f"C{i}" for i, e in enumerate(engines)}
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels) + 1, 3.8), squeeze=False)
    for ax, (metric, values) in zip(axes[0], panels.items()):
        shown = [(e, v) for e, v in values.items() if v is not None]
        bars = ax.bar(range(len(shown)), [v for _, v in shown], color=[colors[e] for e, _ in shown])
        for bar, (_, v) in zip(bars, shown):
            ax.annotate(f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(range(len(shown)))
        ax.set_xticklabels([e for e, _ in shown], rotation=25, ha="right", fontsize=8)
        ax.set_title(metric, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path, title)


def line_panels(path: str | Path, title: str, panels: dict[str, dict[str, list[tuple[float, float]]]],
                xlabel: str, ylabel: str) -> Path:
    """panels: {panel title: {line label: [(x, y), ...]}}; a one-point line is drawn as a marker. A label ending
    in " (mode)" keeps its base label's colour and takes a dashed style per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bases = list(dict.fromkeys(label.split(" (")[0] for lines in panels.values() for label in lines))
    modes = list(dict.fromkeys(label.partition(" (")[2] for lines in panels.values() for label in lines))
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels) + 1, 4.6), squeeze=False)
    for ax, (panel, lines) in zip(axes[0], panels.items()):
        for label, pts in lines.items():
            base, _, mode = label.partition(" (")
            color, style = f"C{bases.index(base)}", styles[modes.index(mode) % len(styles)]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, "o" if len(pts) == 1 else "o" + style, color=color, label=label,
                    fillstyle="full" if modes.index(mode) == 0 else "none")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=panel, ylim=(-0.03, 1.03))
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlim(0, 1.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path, title)


def _save(fig, path: str | Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(textwrap.fill(title, int(fig.get_figwidth() * 12)), fontsize=10)  # ~12 characters an inch
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
