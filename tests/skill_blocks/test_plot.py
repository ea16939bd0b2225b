"""The eval plot: one line per strategy and setting, the swept knob along it."""

from kvtool.skills.plot import _lines, plot_eval


def row(repair, strategy, fraction, preamble="deep"):
    return {"repair": repair, "strategy": strategy, "recomputed_fraction": fraction, "top1": 0.9, "cos_mean": 0.99,
            "preamble": preamble}


ROWS = [row("none", "none", 0.0), row("recompute_first_k:k=16", "recompute_first_k", 0.03),
        row("recompute_first_k:k=48", "recompute_first_k", 0.09),
        row("recompute_attended:ratio=0.05,window=64,score=attention_v", "recompute_attended", 0.05),
        row("recompute_attended:ratio=0.1,window=64,score=attention_v", "recompute_attended", 0.1),
        row("recompute_attended:ratio=0.1,window=64,score=attention", "recompute_attended", 0.1)]


def test_lines_split_a_strategy_only_by_the_settings_that_differ():
    lines = _lines(ROWS)
    assert lines["none"] == "none" and lines["recompute_first_k:k=48"] == "recompute_first_k"
    assert lines["recompute_attended:ratio=0.05,window=64,score=attention_v"] == \
        lines["recompute_attended:ratio=0.1,window=64,score=attention_v"] == "recompute_attended score=attention_v"
    assert lines["recompute_attended:ratio=0.1,window=64,score=attention"] == "recompute_attended score=attention"


def test_plot_writes_a_png(tmp_path):
    record = {"repairs": ROWS, "n_greedy": 32, "prefix_tokens": 10, "query_tokens": 5,
              "ttft_scaling": [{"blocks": 1, "block_tokens": 100, "ttft_ms_full": {"median": 9.0},
                                "ttft_ms_none": {"median": 2.0}}]}
    path = plot_eval(record, tmp_path / "sub" / "eval.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
