"""Field edits on the real models (SmolLM2, Qwen2.5-Coder) at smoke size: the cases resolve in place, the
report runs with and without reasoning, a whole-budget repair is the full recompute, and a generated case that
the edit decides (benchmarks/edit_deciding.py) is kept and confirmed."""

import pytest
import torch

from kvtool.bench.edit import plot_records, run_edit_eval
from kvtool.bench.edit_cases import CASES, SMOKE, by_name
from kvtool.skills.edit import EditInputError, apply_edit, plan_edit

pytestmark = pytest.mark.real_model

MODELS = ["smollm2", "qwen25"]


@pytest.mark.parametrize("name", MODELS)
def test_every_case_is_an_in_place_edit_of_one_field(request, name):
    model = request.getfixturevalue(name)
    assert len(CASES) >= 20 and len({c.name for c in CASES}) == len(CASES)
    assert {"city", "date", "count", "limit", "tool_arg"} <= {c.kind for c in CASES}
    for case in CASES:
        text = model.render(case.messages(case.old), add_generation_prompt=False)
        edit = plan_edit(model, text, case.field_span(text), case.new)
        assert edit.in_place, case.name
        assert model.decode(edit.old_ids[edit.start : edit.end]).strip() == case.old, case.name
        assert edit.new_ids == model.encode_chat(case.messages(case.new), add_generation_prompt=False)


@pytest.mark.parametrize("name", MODELS)
def test_a_value_of_another_length_is_refused_and_the_cache_kept(request, name):
    model = request.getfixturevalue(name)
    case = CASES[0]
    text = model.render(case.messages(case.old), add_generation_prompt=False)
    edit = plan_edit(model, text, case.field_span(text), "San Francisco de Quito")
    cache = model.runner.new_cache(len(edit.old_ids) + 1)
    model.runner.prefill(edit.old_ids, cache, logits="none")
    before = cache.state()
    with pytest.raises(EditInputError, match="erratum"):
        apply_edit(model.runner, cache, edit, "field_only")
    assert all(torch.equal(before[k], v) for k, v in cache.state().items()) and cache.offset == len(edit.old_ids)
    with pytest.raises(EditInputError, match="outside the context"):
        plan_edit(model, text, (len(text) - 2, len(text) + 5), "x")


@pytest.mark.parametrize("name", MODELS)
def test_the_report_runs_with_and_without_reasoning(request, name, tmp_path):
    model = request.getfixturevalue(name)
    record = run_edit_eval(model, by_name(SMOKE[:1]), modes=("direct", "reasoning"), budgets=(0.05, 1.0),
                           answer_tokens=4, reasoning_tokens=6,
                           repeats=0, log=lambda _: None)
    rows = record["rows"]
    assert len(rows) == 2 * 8 and {r["mode"] for r in rows} == {"direct", "reasoning"}
    for r in rows:
        if r["way"] == "full":
            assert r["agree_text"] and r["kl_next"] == pytest.approx(0, abs=1e-6) and r["fraction"] == 1.0
        if r["budget"] == 1.0:  # everything after the field recomputed: the full recompute, up to fp32 rounding
            assert r["agree_text"] and r["kl_next"] < 1e-3 and r["top1"] == 1.0, r
        if r["way"] == "field_only":
            assert r["recomputed"] == r["field_tokens"] >= 1
        if r["way"] == "erratum":
            assert r["recomputed"] == 0 and r["appended"] > 5
        assert r["ms"] > 0 and r["answer"] is not None
    assert all(r["reasoning"] for r in rows if r["mode"] == "reasoning")
    summary = record["summary"]["direct"]
    assert summary["recompute_deviation:ratio=0.05"]["fraction_recomputed"] == pytest.approx(
        rows[0]["context_tokens"] and max(rows[0]["field_tokens"], -(-5 * rows[0]["context_tokens"] // 100))
        / rows[0]["context_tokens"])
    assert set(record["verdict"]) == {"direct", "reasoning"}
    png = plot_records([record, record], tmp_path / "edit.png")
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_cached_reasoning_mode_caches_the_reasoning_before_the_edit(request, name):
    model = request.getfixturevalue(name)
    case = by_name(SMOKE[:1])
    record = run_edit_eval(model, case, modes=("cached_reasoning",), budgets=(0.01, 1.0), answer_tokens=4,
                           reasoning_tokens=8, repeats=0, log=lambda _: None)
    rows = record["rows"]
    assert {r["mode"] for r in rows} == {"cached_reasoning"} and len(rows) == 8
    reasoning = rows[0]["cached_reasoning"]
    assert reasoning and all(r["cached_reasoning"] == reasoning for r in rows)
    text = model.render(case[0].messages(case[0].old), add_generation_prompt=False)
    assert rows[0]["context_tokens"] > len(model.encode_rendered(text)) + 4  # the question and reasoning are cached too
    for r in rows:
        if r["way"] == "full":
            assert r["agree_text"] and r["fraction"] == 1.0
        if r["budget"] == 1.0:  # the field and everything after it, the reasoning included, recomputed
            assert r["agree_text"] and r["kl_next"] < 1e-3, r
    at = record["verdict"]["cached_reasoning"]["at_1pct"]
    assert 0 < at["fraction_recomputed"] < 0.2 and at["agreement"] in (0.0, 1.0)
    assert record["verdict"]["cached_reasoning"]["claim_1pct_close_to_full"] == (at["agreement"] >= 0.9)


def test_a_generated_case_the_edit_decides_is_kept_and_confirmed_on_smollm2(smollm2):
    """benchmarks/edit_deciding.py on its first read-back candidate (a store's status, open -> closed): the
    reasoning is cached up to the value, full recompute flips its answer, every way runs and the case counts."""
    from tests.bench.conftest import load_script

    bench = load_script("edit_deciding")
    case = bench.generate(0, 1, ["readback"])[0]
    whole = bench.screen(smollm2, case, 24, 12, cut=False)
    assert bench.first_mention(whole["reasoning"], case) is not None  # uncut, the reasoning names the value
    cut = bench.screen(smollm2, case, 24, 12)
    assert cut["reasoning_tokens"] < 24 and bench.first_mention(cut["reasoning"], case) is None
    assert cut["outcome"] == "deciding", cut
    record = bench.run(smollm2, [case], 1, (0.01,), 24, 12)
    assert record["cases"] == 1 and record["screen"][0]["counted"]
    ways = record["claims"]["ways"]
    assert ways["full"]["answer_agreement"] == 1.0 and ways["unedited"]["follows_old"] == 1.0
    assert ways[bench.ONE_PERCENT]["fraction_recomputed"] < 0.03 and "holds" in record["claims"]["one_percent"]
