"""benchmarks/serve_load.py in-process: 16 streaming clients on SmolLM2, no corruption, no 5xx."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


def load_script():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sixteen_concurrent_streams_are_not_corrupted(smol_server, capsys):
    bench = load_script()
    args = bench.parse_args(["--url", smol_server.base_url, "--clients", "16", "--seconds", "15",
                             "--max-tokens", "4", "--solo-runs", "1"])
    record = bench.run(args, smol_server.base_url, {"model": "SmolLM2-135M"})
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record, "JSON record is the last line"
    assert record["server_errors"] == 0 and record["other_errors"] == 0, record["problems"]
    assert record["corrupted"] == 0, record["problems"]
    # every request either completed (same text as its solo run) or was cleanly rejected
    assert record["completed"] + record["rejected"] == record["requests"] and record["completed"] >= 16
    assert record["ttft_p50_ms"] is not None and record["ttft_p99_ms"] >= record["ttft_p50_ms"]
    worker, deadline = smol_server.app.state.worker, time.monotonic() + 10
    while worker.running and time.monotonic() < deadline:  # the last answers can arrive before their release
        time.sleep(0.05)
    assert worker.running == 0
