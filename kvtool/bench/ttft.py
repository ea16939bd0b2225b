"""`kvtool bench ttft`: TTFT and prefix-cache hit rate for each context layout.

Every scenario starts from an empty cache (reset; on endpoints without a reset route, a per-run
nonce at the start of the system prompt isolates it instead) and sends its requests in order.
Reported per scenario: TTFT p50/p90 over its requests, hit rate = cached / prompt tokens, and
the same after the first request (what the layout lets later requests reuse).
"""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtool.bench.protocol import emit, percentile, versions
from kvtool.bench.scenarios import SCENARIOS, ChatRequest, ScenarioConfig, build


@dataclass
class TTFTBenchConfig:
    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    repeats: int = 1  # each scenario is run this many times from an empty cache
    max_tokens: int = 1  # tokens generated per request (TTFT needs one)
    warmup: bool = True  # one untimed request first (lazy init, caches, JIT)
    out: str = "bench-ttft.json"  # the PNG goes next to it

    def validate(self) -> "TTFTBenchConfig":
        from kvtool.errors import InvalidParameterError

        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise InvalidParameterError(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
        if self.repeats < 1 or self.max_tokens < 1:
            raise InvalidParameterError(f"--repeats and --max-tokens must be >= 1; got {self.repeats} and "
                                        f"{self.max_tokens}")
        return self


def run_ttft_bench(backend, cfg: TTFTBenchConfig | None = None, scenario_cfg: ScenarioConfig | None = None,
                   log=lambda s: print(s, file=sys.stderr, flush=True), run_id: str | None = None) -> dict:
    """Run the scenarios on ``backend`` (InProcessBackend or EndpointBackend); return the JSON record.
    run_id: the nonce's run part (default: random); engines compared side by side get the same one."""
    cfg, scenario_cfg = (cfg or TTFTBenchConfig()).validate(), (scenario_cfg or ScenarioConfig()).validate()
    run_id = run_id or uuid.uuid4().hex[:8]
    isolation = "reset"
    if cfg.warmup:
        backend.send(ChatRequest([{"role": "user", "content": "Say hello."}], None, "warm-up"))
    rows = []
    for name in cfg.scenarios:
        sc = SCENARIOS[name]
        results: list[list] = []
        for rep in range(cfg.repeats):
            header = ""
            if not backend.reset():
                isolation, header = "nonce", f"[session {run_id}-{sc.number}-{rep}]\n"
            requests = build(name, scenario_cfg, header)
            results.append([])
            for i, request in enumerate(requests):
                res = backend.send(request)
                results[-1].append(res)
                log(f"[{sc.number} {name}] repeat {rep + 1}/{cfg.repeats} request {i + 1}/{len(requests)}: "
                    f"TTFT {res.ttft_ms:.1f} ms, {res.cached_tokens}/{res.prompt_tokens} prompt tokens cached")
        rows.append(scenario_row(sc, results))
        fork = backend.fork()  # where the last repeat's requests parted in the cache, if the backend can tell
        if fork is not None:
            rows[-1]["fork"] = fork
    record = {"benchmark": "ttft", **backend.describe(), "isolation": isolation, "config": asdict(cfg),
              "scenario_config": asdict(scenario_cfg), "scenarios": rows, "versions": versions()}
    return record


def _hit_rate(results) -> float | None:
    if not results or any(r.cached_tokens is None or not r.prompt_tokens for r in results):
        return None
    return sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results)


def scenario_row(sc, results: list[list]) -> dict:
    flat = [r for rep in results for r in rep]
    later = [r for rep in results for r in rep[1:]]
    ttfts = [r.ttft_ms for r in flat]
    prompts = [r.prompt_tokens for r in flat if r.prompt_tokens is not None]
    return {"number": sc.number, "name": sc.name, "title": sc.title, "expect": sc.expect,
            "requests": len(flat), "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p90": percentile(ttfts, 90),
            "ttft_ms_first": percentile([rep[0].ttft_ms for rep in results], 50),
            "ttft_ms_later_p50": percentile([r.ttft_ms for r in later], 50) if later else None,
            "hit_rate": _hit_rate(flat), "hit_rate_after_first": _hit_rate(later),
            "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None,
            "results": [[r.to_dict() for r in rep] for rep in results]}


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def format_table(record: dict) -> str:
    head = (f"{'scenario':<22}{'expect':>8}{'req':>5}{'prompt':>8}{'hit':>6}{'hit>1':>7}"
            f"{'TTFT p50':>10}{'p90':>9}{'first':>9}{'later':>9}")
    lines = [f"TTFT per context layout: {record['model']} via {record['backend']}"
             f" ({record.get('device', record.get('endpoint', ''))})", head, "-" * len(head)]
    for row in record["scenarios"]:
        later = "n/a" if row["ttft_ms_later_p50"] is None else f"{row['ttft_ms_later_p50']:.0f}"
        prompt = "n/a" if row["prompt_tokens_mean"] is None else f"{row['prompt_tokens_mean']:.0f}"
        lines.append(f"{row['number'] + ' ' + row['name']:<22}{row['expect']:>8}{row['requests']:>5}{prompt:>8}"
                     f"{_pct(row['hit_rate']):>6}{_pct(row['hit_rate_after_first']):>7}"
                     f"{row['ttft_ms_p50']:>10.0f}{row['ttft_ms_p90']:>9.0f}{row['ttft_ms_first']:>9.0f}{later:>9}")
    lines.append("TTFT in ms; hit = cached/prompt tokens over all requests, hit>1 = after each first request")
    for row in record["scenarios"]:
        fork = row.get("fork")
        if fork and fork["fork_at_token"] is not None:
            starts = " | ".join(json.dumps(b, ensure_ascii=False) for b in fork["branches"])
            lines.append(f"  {row['number']} {row['name']}: requests part at token {fork['fork_at_token']}"
                         f" ({fork['roots']} root{'s' if fork['roots'] > 1 else ''}); branches start {starts}")
    return "\n".join(lines)


def plot(record: dict, path: str | Path) -> None:
    """Bar chart: TTFT p50/p90 per scenario (top) and cache hit rate (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["scenarios"]
    names = [f"{r['number']} {r['name']}" for r in rows]
    xs = range(len(rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7, 1.2 * len(rows)), 7), sharex=True)
    top.bar([x - 0.2 for x in xs], [r["ttft_ms_p50"] for r in rows], width=0.4, label="p50")
    top.bar([x + 0.2 for x in xs], [r["ttft_ms_p90"] for r in rows], width=0.4, label="p90")
    top.set_ylabel("TTFT (ms)")
    top.legend()
    top.set_title(f"TTFT per context layout: {record['model']} ({record['backend']})", fontsize=10)
    rates = [100 * (r["hit_rate"] or 0) for r in rows]
    bars = bottom.bar(list(xs), rates, color="tab:green")
    for bar, r in zip(bars, rows):
        text = "n/a" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%"
        bottom.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
    bottom.set_ylabel("prompt tokens cached (%)")
    bottom.set_ylim(0, 110)
    bottom.set_xticks(list(xs))
    bottom.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(record: dict, out: str | None, png: str | None = None) -> None:
    """Table to stdout, PNG beside the JSON, the JSON record as the last stdout line."""
    print(format_table(record))
    png = png or (str(Path(out).with_suffix(".png")) if out else None)
    if png:
        plot(record, png)
        record["png"] = png
        print(f"wrote {png}", file=sys.stderr)
    emit(record, out)
