"""benchmarks/step_profile.py: the profiler's ops land in the right categories, host time is what no op covers, and
on SmolLM2 every profiled step holds exactly --rows decoding rows (plus the arrivals' prompts in a mixed step)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.bench.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_a_profiled_step_splits_its_wall_time_into_categories_and_host():
    sp = load_script("step_profile")
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step():
        y = torch.add(torch.mm(a, b), 1.0)
        with sp.labelled(sp.SAMPLING_RANGE):
            torch.softmax(y, dim=-1).argmax(-1)
        time.sleep(0.05)  # no op runs: host time
        return 7

    out = sp.profiled_step(step)
    cats, ops = out["categories"], out["ops"]
    assert out["tokens"] == 7
    assert {"aten::mm|projections", "aten::add|norms_elementwise", "aten::_softmax|sampling",
            "aten::argmax|sampling"} <= set(ops)
    assert cats["host"] >= 45.0
    assert sum(cats.values()) == pytest.approx(out["wall_ms"])
    summary = sp.summarize([out, out], [1.0, 3.0], top=2)
    assert summary["wall_ms_unprofiled"]["median"] == 2.0 and len(summary["top_ops"]) == 2
    assert sum(c["share"] for c in summary["categories"].values()) == pytest.approx(1.0, abs=1e-3)
    slow = {**out, "wall_ms": out["wall_ms"] + 100.0, "categories": {**cats, "host": cats["host"] + 100.0}}
    fastest = sp.summarize([slow, out], [1.0], top=1)["fastest"]
    assert fastest["wall_ms"] == pytest.approx(out["wall_ms"], abs=0.01)
    assert fastest["categories"]["host"] == pytest.approx(cats["host"], abs=0.01)


@pytest.mark.parametrize("name, pieces", [("kvtool_cpu::attend", "attention"), ("_C::onednn_mm", "projections"),
                                          ("mkldnn::_linear_pointwise", "projections"),
                                          ("_C::cpu_attn_reshape_and_cache", "attention"),
                                          ("kvtool_cpu::silu_mul", "norms_elementwise"),
                                          ("kvtool_cpu::layers", "whole_layers"), ("aten::empty", "other_ops")])
def test_op_names_fall_in_their_category(name, pieces):
    assert load_script("step_profile").category(name, in_sampling=False) == pieces


@pytest.mark.real_model
def test_every_profiled_step_holds_the_decoding_rows_and_the_arrivals(tmp_path):
    out = tmp_path / "record.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--sides", "kvtool-fp32",
                          "kvtool-int4", "--settle-s", "0", "--rows", "3", "--prompt", "16", "--arrivals", "2",
                          "--steps", "2", "--top", "3", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert record == json.loads(out.read_text())
    assert [(side["side"], side["weights"]) for side in record["runs"]] == [("kvtool-fp32", "dense"),
                                                                              ("kvtool-int4", "int4")]
    for side in record["runs"]:
        assert side["decode"]["tokens"] == [3, 3] and side["mixed"]["tokens"] == [3 + 2 * 16] * 2
        assert side["engine"] == "kvtool" and side["torch_threads"] == 2
