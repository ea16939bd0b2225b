"""benchmarks/results/README.md and the project README's peer table, regenerated from the JSON records."""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.bench.results_index import BEGIN, END, main, update

ROOT = Path(__file__).resolve().parents[2]


def _summary(x):
    return {"median": x, "min": x, "max": x, "stdev": 0.0, "n": 1, "runs": [x]}


def _peers(date: str, decode: float) -> dict:
    results = {"decode_tok_s": _summary(decode), "ttft_ms_512": _summary(900.0), "prefix_hit_ms": _summary(150.0),
               "prefix_cached_tokens": 2048, "prefix_prompt_tokens": 2112,
               "streams_8": {"tok_s": _summary(90.0), "itl_ms_p99": 120.0},
               "layouts": {"shared-prefix": {"hit_rate_after_first": 0.9}, "timestamp": {"hit_rate_after_first": 0.1}}}
    return {"benchmark": "peers", "model": "SmolLM2", "device": "Xeon x2", "date": date,
            "config": {"decode_tokens": 256, "ttft_lengths": [512], "prefix_tokens": 2048, "suffix_tokens": 64,
                       "streams": [8], "stream_tokens": 128},
            "engines": {"kvtool": {"status": "ok", "weights": "fp32 dense", "results": results, "load_avg": [1.5, 2.5]},
                        "kvtool-int4": {"status": "ok", "weights": "int4", "results": results, "load_avg": [2.0, 3.0]},
                        "llama.cpp": {"status": "missing", "weights": "GGUF Q4_1"}},
            "ratios": {"kvtool": {"transformers": {"decode_tok_s": decode / 20, "streams_8_itl_ms_p99": 9.0}},
                       "kvtool-int4": {"transformers": {"decode_tok_s": 1.25, "ttft_ms_512": None}}},
            "targets": [{"target": "decode", "ratio": 0.8, "status": "missed"}]}


def test_latest_record_per_benchmark_with_its_file_and_the_readme_peer_table(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    (results / "peers-smollm2").mkdir(parents=True)
    (results / "peers-smollm2" / "report-20261101-100000.json").write_text(json.dumps(_peers("2026-11-01 10:00", 10.0)))
    (results / "peers-smollm2" / "report.json").write_text(json.dumps(_peers("2026-12-03 08:00:00", 42.0)))
    (results / "peers-smollm2-quick").mkdir()
    (results / "peers-smollm2-quick" / "report.json").write_text(json.dumps(_peers("2026-12-04 08:00:00", 1.0)))
    (results / "partial.json").write_text("{}")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{BEGIN}\nstale\n{END}\nafter\n")

    assert main(["--results", str(results), "--readme", str(readme), "--check"]) == 1
    assert sorted(update(results, readme)) == [str(readme), str(results / "README.md")]
    assert update(results, readme, check=True) == []  # now up to date

    index = (results / "README.md").read_text()
    assert "[peers-smollm2/report.json](peers-smollm2/report.json)" in index
    assert "| 42.0 | 42.0 | missing |" in index  # beside kvtool-int4 and llama.cpp; the newest record only
    assert "quick" not in index and "| 10.0 |" not in index
    body = readme.read_text()
    assert body.startswith("# x\n\nbefore\n") and body.endswith(f"{END}\nafter\n") and "stale" not in body
    # one table of ratios: the better kvtool variant per workload and peer; ITL and missing ratios left out
    assert "SmolLM2, 2026-12-03, load 1.5-3.0 ([peers-smollm2](benchmarks/results/peers-smollm2/report.json))" in body
    assert "| decode bs=1 (tok/s) | - | - | 2.10x (kvtool) |" in body
    assert "ITL" not in body and "TTFT" not in body.split(BEGIN)[1].split("Each cell")[0]
    assert "- peers-smollm2: decode: 0.80x (missed)" in body and "HISTORY" not in body + index


def test_the_committed_results_readme_is_up_to_date():
    assert update(ROOT / "benchmarks" / "results", ROOT / "README.md", check=True) == []
