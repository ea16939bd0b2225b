"""benchmarks/results/README.md and the project README's peer table, regenerated from the JSON records."""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.bench.results_index import BEGIN, END, main, update

ROOT = Path(__file__).resolve().parents[2]


def _summary(x, lo=None, hi=None):
    return {"median": x, "min": x if lo is None else lo, "max": x if hi is None else hi, "stdev": 0.0, "n": 2,
            "runs": [x, x]}


def _peers(date: str, decode: float, quiet: bool | None, workloads=("memory", "decode", "ttft", "prefix", "streams",
                                                                      "layouts")) -> dict:
    results = {"decode_tok_s": _summary(decode, decode - 1, decode + 2), "ttft_ms_512": _summary(900.0),
               "prefix_hit_ms": _summary(150.0), "prefix_cached_tokens": 2048, "prefix_prompt_tokens": 2112,
               "streams_8": {"tok_s": _summary(90.0), "itl_ms_p99": 120.0}, "memory": {"rss_mib": 700.0, "processes": 1},
               "layouts": {"shared-prefix": {"hit_rate_after_first": 0.9}, "timestamp": {"hit_rate_after_first": 0.1}}}
    row = {"status": "ok", "weights": "fp32 dense", "results": results, "load_avg": [1.5, 1.9],
           "spread": {"memory.rss_mib": {"min": 690.0, "max": 720.0, "n": 2}}}
    record = {"benchmark": "peers", "model": "SmolLM2", "device": "Xeon x2", "date": date, "threads": 2,
              "command": f"kvtool bench peers --model smollm2 --decode-tokens {int(decode)}",
              "config": {"decode_tokens": 256, "ttft_lengths": [512], "prefix_tokens": 2048, "suffix_tokens": 64,
                         "streams": [8], "stream_tokens": 128, "rounds": 2, "workloads": list(workloads)},
              "engines": {"kvtool": row, "kvtool-int4": {**row, "weights": "int4"},
                          "llama.cpp": {"status": "missing", "weights": "GGUF Q4_1"}},
              "load": {"cores": 2, "min": 1.5, "max": 1.9 if quiet else 3.4, "samples": 9},
              "targets": [{"target": "decode", "ratio": 0.8, "status": "missed"}]}
    if quiet is not None:
        record["quiet"] = quiet
    return record


def _write(folder: Path, name: str, record: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(record))


