"""benchmarks/connector_load.py's pieces that need no vLLM server: the connector's counter read from Prometheus
text, and the summary of alternating runs (medians per mode, the spread, each mode over auto)."""

from __future__ import annotations

import pytest

from tests.bench.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("connector_load")


def test_the_counter_is_summed_over_label_sets_and_nothing_else(bench):
    text = ("# HELP vllm:kvtool_load_ms_total x\nvllm:kvtool_load_ms_total{engine=\"0\"} 12.5\n"
            "vllm:kvtool_load_ms_total{engine=\"1\"} 2.5\nvllm:kvtool_load_ms_created{engine=\"0\"} 9e9\n"
            "vllm:kvtool_load_errors_total{engine=\"0\"} 4\n")
    assert bench.metric_total(text, "vllm:kvtool_load_ms_total") == 15.0


def test_the_summary_takes_medians_per_mode_and_divides_by_auto(bench):
    def run(mode, ttft, tpot):
        return {"mode": mode, "idle_ttft_ms_p50": ttft / 2, "idle_ttft_ms_p90": ttft, "ttft_ms_p50": ttft,
                "ttft_ms_p90": ttft * 2, "tpot_ms_p50": tpot, "tpot_ms_p90": tpot, "tpot_ms_max": tpot * 3,
                "idle_load_ms_per_request": 5.0, "load_ms_per_request": 10.0, "load_share_of_ttft": 0.1}

    out = bench.summarize([run("sync", 100, 90), run("async", 150, 40), run("auto", 120, 30), run("auto", 140, 50),
                           run("async", 170, 60), run("sync", 300, 70)])
    assert out["sync"]["ttft_ms_p50"] == 200 and out["auto"]["tpot_ms_p50"] == 40
    assert out["sync"]["spread"]["tpot_ms_p90"] == [70, 90]
    assert out["ratios_over_auto"]["sync"]["tpot_ms_p50"] == 2.0
    assert out["ratios_over_auto"]["async"]["idle_ttft_ms_p50"] == 1.231 and "auto" not in out["ratios_over_auto"]
