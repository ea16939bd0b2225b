"""kvtool bench engines: ratios are kvtool over vLLM run by run (rates kvtool/vLLM, times vLLM/kvtool), and
prompts never repeat (a cold TTFT must not hit a cache)."""

from __future__ import annotations

from kvtool.bench.engines import Prompts, ratios
from kvtool.bench.protocol import summary


def test_ratios_say_how_far_kvtool_is_ahead():
    results = {"decode_tok_s_bs1": {"kvtool": summary([20.0, 30.0]), "vllm": summary([10.0, 10.0])},
               "cold_ttft_ms_512": {"kvtool": summary([50.0, 100.0]), "vllm": summary([100.0, 100.0])},
               "prefix_hit_cached_tokens": {"kvtool": 2047, "vllm": 2048},
               "streams_8_ttft_p50_ms": {"kvtool": [1.0], "vllm": [2.0]}}
    out = ratios(results)
    assert set(out) == {"decode_tok_s_bs1", "cold_ttft_ms_512"}
    assert out["decode_tok_s_bs1"]["median"] == 2.5  # 2x and 3x
    assert out["cold_ttft_ms_512"]["min"] == 1.0 and out["cold_ttft_ms_512"]["max"] == 2.0


def test_fresh_prompts_differ_and_stay_in_a_small_vocabulary():
    prompts = Prompts(seed=1)
    a, b = prompts.fresh(512), prompts.fresh(512)
    assert a != b and len(a) == 512 and all(100 <= t < 32000 for t in a + b)
