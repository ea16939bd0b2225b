"""benchmarks/edit_deciding.py without a model: the seeded case generator, where the cached reasoning is cut, the
screen's confirmation by the evaluation's rows, the claims' arithmetic and the merge of split runs. The edit ways
themselves are kvtool.bench.edit's, which tests/cache/test_edit_real.py runs on real models."""

from __future__ import annotations

import pytest

from tests.bench.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("edit_deciding")


def test_the_generator_is_seeded_and_every_case_has_one_field_whose_edit_flips_the_answer(bench):
    cases = bench.generate(0, 2 * len(bench.SCENARIOS))
    assert cases == bench.generate(0, len(cases)) and cases != bench.generate(1, len(cases))
    assert len({c.name for c in cases}) == len(cases) and {c.kind for c in cases} == {s.kind for s in bench.SCENARIOS}
    for case in cases:
        scenario = next(s for s in bench.SCENARIOS if s.kind == case.kind)
        assert sum("{v}" in line for line in case.facts) == 1 and case.old != case.new
        assert {case.old, case.new} == set(scenario.values) and case.answers[0] != case.answers[1]
        assert dict(zip(scenario.values, scenario.answers)) == {case.old: case.answers[0], case.new: case.answers[1]}
        text = case.messages(case.old)[1]["content"]
        lo, hi = case.field_span(text)
        assert text[lo:hi] == case.old and case.messages(case.new)[1]["content"] == text[:lo] + case.new + text[hi:]
    turned = {c.kind for c in cases if c.old != next(s for s in bench.SCENARIOS if s.kind == c.kind).values[0]}
    assert turned and turned != {c.kind for c in cases}  # both directions of the edit occur


def test_kinds_pick_scenarios_and_an_unknown_kind_is_refused(bench):
    picks = bench.generate(0, 30, ["picks"])
    assert picks and all(set(c.answers) != {"yes", "no"} for c in picks)
    assert {c.kind for c in bench.generate(0, 4, ["store", "seat"])} == {"store", "seat"}
    with pytest.raises(ValueError, match="no scenario of kinds"):
        bench.generate(0, 4, ["nope"])


def _routing(bench):
    return next(c for c in bench.generate(0, 20) if c.kind == "routing")


def test_first_mention_finds_whole_words_of_answers_and_values(bench):
    case = _routing(bench)  # answers red / blue, values urgent / normal
    assert bench.first_mention("The ticket goes to the red team.", case) == len("The ticket goes to the ")
    assert bench.first_mention("The ticket is NORMAL, so blue.", case) == len("The ticket is ")
    assert bench.first_mention("The ticket goes to the", case) is None
    assert bench.first_mention("reddish bluebird", case) is None


class Words:
    """A model whose greedy reasoning is a fixed list of words, one token each."""

    def __init__(self, words):
        self.words = words

    def encode_rendered(self, text):
        return text.split()


@pytest.mark.parametrize("reasoning, most, cut", [
    ("The ticket goes to the red team .", 24, 5),  # cached up to its conclusion, not through it
    ("Red , because it is urgent .", 24, 0),  # it opens with the answer: nothing to cache
    ("Let me look at the rule first and then", 24, 24),  # no conclusion within the span: all of it
    ("The ticket goes to the red team .", 3, 3),
])
def test_the_cached_reasoning_stops_before_it_names_an_answer(bench, monkeypatch, reasoning, most, cut):
    import kvtool.bench.edit as edit

    monkeypatch.setattr(edit, "cached_reasoning", lambda model, case, k: " ".join(model.words[:k]))
    assert bench.reasoning_cut(Words(reasoning.split()), _routing(bench), most) == cut