def test_the_readme_shows_the_latest_quiet_record_per_model_and_workload(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    _write(results / "peers-smollm2-old", "report.json", _peers("2026-11-01 10:00", 10.0, True))
    _write(results / "peers-smollm2", "report.json", _peers("2026-12-01 08:00:00", 42.0, True, ("decode",)))
    _write(results / "peers-smollm2-noisy", "report.json", _peers("2026-12-03 08:00:00", 99.0, False))
    _write(results / "peers-smollm2-unmarked", "report.json", _peers("2026-12-04 08:00:00", 77.0, None))
    _write(results / "peers-smollm2-quick", "report.json", _peers("2026-12-05 08:00:00", 1.0, True))
    (results / "partial.json").write_text("{}")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{BEGIN}\nstale\n{END}\nafter\n")

    assert main(["--results", str(results), "--readme", str(readme), "--check"]) == 1
    assert sorted(update(results, readme)) == [str(readme), str(results / "README.md")]
    assert update(results, readme, check=True) == []  # now up to date

    index = (results / "README.md").read_text()
    assert "[peers-smollm2/report.json](peers-smollm2/report.json)" in index
    assert "| 42.0 (41.0-44.0) | 42.0 (41.0-44.0) | not run | missing |" in index  # kvtool-int4, -bf16, llama.cpp
    assert index.count("noisy (not in the project README)") == 2  # quiet: false, and no quiet field at all
    assert "quick" not in index
    body = readme.read_text()
    assert body.startswith("# x\n\nbefore\n") and body.endswith(f"{END}\nafter\n") and "stale" not in body
    assert "[benchmarks/results/README.md](benchmarks/results/README.md)" in body.split(BEGIN)[1].split(END)[0]
    table = index.split("## Current figures")[1].split("## Peers")[0]  # the figures behind the README's ratios
    # decode from the newest quiet record; the other workloads only the older quiet record ran
    assert "|  | decode bs=1, 256 tokens (tok/s) | 42.0 (41.0-44.0) | 42.0 (41.0-44.0) | not run | missing |" in table
    assert "| SmolLM2, 2 threads | RSS after one request (MiB) | 700 (690-720) |" in table
    assert "| cold TTFT @512 (ms) | 900 | 900 | not run | missing |" in table and "10.0 (9.00-12.0)" not in table
    assert "99.0" not in table and "77.0" not in table  # noisy records stay out
    assert "`kvtool bench peers --model smollm2 --decode-tokens 42`" in table
    assert "`kvtool bench peers --model smollm2 --decode-tokens 10`" in table
    assert "load 1.50-1.90 on 2 cores" in table


def test_a_record_of_other_stream_counts_keeps_the_older_counts_in_the_readme(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    _write(results / "peers-8", "report.json", _peers("2026-11-01 10:00", 10.0, True, ("streams",)))
    newer = _peers("2026-12-01 08:00", 10.0, True, ("streams",))
    newer["config"]["streams"] = [16, 64]
    for row in (newer["engines"]["kvtool"], newer["engines"]["kvtool-int4"]):
        row["results"] = {**row["results"], "streams_16": {"tok_s": _summary(70.0)},
                          "streams_64": {"tok_s": _summary(85.0)}}
    _write(results / "peers-16-64", "report.json", newer)
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    update(results, readme)
    table = (results / "README.md").read_text()
    assert "| 8 streams x 128 (tok/s) | 90.0 | 90.0 | not run | missing | not run | not run | not run | [peers-8]" \
        in table
    assert "|  | 16 streams x 128 (tok/s) | 70.0 |" in table and "|  | 64 streams x 128 (tok/s) | 85.0 |" in table


def test_a_record_of_other_engines_keeps_the_older_engines_figures_until_a_record_runs_them_all(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    both = _peers("2026-11-01 10:00", 10.0, True, ("decode",))
    _write(results / "peers-both", "report.json", both)
    int4_only = _peers("2026-12-01 08:00", 30.0, True, ("decode",))
    int4_only["engines"]["kvtool"] = {"status": "missing"}
    _write(results / "peers-int4", "report.json", int4_only)
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    update(results, readme)
    table = (results / "README.md").read_text().split("## Peers")[0]
    # the newer record ran kvtool-int4 alone: both rows stay, each its own record's
    assert "| 10.0 (9.00-12.0) | 10.0 (9.00-12.0) | not run | missing |" in table and "[peers-both]" in table
    assert "| missing | 30.0 (29.0-32.0) | not run | missing |" in table and "[peers-int4]" in table
    _write(results / "peers-all", "report.json", _peers("2026-12-02 08:00", 50.0, True, ("decode",)))
    update(results, readme)
    table = (results / "README.md").read_text().split("## Peers")[0]
    assert "[peers-all]" in table and "[peers-both]" not in table and "[peers-int4]" not in table


def test_each_thread_count_keeps_its_rows_and_its_ratios_at_equal_precision(tmp_path):
    from kvtool.bench.peers.judge import best, pairs

    results = tmp_path / "benchmarks" / "results"
    for threads, decode in ((1, 10.0), (2, 18.0)):
        rec = _peers(f"2026-12-0{threads} 08:00", decode, True, ("decode",))
        rec["threads"] = threads
        kvtool = rec["engines"]["kvtool"] = {**rec["engines"]["kvtool"], "precision": "fp32"}
        kvtool["results"] = {"decode_tok_s": kvtool["results"]["decode_tok_s"]}
        rec["engines"]["kvtool-int4"] = {"status": "missing"}
        rec["engines"]["vllm"] = {**rec["engines"]["kvtool"], "results": {"decode_tok_s": _summary(decode / 2)}}
        rec["pairs"], rec["best"] = pairs(rec["engines"]), best(rec["engines"])
        _write(results / f"peers-{threads}t", "report.json", rec)
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    update(results, readme)
    figures, table = (results / "README.md").read_text(), readme.read_text()
    # the newer 2-thread record does not hide the 1-thread one: like is compared with like
    assert "| SmolLM2, 1 thread | decode bs=1, 256 tokens (tok/s) | 10.0 (9.00-12.0) |" in figures
    assert "| SmolLM2, 2 threads | decode bs=1, 256 tokens (tok/s) | 18.0 (17.0-20.0) |" in figures
    assert "peers-1t (SmolLM2, 1 thread):" in table and "10.0 (9.00-12.0)" not in table  # the README: ratios
    assert "| workload | kvtool / vllm, fp32 | kvtool best / vllm best |" in table
    assert table.count("| decode bs=1 (tok/s) | 2.00x | 2.00x |") == 2


def test_without_a_quiet_record_the_readme_says_so(tmp_path):
    results = tmp_path / "results"
    _write(results / "peers-a", "report.json", _peers("2026-12-03 08:00:00", 99.0, False))
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    update(results, readme)
    assert "no quiet `kvtool bench peers` record yet: the 1 recorded here are noisy" in readme.read_text()


def test_the_committed_results_readme_is_up_to_date():
    assert update(ROOT / "benchmarks" / "results", ROOT / "README.md", check=True) == []
