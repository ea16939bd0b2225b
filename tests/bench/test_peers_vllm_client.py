"""vLLM's own benchmark client (`vllm bench serve`) as a `kvtool bench peers` workload, at smoke size, against
`kvtool serve` on SmolLM2, with the memory row measured on the same server. Runs in the vLLM environment (where
the client lives); skips elsewhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtool.bench.peers import PeersConfig
from kvtool.bench.peers.vllm_client import client_args, parse_result

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_every_engine_gets_the_same_prompts_and_only_its_own_address():
    cfg = PeersConfig(quick=True).sized()
    a = client_args(cfg, "vllm-bench", "http://127.0.0.1:1", "m1", "/tok", Path("/r/a.json"))
    b = client_args(cfg, "vllm-bench", "http://127.0.0.1:2", "m2", "/tok", Path("/r/b.json"))
    differ = {x for x, y in zip(a, b) if x != y}
    assert differ == {"http://127.0.0.1:1", "m1", "a.json"}
    for flag, value in (("--dataset-name", "random"), ("--random-prefix-len", "64"), ("--seed", "0"),
                        ("--temperature", "0"), ("--num-prompts", "4")):
        assert a[a.index(flag) + 1] == value
    assert "--ignore-eos" in a and "--save-result" in a


def test_a_result_without_the_figures_is_refused():
    with pytest.raises(ValueError, match="not a `vllm bench serve` result"):
        parse_result({"date": "20261203"})
    out = parse_result({"completed": 4, "output_throughput": 2.5, "median_ttft_ms": 10.0, "p99_tpot_ms": 3.0,
                        "errors": ["", "boom", ""], "ttfts": [0.1] * 4})
    assert out == {"completed": 4, "output_throughput": 2.5, "median_ttft_ms": 10.0, "p99_tpot_ms": 3.0, "errors": 1}


def test_vllm_client_and_memory_row_against_kvtool_serve_on_smollm2(tmp_path):
    pytest.importorskip("vllm", reason="vLLM's client lives in the vLLM environment (.venv-vllm)")
    from kvtool.bench.peers.harness import model_files, run_server_peer

    cfg = PeersConfig(model="smollm2", engines=["kvtool"], workloads=["memory", "vllm-bench", "serve-shared"],
                      quick=True, threads=[2], vllm_python=sys.executable).validate().sized()
    files = model_files(cfg.model, lambda s: None)
    row = run_server_peer("kvtool", files, cfg, tmp_path, lambda s: None, label="kvtool-round1")
    assert row["status"] == "ok", row.get("reason")
    assert row["unsupported"] == {}, row["unsupported"]
    r = row["results"]
    bench = r["vllm_bench"]
    assert bench["completed"] == cfg.client_prompts and bench["errors"] == 0
    # every prompt: the shared prefix and its random tokens in, exactly the requested tokens out (ignore_eos)
    assert bench["total_input_tokens"] == cfg.client_prompts * (cfg.client_prefix_tokens + cfg.client_input_tokens)
    assert bench["total_output_tokens"] == cfg.client_prompts * cfg.client_output_tokens
    assert bench["output_throughput"] > 0 and 0 < bench["median_ttft_ms"] <= bench["p99_ttft_ms"]
    assert 0 < bench["median_tpot_ms"] <= bench["p99_tpot_ms"]
    saved = json.loads(Path(r["vllm_bench_file"]).read_text())
    assert saved["completed"] == bench["completed"] and saved["output_throughput"] == bench["output_throughput"]
    assert r["vllm_bench_command"].startswith("vllm bench serve --backend openai")
    assert "--random-prefix-len 64" in r["vllm_bench_command"]
    # serve-shared at its own sizes (smoke: 4 requests of 64 shared + 16 random tokens, 8 out, 2 at once)
    shared, load = r["serve_shared"], cfg.client_loads["serve-shared"]
    assert shared["completed"] == load.prompts and shared["max_concurrency"] == load.concurrency == 2
    assert shared["total_input_tokens"] == load.prompts * (load.prefix_tokens + load.input_tokens)
    assert shared["total_output_tokens"] == load.prompts * load.output_tokens
    assert Path(r["serve_shared_file"]).parent.name == "serve-shared"
    # the server tree's resident memory holds at least SmolLM2's fp32 weights (135M parameters)
    assert r["memory"]["rss_mib"] > 135e6 * 4 / 2**20 and r["memory"]["processes"] >= 1
    assert row["budgets"] == {"kv": f"{cfg.kv_mib} MiB (--kv-bytes)",
                              "prefix_cache": f"{cfg.prefix_cache_mib} MiB (--cache-bytes)"}
    assert f"--kv-bytes {cfg.kv_mib << 20}" in row["command"]


def test_vllm_bf16_serves_the_long_prompt_load_in_bfloat16_on_smollm2(tmp_path):
    pytest.importorskip("vllm", reason="vLLM's server lives in the vLLM environment (.venv-vllm)")
    from kvtool.bench.peers.harness import model_files, run_server_peer

    cfg = PeersConfig(model="smollm2", engines=["vllm-bf16"], workloads=["serve-long"], quick=True, threads=[1],
                      vllm_python=sys.executable).validate().sized()
    files = model_files(cfg.model, lambda s: None)
    row = run_server_peer("vllm-bf16", files, cfg, tmp_path, lambda s: None, label="vllm-bf16-round1")
    assert row["status"] == "ok", row.get("reason")
    assert row["precision"] == "bf16" and row["weights"] == "bfloat16" and "--dtype bfloat16" in row["command"]
    assert "dtype=torch.bfloat16" in Path(row["log"]).read_text()  # what vLLM itself says it loaded
    bench, load = row["results"]["serve_long"], cfg.client_loads["serve-long"]
    assert bench["completed"] == load.prompts and bench["errors"] == 0
    assert bench["total_input_tokens"] == load.prompts * load.input_tokens  # no shared prefix
    assert bench["total_output_tokens"] == load.prompts * load.output_tokens
    assert f"--max-concurrency {load.concurrency}" in row["results"]["serve_long_command"]
