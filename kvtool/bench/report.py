"""`kvtool bench all`: decode, TTFT per context layout, prefix cache, skill composition and batching in one
run, written as one report: report.md (tables, targets met/missed), report.json (every record), PNG plots.

The model is loaded once and shared; transformers runs on the same weights in the same process; with
--endpoint the serving scenarios (context layouts, batching) also run against that server. A benchmark
that fails is recorded as an error and the rest still run. --quick shrinks every size (a smoke test).
"""

from __future__ import annotations

import json
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtool.bench.batching import BatchingBenchConfig
from kvtool.bench.decode import DecodeBenchConfig, paired_text, variant_of
from kvtool.bench.prefix import PrefixBenchConfig
from kvtool.bench.protocol import device_name, emit, portable, versions
from kvtool.bench.scenarios import ScenarioConfig
from kvtool.bench.skills import SkillsBenchConfig
from kvtool.bench.ttft import TTFTBenchConfig
from kvtool.config import EngineConfig
from kvtool.errors import InvalidParameterError

BENCHMARKS = ("decode", "ttft", "prefix", "skills", "batching")


@dataclass
class ReportConfig:
    model: str | None = None
    shape: str | None = None
    device: str = EngineConfig.device
    dtype: str = EngineConfig.dtype
    weights: str = EngineConfig.weights
    tokenizer: str | None = None  # with shape: an HF tokenizer folder (default: the embedded SmolLM2's)
    endpoint: str | None = None  # OpenAI-compatible server for the serving scenarios
    served_model: str | None = None  # None: the first of the endpoint's /v1/models
    api_key: str | None = field(default=None, repr=False)  # never written to the report
    quick: bool = False
    only: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    out_dir: str | None = None  # None: benchmarks/results/report-<device>[-quick]

    def validate(self) -> "ReportConfig":
        unknown = [b for b in self.only if b not in BENCHMARKS]
        if unknown or not self.only:
            raise InvalidParameterError(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
        return self


def sub_configs(quick: bool, device_type: str) -> dict:
    """Each benchmark's config: its defaults (GPU target sizes on CUDA), or tiny sizes for --quick."""
    if quick:
        return {"decode": DecodeBenchConfig(decode_tokens=8, ttft_lengths=[64, 128], prompt_tokens=16, repeats=2),
                "ttft": (TTFTBenchConfig(scenarios=["shared-prefix", "timestamp"]),
                         ScenarioConfig(requests=2, policy_paragraphs=0, tools=1)),
                "prefix": PrefixBenchConfig(prefix_tokens=128, suffix_tokens=16, repeats=2),
                "skills": SkillsBenchConfig(blocks=2, block_tokens=48, prefix_tokens=32, query_tokens=16,
                                            repairs=["none"], greedy_tokens=4, queries=1, scaling=[], synthetic=True),
                "batching": BatchingBenchConfig(streams=4, new_tokens=8, prompt_tokens=16, repeats=1,
                                                sequential_streams=2)}
    gpu = device_type == "cuda"
    return {"decode": DecodeBenchConfig(ttft_lengths=[512, 4096] if gpu else [512, 2048]),
            "ttft": (TTFTBenchConfig(), ScenarioConfig()),
            "prefix": PrefixBenchConfig(prefix_tokens=4096 if gpu else PrefixBenchConfig.prefix_tokens),
            "skills": SkillsBenchConfig(), "batching": BatchingBenchConfig()}


# ---- running -------------------------------------------------------------------------------


def _decode(bm, cfgs, rc, log):
    from kvtool.bench.decode import run_decode_bench

    return run_decode_bench(bm, cfgs["decode"], log)


def _ttft(bm, cfgs, rc, log):
    from kvtool.bench.backends import InProcessBackend
    from kvtool.bench.ttft import run_ttft_bench

    cfg, scenario_cfg = cfgs["ttft"]
    return run_ttft_bench(InProcessBackend.for_model(bm.model, max_tokens=cfg.max_tokens), cfg, scenario_cfg, log)


def _ttft_endpoint(bm, cfgs, rc, log):
    from kvtool.bench.backends import EndpointBackend
    from kvtool.bench.ttft import run_ttft_bench

    cfg, scenario_cfg = cfgs["ttft"]
    backend = EndpointBackend(rc.endpoint, rc.served_model, rc.api_key, cfg.max_tokens)
    return run_ttft_bench(backend, cfg, scenario_cfg, log)


def _prefix(bm, cfgs, rc, log):
    from kvtool.bench.prefix import run_prefix_bench

    return run_prefix_bench(bm, cfgs["prefix"], log)


def _skills(bm, cfgs, rc, log):
    from kvtool.bench.skills import run_skills_bench

    return run_skills_bench(bm, cfgs["skills"], log)


def _batching(bm, cfgs, rc, log):
    from kvtool.bench.batching import run_batching_bench

    endpoint = {"url": rc.endpoint, "model": rc.served_model, "api_key": rc.api_key} if rc.endpoint else None
    return run_batching_bench(bm, cfgs["batching"], endpoint, log)


# benchmark -> its runs (record key, function, needs --endpoint); each run fails on its own
JOBS = {"decode": [("decode", _decode, False)],
        "ttft": [("ttft", _ttft, False), ("ttft_endpoint", _ttft_endpoint, True)],
        "prefix": [("prefix", _prefix, False)], "skills": [("skills", _skills, False)],
        "batching": [("batching", _batching, False)]}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def run_report(rc: ReportConfig, bm=None, log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Run the benchmarks in rc.only on one model (``bm``, a BenchModel, or loaded from rc) and write the
    report; returns the combined record (also written as report.json and printed as the last stdout line)."""
    from kvtool.bench.loading import load_bench_model

    rc.validate()
    own = bm is None
    bm = bm or load_bench_model(rc.model, rc.shape, rc.device, rc.dtype, announce=log, weights=rc.weights,
                                tokenizer=rc.tokenizer)
    try:
        dev = bm.device
        cfgs = sub_configs(rc.quick, dev.type)
        records, errors, seconds = {}, {}, {}
        slug = _slug(device_name(dev)) if dev.type == "cuda" else dev.type
        out_dir = Path(rc.out_dir or f"benchmarks/results/report-{slug}{'-quick' if rc.quick else ''}")
        jobs = [job for name in rc.only for job in JOBS[name] if rc.endpoint or not job[2]]
        for i, (key, run, _) in enumerate(jobs, start=1):
            log(f"\n[{i}/{len(jobs)}] {key}")
            t0 = time.perf_counter()
            try:
                records[key] = run(bm, cfgs, rc, log)
                errors.update({f"{key} {part}": msg for part, msg in records[key].get("errors", {}).items()})
            except Exception as exc:  # recorded in the report; the other benchmarks still run
                errors[key] = f"{type(exc).__name__}: {exc}"
                log(f"[{i}/{len(jobs)}] {key} failed: {errors[key]}\n{traceback.format_exc(limit=3)}")
            seconds[key] = round(time.perf_counter() - t0, 1)
            write_partial(out_dir, records, errors, seconds)
        config = {k: v for k, v in asdict(rc).items() if k != "api_key"}
        record = {"benchmark": "all", "model": bm.name, "device": device_name(dev), "device_type": dev.type,
                  "dtype": bm.dtype, "random_weights": bm.random_weights,
                  "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join([_program(), *sys.argv[1:]]),
                  "config": config, "sub_configs": {k: _asdict(v) for k, v in cfgs.items() if k in rc.only},
                  "versions": versions(), "seconds": seconds, "errors": errors, "records": records}
        record["targets"] = [{"benchmark": key, **row} for key, rec in records.items()
                             for row in rec.get("target_checks", [])]
        write_report(record, out_dir, log)
        (out_dir / PARTIAL).unlink(missing_ok=True)
        return record
    finally:
        if own:
            bm.close()


def _program() -> str:
    return "kvtool" if Path(sys.argv[0]).name == "kvtool" else sys.argv[0]


def _asdict(cfg):
    return [asdict(c) for c in cfg] if isinstance(cfg, tuple) else asdict(cfg)


# ---- writing -------------------------------------------------------------------------------


def _num(x, unit: str = "") -> str:
    if x is None:
        return "n/a"
    text = f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"
    return f"{text} {unit}".rstrip()


def _stat(s: dict | None) -> str:
    """median (min-max over n runs)."""
    if not s:
        return "n/a"
    return _num(s["median"]) + (f" ({_num(s['min'])}-{_num(s['max'])})" if s["n"] > 1 else "")


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _decode_md(records: dict) -> list[str]:
    rec = records["decode"]
    c, ratios, paired = rec["config"], rec["speedup_vs_transformers"], rec.get("paired_speedup_vs_transformers", {})
    rows = []
    for metric, row in rec["results"].items():
        base, variant = variant_of(metric)
        label = ("decode tok/s (bs=1)" if base.startswith("decode") else f"cold TTFT @{base[8:]} tokens (ms)") + \
            (f", {variant.removeprefix('kvtool ')}" if variant else "")
        rows.append([label, _stat(row["kvtool"]), _stat(row.get("transformers")), _ratio(ratios.get(metric)),
                     paired_text(paired.get(metric))])
    lines = [f"{c['decode_tokens']} greedy tokens after a {c['prompt_tokens']}-token prompt; median (min-max) of "
             f"{c['repeats']} runs after {c['warmup']} warm-up, the engines alternating run by run. Ratio > 1: kvtool "
             "is faster; run by run: each kvtool run against the baseline run beside it.", "",
             *_table(["metric", "kvtool", "transformers", "kvtool vs transformers", "run by run"], rows)]
    fid = rec.get("int4_fidelity")
    if fid:
        lines += ["", f"int4 projections vs the dense model over {fid['steps']} greedy steps: top-1 agreement "
                      f"{fid['top1_agreement']:.3f}, next-token KL mean {fid['kl_mean']:.5f} (max {fid['kl_max']:.5f})."]
    return lines


def _ttft_md(records: dict) -> list[str]:
    runs = {name: records[key] for name, key in (("kvtool", "ttft"), ("endpoint", "ttft_endpoint")) if key in records}
    by_name = {name: {r["name"]: r for r in rec["scenarios"]} for name, rec in runs.items()}
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    head, rows = ["scenario", "expect"], []
    for name in runs:
        head += [f"{name} TTFT p50 (ms)", f"{name} hit after 1st"]
    if len(runs) == 2:
        head.append("endpoint / kvtool TTFT")
    first = next(iter(runs.values()))
    for sc in first["scenarios"]:
        row = [f"{sc['number']} {sc['name']}", sc["expect"]]
        found = [by_name[n].get(sc["name"]) for n in runs]
        for r in found:
            row += [_num(r and r["ttft_ms_p50"]), pct(r and r["hit_rate_after_first"])]
        if len(found) == 2:
            row.append(_ratio(found[1]["ttft_ms_p50"] / found[0]["ttft_ms_p50"] if all(found) else None))
        rows.append(row)
    where = ", ".join(f"{n}: {rec.get('endpoint') or rec['backend']} ({rec['model']})" for n, rec in runs.items())
    return [f"Each scenario from an empty cache, {first['scenario_config']['requests']} requests; {where}. "
            "transformers keeps no KV cache across requests, so it has no column here.", "",
            *_table(head, rows)]


def _prefix_md(records: dict) -> list[str]:
    rec = records["prefix"]
    c = rec["config"]
    rows = [[e, _stat(r["cold_ms"]), _stat(r["hit_ms"]), _ratio(r["speedup"])] for e, r in rec["results"].items()]
    tail = [f"kvtool hit vs transformers hit: {_ratio(rec['hit_vs_transformers_hit'])}"] \
        if "hit_vs_transformers_hit" in rec else []
    return [f"{c['prefix_tokens']} cached + {c['suffix_tokens']} new tokens; first token after a hit equals a "
            f"cold prefill's: {rec['first_token_match']}.", "",
            *_table(["engine", "cold prefill (ms)", "prefix hit (ms)", "hit speedup"], rows), "", *tail]


def _skills_md(records: dict) -> list[str]:
    rec = records["skills"]
    rows = [[r["repair"], r.get("preamble", ""), f"{100 * r['recomputed_fraction']:.1f}%", f"{r['top1']:.3f}",
             f"{r['cos_mean']:.4f}", _stat(r["ttft_ms_cold"]), _ratio(r["speedup_cold"])] for r in rec["repairs"]]
    return [f"{rec['prompt_tokens']} prompt tokens ({rec['block_tokens']} in {len(rec['blocks'])} blocks); baseline: "
            f"kvtool full prefill of the same tokens, TTFT {_stat(rec['ttft_ms_full'])} ms"
            + (" (random weights: fidelity numbers are not meaningful)" if rec["random_weights"] else
               " (synthetic token blocks)" if rec.get("synthetic_blocks") else "") + ".", "",
            *_table(["repair", "blocks compiled", "recomputed", "top-1", "cosine", "TTFT cold (ms)",
                     "vs full prefill"], rows)]


def _batching_md(records: dict) -> list[str]:
    from kvtool.bench.batching import ENGINES

    rec = records["batching"]
    c, speedup = rec["config"], rec["speedup_vs"]
    rows = [[ENGINES[n], str(r["streams"]), _stat(r["tok_s"]), _num(r["itl_ms_p50"]), _num(r["itl_ms_p99"]),
             _num(r["ttft_ms_p50"]), _num(r["ttft_ms_p99"]), _ratio(speedup.get(n))]
            for n, r in rec["results"].items()]
    match = "; ".join(f"{ENGINES[n]}: {m['identical']}/{m['compared']}" for n, m in rec["greedy_match"].items())
    endpoint = rec["endpoint"]
    return [f"{c['streams']} concurrent greedy streams x {c['new_tokens']} new tokens (ignore_eos), random prompts of "
            f"{min(rec['prompt_lengths'])}-{max(rec['prompt_lengths'])} tokens"
            + (f"; endpoint {endpoint['url']} ({endpoint['model']})" if endpoint else "") + ".", "",
            *_table(["engine", "streams", "output tok/s", "ITL p50 (ms)", "ITL p99 (ms)", "TTFT p50 (ms)",
                     "TTFT p99 (ms)", "kvtool batched vs this"], rows), "",
            f"Greedy streams identical to kvtool batched: {match or 'not compared'}. Sequential TTFT is per lone "
            "request; endpoint ITL is between streamed chunks."]


SECTIONS = {"decode": ("Decode (bs=1) and cold TTFT", _decode_md),
            "ttft": ("TTFT per context layout (prefix-cache scenarios)", _ttft_md),
            "prefix": ("Prefix-cache hit vs cold prefill", _prefix_md),
            "skills": ("Composed skill blocks vs full prefill", _skills_md),
            "batching": ("Concurrent streams (continuous batching)", _batching_md)}


def _plot_decode(records, path):
    from kvtool.bench.plots import bar_panels

    rec = records["decode"]
    title = lambda m: "decode tok/s" if m.startswith("decode") else f"cold TTFT @{m[8:]} (ms)"  # noqa: E731
    panels = {title(m): {e: s["median"] for e, s in row.items()} for m, row in rec["results"].items()
              if variant_of(m)[1] is None}
    for m, row in rec["results"].items():
        base, variant = variant_of(m)
        if variant:
            panels[title(base)][variant] = row["kvtool"]["median"]
    bar_panels(path, f"{rec['model']} on {rec['device']}, {rec['dtype']}", panels)


def _plot_ttft(records, path):
    from kvtool.bench.ttft import plot

    plot(records["ttft"], path)


def _plot_ttft_endpoint(records, path):
    from kvtool.bench.ttft import plot

    plot(records["ttft_endpoint"], path)


def _plot_prefix(records, path):
    from kvtool.bench.plots import bar_panels

    rec = records["prefix"]
    panels = {label: {e: r[key]["median"] for e, r in rec["results"].items()}
              for label, key in (("cold prefill (ms)", "cold_ms"), ("prefix hit (ms)", "hit_ms"))}
    bar_panels(path, f"prefix cache: {rec['model']} on {rec['device']}", panels)


def _plot_skills(records, path):
    from kvtool.skills.plot import plot_eval

    plot_eval(records["skills"], path, title=f"{records['skills']['model']} on {records['skills']['device']}")


def _plot_batching(records, path):
    from kvtool.bench.batching import plot

    plot(records["batching"], path)


PLOTS = {"decode": _plot_decode, "ttft": _plot_ttft, "ttft_endpoint": _plot_ttft_endpoint, "prefix": _plot_prefix,
         "skills": _plot_skills, "batching": _plot_batching}


def markdown(record: dict, plots: dict[str, str]) -> str:
    v, records, errors = record["versions"], record["records"], record["errors"]
    endpoint = record["config"]["endpoint"]
    lines = [f"# kvtool benchmark report: {record['model']} on {record['device']}", "",
             *_table(["", ""], [["model", record["model"] + (" (random weights)" if record["random_weights"] else "")],
                                ["device", f"{record['device']} ({record['device_type']})"],
                                ["dtype", record["dtype"]],
                                ["versions", f"python {v['python']}, torch {v['torch']}, transformers "
                                             f"{v['transformers']}, kvtool {v['kvtool']}"],
                                ["date", record["date"]],
                                ["mode", "quick (tiny sizes: a smoke test, not a measurement)" if record["config"][
                                    "quick"] else "full"],
                                ["endpoint", endpoint or "none"],
                                ["command", f"`{record['command']}`"]]),
             "", "## Targets", "",
             "Measured values come from this run; n/a where a target was set for another device or size "
             "(the sizes of a full run), or nothing was measured.", ""]
    rows = [[t["benchmark"], t["label"], t["target"], t["setup"], _num(t["measured"], t["unit"]), t["status"]]
            for t in record["targets"]]
    lines += _table(["benchmark", "metric", "target", "set for", "measured", "status"], rows) if rows else \
        ["(no targets ran)"]
    for name in record["config"]["only"]:
        title, section = SECTIONS[name]
        lines += ["", f"## {title}", ""]
        if any(key.split("_")[0] == name for key in records):
            lines += section(records)
        lines += [f"\n![{key}]({Path(path).name})" for key, path in plots.items() if key.split("_")[0] == name]
        lines += [f"\n**error ({key}):** `{msg}`" for key, msg in errors.items() if re.split("[_ ]", key)[0] == name]
        spent = sum(t for key, t in record["seconds"].items() if key.split("_")[0] == name)
        lines.append(f"\n_{spent:.0f} s_")
    return "\n".join(lines) + "\n"


PARTIAL = "partial.json"  # the records so far, rewritten after each benchmark; removed once the report is written


def write_partial(out_dir: Path, records: dict, errors: dict, seconds: dict) -> None:
    """Keep what finished if the run is stopped before the report (a time-limited lease, say)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PARTIAL).write_text(json.dumps(portable({"records": records, "errors": errors,
                                                         "seconds": seconds}), indent=1) + "\n")


def write_report(record: dict, out_dir: Path, log=print) -> None:
    """PNG plots, report.md and report.json in out_dir; the record as the last stdout line."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {}
    for key, draw in PLOTS.items():
        if key in record["records"]:
            path = out_dir / f"{key.replace('_', '-')}.png"
            try:
                draw(record["records"], path)
                plots[key] = str(path)
            except Exception as exc:  # a plot that fails is reported like a benchmark that fails
                record["errors"][f"{key} plot"] = f"{type(exc).__name__}: {exc}"
    md = out_dir / "report.md"
    record["files"] = {"markdown": str(md), "json": str(out_dir / "report.json"), "plots": plots}
    md.write_text(markdown(record, plots))
    log(f"wrote {md} and {len(plots)} plots")
    for t in record["targets"]:
        print(f"target {t['benchmark']}: {t['label']} {t['target']}: measured {_num(t['measured'], t['unit'])} "
              f"-> {t['status']}")
    for name, msg in record["errors"].items():
        print(f"error {name}: {msg}")
    emit(record, out_dir / "report.json")
