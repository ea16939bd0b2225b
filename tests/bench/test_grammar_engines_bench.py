"""benchmarks/grammar_engines.py at its smallest size (runs in .venv-vllm, where vLLM brings xgrammar): both
libraries compile and walk the first schemas of the JSONSchemaBench sample, and the record ends stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xgrammar", reason="xgrammar comes with vLLM (.venv-vllm)")
pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_grammar_engine_benchmark_runs(tmp_path):
    out = tmp_path / "grammar.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grammar_engines.py"), "--models", "smollm2",
                           "--limit", "6", "--steps", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record == json.loads(out.read_text())
    row = record["models"]["smollm2"]
    assert row["schemas"] == 6 and row["both_compiled"] <= min(row["llguidance"]["compiled"],
                                                               row["xgrammar"]["compiled"])
    for lib in ("llguidance", "xgrammar"):
        assert row[lib]["compiled"] >= 1 and row[lib]["mask_us"]["n"] >= 1, row[lib]
