"""`kvtool bench peers` at equal precision: the pairs, the targets' judgement (met, missed, not measured), the
vllm-bf16 peer's command line, the `bench serve` loads' client arguments and the thread counts. No model runs here,
and nothing is timed: the figures are made up."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.bench.peers import engines as peer_engines
from kvtool.bench.peers.config import CLIENT_LOADS, PeersConfig, parse_threads
from kvtool.bench.peers.judge import best, judge, pairs, ratios, targets
from kvtool.bench.peers.report import equal_table, markdown
from kvtool.bench.peers.vllm_client import client_args
from kvtool.errors import InvalidParameterError


def _s(x):
    return {"median": x, "min": x, "max": x, "stdev": 0.0, "n": 1, "runs": [x]}


def _serve(tok_s, tpot, ttft, p90):
    return {"output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft, "p90_ttft_ms": p90,
            "p99_ttft_ms": p90, "p99_tpot_ms": tpot}


def _engine(precision, decode, serve=None):
    results = {"decode_tok_s": _s(decode)}
    if serve:
        for key in ("vllm_bench", "serve_long", "serve_shared"):
            results.update({key: _serve(*serve), f"{key}_command": f"vllm bench serve ({key})"})
    return {"status": "ok", "precision": precision, "weights": precision, "results": results}


def _record(engines):
    cfg = PeersConfig(threads=[2])
    config = {"ttft_lengths": [512], "workloads": ["decode", "vllm-bench", "serve-long", "serve-shared"],
              "client_prompts": 32, "client_prefix_tokens": 1024, "client_input_tokens": 128,
              "client_output_tokens": 64, "client_concurrency": 4,
              "client_loads": {k: vars(v) for k, v in cfg.client_loads.items()}}
    record = {"engines": engines, "config": config, "threads": 2}
    record["ratios"], record["pairs"], record["best"] = ratios(engines), pairs(engines), best(engines)
    record["targets"] = targets(record)
    return record


def test_engines_pair_at_equal_precision_and_best_against_best():
    engines = {"kvtool": _engine("fp32", 30.0, (100.0, 50.0, 1000.0, 1200.0)),
               "kvtool-bf16": _engine("bf16", 40.0, (150.0, 40.0, 800.0, 900.0)),
               "kvtool-int4": _engine("int4", 60.0, (200.0, 30.0, 600.0, 700.0)),
               "llama.cpp": _engine("int4", 80.0, (100.0, 60.0, 1200.0, 1400.0)),
               "vllm": _engine("fp32", 20.0, (80.0, 55.0, 1000.0, 1100.0)),
               "vllm-bf16": _engine("bf16", 50.0, (300.0, 20.0, 400.0, 450.0))}
    record = _record(engines)
    assert [(p["kvtool"], p["peer"], p["precision"]) for p in record["pairs"]] == [
        ("kvtool", "vllm", "fp32"), ("kvtool-bf16", "vllm-bf16", "bf16"), ("kvtool-int4", "llama.cpp", "int4")]
    fp32 = record["pairs"][0]["ratios"]
    assert fp32["serve_long_output_tok_s"] == 1.25 and fp32["serve_long_median_tpot_ms"] == 1.1  # 55 / 50: a time
    # the best of each engine: kvtool-int4's 200 tok/s against vllm-bf16's 300, whatever their precision
    top = record["best"]["vllm"]["serve_long_output_tok_s"]
    assert top == {"ratio": round(200 / 300, 3), "kvtool": "kvtool-int4", "peer": "vllm-bf16"}
    assert record["best"]["llama.cpp"]["decode_tok_s"]["ratio"] == 0.75
    head, rows = equal_table(record)
    assert head[1:] == ["kvtool / vllm, fp32", "kvtool-bf16 / vllm-bf16, bf16", "kvtool-int4 / llama.cpp, int4",
                        "kvtool best / llama.cpp best", "kvtool best / vllm best"]
    assert rows[0] == ["decode bs=1 (tok/s)", "1.50x", "0.80x", "0.75x", "0.75x", "1.20x"]
    assert rows[2][0] == "serve-long: 32 x 0+512 -> 128 tokens, 16 at once"
    assert rows[2][1] == "1.25x, 1.10x, 1.00x, 0.92x"  # output tok/s, TPOT p50, TTFT p50, TTFT p90
    record["config"]["workloads"].remove("decode")
    assert [row[0].split(":")[0] for row in equal_table(record)[1]] == ["vllm-bench", "serve-long", "serve-shared"]


def test_targets_judge_equal_precision_first_met_missed_or_not_measured():
    engines = {"kvtool": _engine("fp32", 30.0, (100.0, 50.0, 1000.0, 1000.0)),
               "kvtool-bf16": _engine("bf16", 40.0, (150.0, 40.0, 800.0, 900.0)),
               "kvtool-int4": _engine("int4", 60.0),  # no `bench serve` figures
               "llama.cpp": _engine("int4", 50.0, (100.0, 60.0, 1200.0, 1400.0)),
               "vllm": _engine("fp32", 20.0, (80.0, 55.0, 1000.0, 1100.0))}  # no vllm-bf16 in this run
    rows = _record(engines)["targets"]
    by = {t["target"]: t for t in rows}
    fp32 = [t for t in rows if t["target"].startswith("kvtool >= 1.0x vllm at fp32")]
    assert [t["status"] for t in fp32] == ["met"] * 3 and fp32[0]["ratio"] == 1.0  # 1.00x on TTFT p50 is met
    bf16 = [t for t in rows if t["target"].startswith("kvtool-bf16 >= 1.0x vllm at bf16")]
    assert [t["status"] for t in bf16] == ["not measured"] * 3 and bf16[0]["ratio"] is None
    assert "no vllm at bf16 ran" in bf16[0]["detail"]
    assert by["kvtool-int4 >= 1.0x llama.cpp at int4: bs=1 TPOT (decode tok/s)"]["status"] == "met"
    int4 = [t for t in rows if t["target"].startswith("kvtool-int4 ") and "bs=1" not in t["target"]]
    assert len(int4) == 3 and {t["status"] for t in int4} == {"not measured"}
    assert rows.index(fp32[0]) == 0 and all(rows.index(t) < 10 for t in bf16 + int4)  # equal precision first
    # one figure behind: missed, whatever else is missing
    engines["vllm"]["results"]["serve_long"]["p90_ttft_ms"] = 900.0
    engines["kvtool"]["results"]["serve_shared"].pop("median_tpot_ms")
    rows = {t["target"].split(": ")[1].split(" ")[0]: t for t in _record(engines)["targets"]
            if t["target"].startswith("kvtool >= 1.0x vllm")}
    assert rows["serve-long"]["status"] == "missed" and rows["serve-long"]["ratio"] == 0.9
    assert rows["serve-long"]["detail"] == "lowest: TTFT p90"
    assert rows["serve-shared"]["status"] == "not measured"
    assert "not measured: TPOT p50" in rows["serve-shared"]["detail"]


def test_a_target_without_figures_is_never_met():
    assert judge("x", {}, {})["status"] == "not measured"
    assert judge("x", {"a": None, "b": 1.5}, {"a": "A", "b": "B"})["status"] == "not measured"
    assert judge("x", {"a": None, "b": 0.5}, {"a": "A", "b": "B"})["status"] == "missed"
    assert judge("x", {"a": 1.0, "b": 2.0}, {"a": "A", "b": "B"}) == {"target": "x", "ratio": 1.0,
                                                                     "detail": "lowest: A", "status": "met"}
    # nothing ran: every target of the report is not measured, none met
    rows = _record({"kvtool": {"status": "failed"}})["targets"]
    assert rows and {t["status"] for t in rows} == {"not measured"}


def test_vllm_bf16_runs_vllm_in_bfloat16_beside_the_fp32_peer(monkeypatch):
    monkeypatch.setattr(peer_engines, "vllm_python", lambda option: "/venv-vllm/bin/python")
    files = peer_engines.ModelFiles("m", None, Path("/models/m"), max_position=8192)
    opts = peer_engines.PeerOptions(threads=2, context=4096, streams=16)
    argv16, env16 = peer_engines.PEERS["vllm-bf16"].command(files, 8000, opts)
    argv32, env32 = peer_engines.PEERS["vllm"].command(files, 8000, opts)
    assert argv16[argv16.index("--dtype") + 1] == "bfloat16" and argv32[argv32.index("--dtype") + 1] == "float32"
    assert [a for a in argv16 if a != "bfloat16"] == [a for a in argv32 if a != "float32"]  # only the dtype differs
    assert env16 == env32 and env16["OMP_NUM_THREADS"] == "2"
    assert peer_engines.PEERS["vllm-bf16"].precision(files, opts) == "bf16"
    assert peer_engines.PEERS["vllm"].precision(files, opts) == "fp32"
    assert peer_engines.PEERS["llama.cpp"].precision(peer_engines.ModelFiles("m", None, Path("/"), "Q4_K_M"),
                                                     opts) == "int4"


def test_the_long_prompt_loads_reach_vllms_client_with_their_sizes():
    cfg = PeersConfig()
    long = client_args(cfg, "serve-long", "http://127.0.0.1:1", "m", "/tok", Path("/r/a.json"))
    shared = client_args(cfg, "serve-shared", "http://127.0.0.1:1", "m", "/tok", Path("/r/a.json"))
    flags = lambda argv, *names: [argv[argv.index(n) + 1] for n in names]  # noqa: E731
    names = ("--num-prompts", "--random-prefix-len", "--random-input-len", "--random-output-len", "--max-concurrency")
    assert flags(long, *names) == ["32", "0", "512", "128", "16"]
    assert flags(shared, *names) == ["24", "1024", "128", "64", "8"]
    assert flags(long, "--request-rate", "--seed", "--temperature") == ["inf", "0", "0"] and "--ignore-eos" in long
    # every server holds the longest load's KV and takes its concurrency
    assert cfg.context() >= 16 * (512 + 128) and cfg.concurrency() >= 16
    assert set(CLIENT_LOADS) <= set(PeersConfig().workloads)


def test_thread_counts_and_the_record_of_each_pass():
    assert parse_threads(["1", "all"]) == list(dict.fromkeys([1, __import__("os").cpu_count()]))
    assert parse_threads([2, "2"]) == [2]
    for bad in (["0"], ["two"], []):
        with pytest.raises(InvalidParameterError, match="--threads"):
            parse_threads(bad)
    with pytest.raises(InvalidParameterError, match="threads"):
        PeersConfig(threads=[]).validate()
    assert PeersConfig(threads=[4]).pass_threads() == 4
    with pytest.raises(ValueError, match="one thread count"):
        PeersConfig(threads=[1, 2]).pass_threads()


def test_the_report_shows_the_equal_precision_table():
    engines = {"kvtool": _engine("fp32", 30.0, (100.0, 50.0, 1000.0, 1000.0)),
               "vllm": _engine("fp32", 20.0, (80.0, 55.0, 1000.0, 1100.0))}
    record = _record(engines)
    record.update(model="m", device="cpu", gguf_type=None, date="2026-12-07", command="kvtool bench peers",
                  versions={"python": "3", "torch": "2", "transformers": "4", "kvtool": "0"}, order=[])
    record["config"].update(quick=False, rounds=2, repeats=1, warmup=1, decode_tokens=16, prefix_tokens=64,
                            suffix_tokens=8, streams=[], stream_tokens=8, stream_prompt_tokens=8, scenarios=[],
                            scenario_requests=1)
    md = markdown(record, {})
    assert "## Equal precision" in md and "| kvtool / vllm, fp32 |" in md.replace("workload | ", "")
    assert "at 2 threads for every engine" in md and "| decode bs=1" in md
    assert "| kvtool >= 1.0x vllm at fp32: serve-long (output tok/s, TPOT p50, TTFT p50, TTFT p90) | 1.00x |" in md
