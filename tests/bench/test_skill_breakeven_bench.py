"""benchmarks/skill_breakeven.py: where composition starts to pay (the break-even rule over measured rows), skills
compiled to the lengths asked for, and a short run on real SmolLM2 whose record names both paths per length."""

from __future__ import annotations

import json

import pytest

from tests.bench.conftest import load_script



@pytest.fixture(scope="module")
def bench():
    return load_script("skill_breakeven")


def rows(*pairs):
    return [{"block_tokens": n, "speedup": {"median": s}} for n, s in pairs]


def test_break_even_is_the_shortest_length_from_which_composition_always_wins(bench):
    assert bench.break_even(rows((32, 0.6), (64, 0.9), (128, 1.2), (256, 1.5))) == 128
    assert bench.break_even(rows((32, 1.1), (64, 0.9), (128, 1.2))) == 128  # a loss at 64 rules out 32
    assert bench.break_even(rows((32, 0.6), (64, 0.9))) is None
    assert bench.break_even(rows((32, 1.3), (64, 1.4))) == 32


@pytest.mark.real_model
def test_a_short_run_measures_both_paths_per_length(bench, tmp_path, capsys):
    out = tmp_path / "be.json"
    assert bench.main(["--models", "smollm2", "--lengths", "32,96", "--repeats", "1", "--repair", "none",
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    got = record["models"]["smollm2"]["rows"]
    assert [abs(r["block_tokens"] - n) <= 4 for r, n in zip(got, (32, 96))] == [True, True], got
    assert all(r["prefilled_ms"]["n"] == 1 and r["composed_ms"]["n"] == 1 for r in got)
    assert "loadavg_start" in record and "loadavg_end" in record
