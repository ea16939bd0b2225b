"""benchmarks/skills_load.py: the dataset vLLM's client reads (parsed by vLLM's own dataset class and parser where
the vLLM environment exists), the token-share and fidelity arithmetic on hand-made inputs, and one tiny real run of
the three modes on SmolLM2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's client lives in .venv-vllm")


@pytest.fixture(scope="module")
def bench():
    return load_script("skills_load")


@needs_vllm
def test_vllm_reads_the_dataset_in_order_and_takes_the_client_arguments(bench, tmp_path):
    prompts = ["<|im_start|>system\nA {x}\n<|im_end|>\n", "second \"quoted\"\nprompt", "third"]
    dataset = bench.write_dataset(tmp_path / "p.jsonl", prompts, 8)
    args = bench.client_args("http://127.0.0.1:1", tmp_path, dataset, 3, 0.25, 8, 7, tmp_path / "r" / "out.json")
    probe = bench.JSONL_READER + ("import json, sys; from vllm.benchmarks.serve import add_cli_args; "
             "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
             "from vllm.benchmarks.datasets.datasets import CustomDataset; "
             "p = FlexibleArgumentParser(); add_cli_args(p); a = p.parse_args(sys.argv[1:]); "
             "d = CustomDataset(dataset_path=a.dataset_path, random_seed=a.seed, disable_shuffle=a.disable_shuffle); "
             "s = d.sample(None, a.num_prompts, skip_chat_template=True); "
             "print(json.dumps({'prompts': [r.prompt for r in s], 'out': a.custom_output_len, "
             "'rate': a.request_rate, 'name': a.dataset_name, 'skip': a.skip_chat_template, "
             "'endpoint': a.endpoint, 'eos': a.ignore_eos}))")
    run = subprocess.run([str(VLLM_PYTHON), "-c", probe, *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"prompts": prompts, "out": 8, "rate": 0.25, "name": "custom", "skip": True,
                   "endpoint": "/v1/completions", "eos": True}


def test_token_shares_from_metrics_and_usage(bench):
    before = bench.metric_totals("# HELP x\nkvtool_prompt_tokens_total 100.0\nkvtool_prompt_cached_tokens_total 40.0\n"
                                 "kvtool_generation_tokens_total 9.0\n")
    after = bench.metric_totals("kvtool_prompt_tokens_total 1100.0\nkvtool_prompt_cached_tokens_total 790.0\n")
    assert before == {"prompt": 100.0, "cached": 40.0}
    assert bench.cached_share(before, after) == 0.75
    assert bench.cached_share(after, after) is None
    usages = [{"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 100, "skill_block_tokens": 850}},
              {"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 0}},
              {"prompt_tokens": 500}]
    assert bench.uncomputed_share(usages) == 0.475


def test_fidelity_counts_agreement_kl_and_identical_answers(bench):
    top = {"A": math.log(0.6), "B": math.log(0.3), "C": math.log(0.1)}
    assert bench.top_kl(top, top) == pytest.approx(0.0, abs=1e-12)
    assert bench.top_kl(top, {k: v - 5.0 for k, v in top.items()}) == pytest.approx(0.0, abs=1e-12)  # renormalised
    shifted = {"A": math.log(0.3), "B": math.log(0.6)}  # C missing: it takes the floor, log(0.3)
    p, q = [0.6, 0.3, 0.1], [0.25, 0.5, 0.25]
    assert bench.top_kl(top, shifted) == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)))
    ref = [{"text": " yes it is", "first": " yes", "top": top}, {"text": " no", "first": " no", "top": top}]
    got = [{"text": " yes it is", "first": " yes", "top": top}, {"text": " nope", "first": " nope", "top": shifted}]
    out = bench.fidelity(ref, got)
    assert out["first_token_agreement"] == 0.5 and out["greedy_identical"] == 0.5
    assert out["kl_top20_mean"] == pytest.approx(bench.top_kl(top, shifted) / 2, abs=1e-5)


@pytest.mark.real_model
@pytest.mark.slow
@needs_vllm
def test_three_modes_under_load_on_both_engines_on_smollm2(tmp_path):
    out = tmp_path / "record.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "skills_load.py"), "--model", "smollm2",
                          "--engines", "kvtool", "vllm", "--requests", "2", "--rates", "4", "--skills", "2",
                          "--most-skills", "2", "--output-tokens", "4", "--vllm-kv-gib", "1",
                          "--vllm-python", str(VLLM_PYTHON), "--plot", str(tmp_path / "p90.png"), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert record == json.loads(out.read_text()) and (tmp_path / "p90.png").stat().st_size > 0
    assert set(record["engines"]) == {"kvtool", "vllm"} and len(record["loadavg_end"]) == 3
    for engine in record["engines"].values():
        modes = engine["modes"]
        assert set(modes) == {"cold", "prefix", "compose"}
        for mode in modes.values():
            row = mode["rates"]["4.0"]
            assert row["completed"] == 2 and row["ttft_ms_p50"] <= row["ttft_ms_p90"] <= row["ttft_ms_p99"]
        assert modes["cold"]["uncomputed_share"] == 0 and modes["cold"]["rates"]["4.0"]["prefix_cached_share"] == 0
        # the blocks serve most of every prompt (kvtool counts them as skill_block_tokens, vLLM as cached tokens)
        assert modes["compose"]["uncomputed_share"] > max(0.5, modes["prefix"]["uncomputed_share"])
        assert modes["prefix"]["fidelity"]["first_token_agreement"] == 1.0  # a prefix hit is the same computation
        assert 0 <= modes["compose"]["fidelity"]["kl_top20_mean"]
        assert {"4.0"} == set(engine["p90_speedup_compose_vs_cold"]) == set(engine["p90_speedup_compose_vs_prefix"])
