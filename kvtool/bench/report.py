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
from kvtool.bench.decode import DecodeBenchConfig, variant_of
from kvtool.bench.prefix import PrefixBenchConfig
from kvtool.bench.protocol import device_name, emit, portable, versions
from kvtool.bench.report_md import _num, markdown
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
