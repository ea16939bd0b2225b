"""Plot an eval record: quality vs recomputed fraction, and TTFT vs total block tokens."""

from __future__ import annotations

from pathlib import Path


def plot_eval(record: dict, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 6))
    rows = record["repairs"]
    preambles = list(dict.fromkeys(r.get("preamble", "") for r in rows))
    styles = ["o-", "s--", "^:", "d-."]  # one per preamble; one colour per line of a strategy's knob
    lines = _lines(rows)
    for c, line in enumerate(dict.fromkeys(lines.values())):
        for i, preamble in enumerate(preambles):
            pts = sorted((r["recomputed_fraction"], r["top1"], r["cos_mean"]) for r in rows
                         if lines[r["repair"]] == line and r.get("preamble", "") == preamble)
            if not pts:
                continue
            xs, label = [100 * p[0] for p in pts], line + (f" ({preamble})" if len(preambles) > 1 else "")
            for ax, ys in ((axes[0], [p[1] for p in pts]), (axes[1], [p[2] for p in pts])):
                ax.plot(xs, ys, styles[i % len(styles)], color=f"C{c}", label=label)
    axes[0].axhline(0.95, ls=":", c="gray", lw=1)
    axes[1].axhline(0.99, ls=":", c="gray", lw=1)
    axes[0].set(xlabel="block tokens recomputed (%)", ylabel=f"top-1 agreement ({record['n_greedy']} greedy tokens)",
                title="top-1 agreement vs full recompute")
    axes[1].set(xlabel="block tokens recomputed (%)", ylabel="mean logit cosine",
                title="logit cosine vs full recompute")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # one legend for both quality panels, below them
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    scaling = record.get("ttft_scaling") or []
    if scaling:
        xs = [r["block_tokens"] for r in scaling]
        for key in [k for k in scaling[0] if k.startswith("ttft_ms_")]:
            label = "full prefill" if key == "ttft_ms_full" else f"composed ({key[8:]})"
            axes[2].plot(xs, [r[key]["median"] for r in scaling], "o-", label=label)
        axes[2].set(xlabel="total skill block tokens", ylabel="TTFT (ms)",
                    title=f"TTFT: prefix {record['prefix_tokens']} + blocks + query {record['query_tokens']}")
        axes[2].legend(fontsize=8)
        axes[2].grid(alpha=0.3)
    else:
        axes[2].set_axis_off()
    if title:
        fig.suptitle(title)
    rows_of_legend = -(-len(labels) // min(4, max(1, len(labels))))
    fig.tight_layout(rect=(0, 0.045 * rows_of_legend + 0.02, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lines(rows: list[dict]) -> dict[str, str]:
    """repair -> the line it is plotted on: its strategy, plus the settings other than the swept knob that
    differ between the strategy's rows (recompute_attended score=attention beside score=attention_v)."""
    from dataclasses import fields

    from kvtool.skills.repair import make_repair

    settings = {}
    for r in rows:
        repair = make_repair(r["repair"])
        settings[r["repair"]] = (repair.name, {f.name: getattr(repair, f.name) for f in fields(repair)
                                               if f.name != repair.knob})
    out = {}
    for spec, (strategy, rest) in settings.items():
        others = [s for st, s in settings.values() if st == strategy]
        varying = [k for k in rest if any(o[k] != rest[k] for o in others)]
        out[spec] = " ".join([strategy, *(f"{k}={rest[k]}" for k in varying)])
    return out
