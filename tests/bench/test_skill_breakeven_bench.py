"""benchmarks/skill_breakeven.py: where composition starts to pay (the break-even rule over measured rows), skills
compiled to the lengths asked for (on vLLM, one of each length per run: same length, other text), only repair none
on vLLM, and a short run on real SmolLM2 whose record names both paths per length."""

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


def test_vllm_is_refused_a_repair_the_connector_cannot_run(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--engine", "vllm", "--repair", "recompute_first_k:k=4"])
    assert "runs only repair none" in capsys.readouterr().err


@pytest.mark.real_model
def test_vllm_runs_get_skills_of_one_length_with_other_text(bench, smollm2, tmp_path):
    catalog = bench.compile_lengths(smollm2, [48], tmp_path, variants=3, warm=True)
    blocks = [catalog.block(bench.variant(48, i)) for i in range(3)]
    assert len({tuple(b.token_ids[-24:]) for b in blocks}) == 3 and "warm" in catalog  # other text, not just names
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 4 and abs(len(blocks[0]) - 48) <= 4, list(map(len, blocks))


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
    assert record["command"].startswith("python benchmarks/skill_breakeven.py --models smollm2 --lengths 32,96")
