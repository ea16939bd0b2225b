"""Every standalone benchmark script still runs: each at its smallest size, in its own process, on the real test
models, ending in one JSON record (the scripts that wrap `kvtool bench` are covered with those commands)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "json_mode.py": ["--models", "smollm2", "--repeats", "1", "--max-tokens", "6"],
    "choices.py": ["--n", "2", "--prompt-words", "20", "--max-tokens", "3", "--repeats", "1"],
    "shared_prefix.py": ["--requests", "2", "--system-words", "30", "--max-tokens", "3", "--repeats", "1"],
    "agent_dispatch.py": ["--runs", "1"],
    "rope_kernel.py": ["--layers", "2", "--tokens", "64", "--iters", "2", "--device", "cpu"],
    "viz_8k.py": ["--tokens", "96", "--layer", "2", "--plot", "{tmp}/viz_8k.png"],
    "viz_experiments.py": ["--models", "smollm2", "--needle-context", "120", "--depths", "0,1", "--trials", "1",
                           "--generate", "3", "--plots", "{tmp}/viz"],
    "agent_eval.py": ["--cases", "1", "--turns", "2", "--max-tokens", "12"],
    "server_cost.py": ["--contexts", "16", "--tokens", "4", "--repeats", "1", "--warmup", "0"],
    "prefill_profile.py": ["--prefix", "64", "--tokens", "8", "--repeats", "1", "--top", "3"],
    "chunk_attention.py": ["--prefix", "16", "--tokens", "4", "--repeats", "1"],
    "decode_products.py": ["--rows", "1", "3", "--repeats", "1"],
    "decode_products.py --weights int4": ["--weights", "int4", "--rows", "5", "--repeats", "1"],
    "skills_repair_cost.py": ["--requests", "1", "--rounds", "1", "--most", "2"],
    "prefix_blocks.py": ["--prefix", "32", "--suffix", "4", "--rows", "2", "--steps", "1", "--repeats", "1"],
}

NO_OUT = {"agent_dispatch.py"}  # prints its record only


@pytest.mark.real_model
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_script_runs_and_ends_in_a_json_record(script, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in SCRIPTS[script]]
    out = tmp_path / "record.json"
    if script not in NO_OUT:
        args += ["--out", str(out)]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script.split()[0]), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # a key may name a variant after the file
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert record and (script in NO_OUT or json.loads(out.read_text()) == record)