def _row(case, way, decision, kl=0.0, fraction=0.01, first=1, speedup=1.0, gap=None):
    return {"case": case, "mode": "cached_reasoning", "way": way, "decision": decision, "agree_text": decision == "new",
            "agree_value": decision == "new", "greedy_match_tokens": first, "kl_next": kl, "kl_mean": kl,
            "top1": 1.0, "cos_mean": 1.0, "fraction": fraction, "recomputed": 2, "appended": 0, "partial_equiv": 0.0,
            "context_tokens": 150, "ms": 10.0 / speedup, "speedup": speedup, "gap_closed": gap}


def _case_rows(case, attended="new", field="old", kl=0.01, first=1):
    return [_row(case, "full", "new", fraction=1.0), _row(case, "unedited", "old", kl=1.0, fraction=0.0, gap=0.0),
            _row(case, "field_only", field, kl=0.8, gap=0.2),
            _row(case, "recompute_attended:ratio=0.01", attended, kl=kl, first=first, speedup=0.5, gap=0.99)]


def test_a_case_counts_only_where_the_evaluation_confirms_the_screen(bench):
    assert bench.decided(_case_rows("a"))
    unmoved = [dict(r, decision="old") if r["way"] == "full" else r for r in _case_rows("a")]
    assert not bench.decided(unmoved)
    neither = [dict(r, decision="other") if r["way"] == "unedited" else r for r in _case_rows("a")]
    assert not bench.decided(neither)


def test_the_one_percent_claim_needs_agreement_cost_and_fidelity(bench):
    rows = [r for i in range(10) for r in _case_rows(f"c{i}")]
    c = bench.claims(rows)
    assert c["field_kv_carries"] == {"answer_agreement": 0.0, "gap_closed_median": pytest.approx(0.2)}  # 1 - .8/1
    one = c["one_percent"]
    assert one["holds"] and one["wall_time_vs_full"] == pytest.approx(2.0)
    at = c["ways"]["recompute_attended:ratio=0.01"]
    assert at["answer_agreement"] == 1.0 and at["first_token_agreement"] == 1.0 and at["kl_mean"] == pytest.approx(0.01)
    two_old = [r for i in range(10) for r in _case_rows(f"c{i}", attended="old" if i < 2 else "new")]
    assert not bench.claims(two_old)["one_percent"]["checks"]["answer_agreement"]  # 8 of 10 < 0.9
    one_old = [r for i in range(10) for r in _case_rows(f"c{i}", attended="old" if i < 1 else "new")]
    assert bench.claims(one_old)["one_percent"]["checks"]["answer_agreement"]  # 9 of 10
    high_kl = [r for i in range(10) for r in _case_rows(f"c{i}", kl=0.06)]
    assert bench.claims(high_kl)["one_percent"]["checks"] == {"fraction_recomputed": True, "answer_agreement": True,
                                                              "first_token_agreement": True, "kl_mean": False}
    costly = [dict(r, fraction=0.05) for r in rows]
    assert not bench.claims(costly)["one_percent"]["checks"]["fraction_recomputed"]


def _record(bench, cases, **over):
    rows = [r for c in cases for r in _case_rows(c)]
    return {"model": "m", "dtype": "float32", "budgets": [0.01], "answer_tokens": 8, "reasoning_tokens": 24,
            "cut": True, "cases": len(cases), "rows": rows, "seconds": 1.0, "config": {"first": 0},
            "screen": [{"case": c, "outcome": "deciding", "counted": True} for c in cases], **over}


def test_split_runs_merge_into_one_record_with_its_claims_recomputed(bench):
    merged = bench.merge([_record(bench, ["a", "b"]), _record(bench, ["c"])])
    assert merged["cases"] == 3 and merged["candidates_screened"] == 3
    assert merged["claims"]["ways"]["full"]["cases"] == 3 and merged["verdict"]["cached_reasoning"]["cases"] == 3
    with pytest.raises(ValueError, match="twice"):
        bench.merge([_record(bench, ["a"]), _record(bench, ["a"])])
    with pytest.raises(ValueError, match="budgets"):
        bench.merge([_record(bench, ["a"]), _record(bench, ["b"], budgets=[0.05])])
