"""The roofline of `kvtool bench peers`: the byte and FLOP formulas against SmolLM2-135M's figures worked out by
hand, each row's limit and fraction, the report's lines with and without a machine measurement, and the probe."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pytest

from kvtool.bench.peers import roofline
from kvtool.bench.peers.config import PeersConfig
from kvtool.bench.peers.report import _roofline_md
from kvtool.bench.results_peers import peer_table, quiet_block, ratio_block
from kvtool.models.spec import ModelSpec

# SmolLM2-135M's config.json, the fields the formulas read
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": True, "rope_theta": 100000.0}
PROJECTIONS = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)  # q, o; k, v; gate, up, down
HEAD = 49152 * 576


def smollm2_shape() -> roofline.Shape:
    return roofline.Shape.from_spec(ModelSpec.from_hf_config(SMOLLM2))


def test_smollm2_bytes_and_flops_by_hand():
    shape = smollm2_shape()
    assert (shape.projection_params, shape.head_params) == (PROJECTIONS, HEAD) == (106_168_320, 28_311_552)
    assert roofline.dense_reads(shape, 4) == (537_919_488, 0)  # fp32: 4 bytes a weight
    assert roofline.dense_reads(shape, 2) == (268_959_744, 0)
    # int4 at one row: 4-bit codes + a bf16 scale and zero per 32 (5 bits a weight), the head in 8 bits + an fp32
    # scale per 32 (9 bits), and 64 fp32 head rows recomputed per row
    assert roofline.int4_reads(shape, 1, "bf16") == (PROJECTIONS * 5 // 8 + HEAD * 9 // 8, 64 * 576 * 4)
    assert roofline.int4_reads(shape, 1, "bf16") == (98_205_696, 147_456)
    assert roofline.int4_reads(shape, 8, "bf16") == (268_959_744, 0)  # many rows: the bf16 oneDNN copy
    assert roofline.int4_reads(shape, 8, "fp32") == (537_919_488, 0)
    assert roofline.int4_reads(shape, 4, "fp32")[1] == 147_456  # AVX2: the int4 kernel up to 4 rows
    assert shape.kv_bytes(160, 4) == 2 * 30 * 3 * 64 * 4 * 160 == 7_372_800
    assert shape.prefill_flops(512) == 2 * PROJECTIONS * 512 + 2 * HEAD + 2 * 30 * 9 * 64 * 512 ** 2


def test_a_sliding_window_layer_reads_at_most_its_window():
    shape = roofline.Shape(layers=4, heads=1, kv_heads=1, head_dim=2, hidden=2, projection_params=0, head_params=0,
                           window_layers=2, window=10)
    assert shape.kv_bytes(100, 2) == 2 * (2 * 100 + 2 * 10) * 1 * 2 * 2


def _summary(x):
    return {"median": x, "min": x, "max": x, "stdev": 0.0, "n": 1, "runs": [x]}


def record(measured: bool) -> dict:
    shape = smollm2_shape()
    rec = {"model": "SmolLM2", "device": "cpu", "date": "2026-12-07 10:00:00 UTC", "threads": 1, "quiet": False,
           "command": "kvtool bench peers", "load": {"min": 0.5, "max": 2.5, "cores": 2},
           "config": asdict(PeersConfig(streams=[8], ttft_lengths=[512], workloads=["decode", "ttft", "streams"],
                                        threads=[1])),  # 32-token prompt, 256 decoded; streams of up to 32 + 128
           "engines": {"kvtool": {"status": "ok", "weights": "fp32", "results": {
               "decode_tok_s": _summary(20.0), "ttft_ms_512": _summary(1000.0),
               "streams_8": {"tok_s": _summary(100.0)}}}, "vllm": {"status": "missing", "reason": "not installed"}}}
    if measured:
        machine = {"threads": 1, "bandwidth_gb_s": 20.0, "gemm_gflop_s": {"fp32": 200.0, "bf16": 400.0},
                   "buffer_mib": 512, "gemm_size": 2048, "passes": 5, "load_1min": 0.5}
        reads = {"reads": {"1": [537_919_488, 0], "8": [537_919_488, 0]}, "kv_element": 4, "gemm": "fp32",
                 "source": "fp32 projections and head"}
        rec["roofline"] = {"machine": machine, "shape": asdict(shape), "engines": {"kvtool": reads}}
    return rec


def test_each_row_against_its_limit_by_hand():
    rows = {r["row"]: r for r in roofline.roofline_rows(record(True))}
    assert set(rows) == {"decode bs=1", "8 streams", "cold TTFT @512"}  # no row for an engine that did not run
    # bs=1 at a mean context of 32 + 256 / 2 tokens: every weight and 160 tokens of fp32 KV a token
    per_token = 537_919_488 + 2 * 30 * 3 * 64 * 4 * 160
    assert rows["decode bs=1"]["bytes_per_token"] == per_token
    assert rows["decode bs=1"]["limit_tok_s"] == pytest.approx(20e9 / per_token, abs=0.01)
    assert rows["decode bs=1"]["fraction"] == pytest.approx(20.0 / (20e9 / per_token), abs=1e-3)
    # 8 rows share one read of the weights; a stream's prompt is 3/4 of 32 tokens on average, plus half its 128
    streams = 537_919_488 / 8 + 2 * 30 * 3 * 64 * 4 * (24 + 64)
    assert rows["8 streams"]["limit_tok_s"] == pytest.approx(20e9 / streams, abs=0.01)
    flops = smollm2_shape().prefill_flops(512)
    assert rows["cold TTFT @512"]["gflop_s"] == pytest.approx(flops / 1.0 / 1e9, abs=0.01)
    assert rows["cold TTFT @512"]["fraction"] == pytest.approx(flops / 1e9 / 200.0, abs=1e-3)


def test_the_report_says_not_measured_without_the_machine():
    old = record(False)
    assert roofline.roofline_rows(old) is None
    assert _roofline_md(old) == ["Roofline: not measured (the record has no machine measurement)."]
    failed = {**old, "roofline": {"error": "RuntimeError: no oneDNN"}}
    assert roofline.summary(failed) == "not measured (RuntimeError: no oneDNN)"
    assert not any("Roofline" in line for line in peer_table(Path("old/report.json"), old, "old/report.json"))


def test_the_report_and_the_readme_give_each_fraction():
    rec = record(True)
    md = "\n".join(_roofline_md(rec))
    assert "20.0 GB/s" in md and "| kvtool | decode bs=1 | 545.3 MB | 36.7 tok/s | 20.0 tok/s | 55% |" in md
    assert "| kvtool | cold TTFT @512 | 117.83 GFLOP | 200.0 GFLOP/s (fp32) | 117.8 GFLOP/s | 59% |" in md
    line = roofline.summary(rec)
    assert line.startswith("20.0 GB/s read, GEMM peak fp32 200, bf16 400 GFLOP/s at 1 thread: ")
    assert line.endswith(": kvtool: decode bs=1 55% of 37 tok/s, 8 streams 36% of 281 tok/s, cold TTFT @512 59% of "
                         "the fp32 peak")
    # the README: the newest measured record, noisy or not, with its load; an older one without it does not count
    old = {**record(False), "date": "2026-12-06 10:00:00 UTC", "quiet": True}
    readme = Path("README.md").resolve()
    peers = [(readme.parent / "a/peers-old/report.json", old), (readme.parent / "a/peers-new/report.json", rec)]
    [roof] = [x for x in ratio_block(peers) if x.startswith("Roofline")]
    lines = quiet_block(peers, readme)  # the figures and the commands
    assert roof.startswith("Roofline of peers-new (SmolLM2, 1 thread, noisy, load 0.50-2.50 on 2 cores;")
    assert line in roof
    assert any(x.startswith("- peers-new") for x in lines)  # and the command that reproduces it


def test_the_probe_measures_positive_finite_figures():
    m = roofline.measure_machine(1, buffer_mib=4, gemm_size=64, passes=2)
    figures = [m["bandwidth_gb_s"], m["bandwidth_median_gb_s"], *m["gemm_gflop_s"].values()]
    assert set(m["gemm_gflop_s"]) == {"fp32", "bf16"} and all(math.isfinite(x) and x > 0 for x in figures)
    assert m["threads"] == 1 and m["gemm_kernels"]["fp32"]["matmul"] > 0
    assert m["bandwidth_gb_s"] >= m["bandwidth_median_gb_s"]  # the fastest pass


def test_the_ceiling_is_the_best_of_the_probes():
    first = {"threads": 1, "bandwidth_gb_s": 20.0, "gemm_gflop_s": {"fp32": 90.0, "bf16": 150.0}, "load_1min": 2.9}
    last = {"threads": 1, "bandwidth_gb_s": 25.0, "gemm_gflop_s": {"fp32": 80.0, "bf16": 210.0}, "load_1min": 0.4}
    m = roofline.best_of([first, last])
    assert (m["bandwidth_gb_s"], m["gemm_gflop_s"]) == (25.0, {"fp32": 90.0, "bf16": 210.0})
    assert m["probes"] == [first, last]
    rec = record(True)
    rec["roofline"]["machine"] = {**rec["roofline"]["machine"], "probes": [first, last]}
    assert "probed before the first engine and after the last (load 2.90 and 0.40)" in _roofline_md(rec)[0]
    assert roofline.probe_again({"error": "no probe"}, 1) == {"error": "no probe"}


@pytest.mark.real_model
def test_smollm2_reads_from_its_files():
    from kvtool.bench.peers.harness import model_files

    files = model_files("smollm2", log=lambda s: None)
    cfg = PeersConfig(engines=["kvtool", "kvtool-int4", "llama.cpp", "vllm-bf16"], streams=[8], threads=[1])
    roof = roofline.measure(files, cfg, probe={"buffer_mib": 4, "gemm_size": 64, "passes": 1})
    assert roofline.Shape(**roof["shape"]) == smollm2_shape()  # the converted folder's config.json
    llama = roof["engines"]["llama.cpp"]
    # the GGUF's Q4_1 projections (5 bits a weight), its Q8_0 token embedding as the head (8.5 bits), F32 norms
    assert llama["reads"]["1"] == [PROJECTIONS * 5 // 8 + HEAD * 17 // 16 + (30 * 2 + 1) * 576 * 4, 0]
    assert llama["source"] == "GGUF tensors (F32, Q4_1, Q8_0; head Q8_0)" and llama["kv_element"] == 2
    assert roof["engines"]["kvtool-int4"]["reads"]["1"] == [98_205_696, 147_456]
    assert roof["engines"]["vllm-bf16"] == {"reads": {"1": [268_959_744, 0], "8": [268_959_744, 0]}, "kv_element": 2,
                                            "gemm": "bf16", "source": "bf16 projections and head"}
    assert roof["machine"]["bandwidth_gb_s"] > 0
