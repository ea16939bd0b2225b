"""`kvtool bench batching`: stream statistics, counts and greedy agreement on a tiny model, the endpoint client
against a scripted OpenAI stream, and clear errors for bad sizes."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from kvtool.bench.batching import (BatchingBenchConfig, Run, engine_result, format_table, random_prompts,
                                   run_batched, run_batching_bench, run_endpoint)
from kvtool.errors import InvalidParameterError


def test_engine_result_pools_latencies_and_reports_throughput_per_run():
    runs = [Run([[10.0, 20.0, 40.0], [5.0, 6.0]], wall_s=1.0, tokens=5), Run([[8.0, 9.0], [7.0]], 0.5, 3)]
    r = engine_result(runs)
    assert (r["streams"], r["tokens"], r["runs"]) == (2, 5, 2)
    assert r["tok_s"]["median"] == pytest.approx((5 / 1.0 + 3 / 0.5) / 2) and r["tok_s"]["n"] == 2
    gaps = sorted([10.0, 20.0, 1.0, 1.0])  # per stream, never across streams
    assert r["itl_ms_p50"] == pytest.approx((gaps[1] + gaps[2]) / 2)
    assert r["ttft_ms_p50"] == pytest.approx(7.5) and r["ttft_ms_p99"] <= 10.0
    assert engine_result([Run([[3.0]], 1.0, 1)])["itl_ms_p50"] is None  # one token: no gap to report


def test_batched_streams_run_to_length_and_match_sequential_and_transformers(tiny_bench):
    cfg = BatchingBenchConfig(streams=5, new_tokens=6, prompt_tokens=8, repeats=2, sequential_streams=3)
    record = run_batching_bench(tiny_bench, cfg, log=lambda s: None)
    res = record["results"]
    assert set(res) == {"kvtool", "kvtool_sequential", "transformers"}
    assert (res["kvtool"]["streams"], res["kvtool"]["tokens"], res["kvtool"]["runs"]) == (5, 30, 2)
    assert (res["kvtool_sequential"]["streams"], res["kvtool_sequential"]["tokens"]) == (3, 18)
    assert res["transformers"]["tokens"] == 30 and res["transformers"]["tok_s"]["n"] == 2
    # fp32 greedy: continuous batching, one-at-a-time decoding and HF's left-padded batch agree token for token
    assert record["greedy_match"] == {"kvtool_sequential": {"compared": 3, "identical": 3},
                                      "transformers": {"compared": 5, "identical": 5}}
    assert len(record["prompt_lengths"]) == 5 and all(4 <= n <= 8 for n in record["prompt_lengths"])
    for r in res.values():
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"] and 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"]
        # every run makes the same tokens: the fastest run is the shortest one
        assert r["tok_s"]["max"] == pytest.approx(r["tokens"] / r["wall_s"]["min"])
        assert r["tok_s"]["min"] == pytest.approx(r["tokens"] / r["wall_s"]["max"])
    assert record["speedup_vs"]["transformers"] == pytest.approx(
        res["kvtool"]["tok_s"]["median"] / res["transformers"]["tok_s"]["median"])
    assert [t["status"] for t in record["target_checks"]] == ["n/a", "n/a"]  # CPU, and not 64 x 256
    assert "kvtool (batched)" in format_table(record) and "3/3 streams" in format_table(record)
    # the scheduler's own time: prefill, then one step per token after the first
    assert res["kvtool"]["steps"] >= 6 and 0 < res["kvtool"]["host_share"]["max"] < 1
    assert 0 < res["kvtool"]["host_ms_per_step"]["median"] and "kvtool scheduler:" in format_table(record)
    assert "steps" not in res["transformers"]


def test_sampled_streams_run_every_engine_and_compare_no_tokens(tiny_bench):
    cfg = BatchingBenchConfig(streams=4, new_tokens=5, prompt_tokens=6, repeats=1, sequential_streams=2,
                              temperature=0.8)
    record = run_batching_bench(tiny_bench, cfg, log=lambda s: None)
    assert {name: r["tokens"] for name, r in record["results"].items()} == \
        {"kvtool": 20, "kvtool_sequential": 10, "transformers": 20}
    assert record["greedy_match"] == {} and "temperature 0.8" in format_table(record)
    with pytest.raises(InvalidParameterError, match="--temperature"):
        BatchingBenchConfig(temperature=-1).validate()


def test_batched_token_times_grow_within_each_stream(tiny_bench):
    from kvtool.engine import Engine

    prompts = random_prompts(3, 6, tiny_bench.runner.spec.vocab_size, seed=1)
    run = run_batched(Engine(tiny_bench.model), prompts, 5, BatchingBenchConfig(max_running=2, prefill_budget=4))
    assert run.tokens == 15 and [len(t) for t in run.times_ms] == [5, 5, 5]
    assert all(a < b for t in run.times_ms for a, b in zip(t, t[1:]))
    # max_running=2: the third stream waits for a slot, so its first token comes after the others' last ones
    assert run.times_ms[2][0] > min(run.times_ms[0][-1], run.times_ms[1][-1])


def scripted_completions(seen: list, tokens: int = 3):
    lock = threading.Lock()

    def handler(request: httpx.Request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served"}]})
        body = json.loads(request.content)
        with lock:
            seen.append((request.url.path, body))
        events = [{"choices": [{"index": 0, "text": "", "finish_reason": None}]}]  # empty: not a token
        events += [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]} for i in range(tokens)]
        events += [{"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}}]
        lines = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
        return httpx.Response(200, content=iter(lines), headers={"content-type": "text/event-stream"})

    return httpx.Client(base_url="http://stub", transport=httpx.MockTransport(handler))


def test_endpoint_streams_send_the_same_token_prompts_concurrently():
    seen = []
    prompts = [[101, 102], [103], [104, 105, 106]]
    run = run_endpoint(scripted_completions(seen), "http://stub", "served", prompts, 3)
    assert run.tokens == 9 and [len(t) for t in run.times_ms] == [3, 3, 3] and run.wall_s > 0
    assert all(path == "/v1/completions" for path, _ in seen)
    bodies = sorted((b for _, b in seen), key=lambda b: b["prompt"])
    assert [b["prompt"] for b in bodies] == sorted(prompts)
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 3 and b["temperature"] == 0.0
               and b["model"] == "served" for b in bodies)


def test_a_failing_endpoint_is_recorded_and_the_in_process_results_stand(tiny_bench):
    cfg = BatchingBenchConfig(streams=2, new_tokens=2, prompt_tokens=4, repeats=1, sequential_streams=0,
                              baseline=False)
    record = run_batching_bench(tiny_bench, cfg, {"url": "http://127.0.0.1:9/v1", "model": "m"}, log=lambda s: None)
    assert "endpoint" not in record["results"] and record["results"]["kvtool"]["tokens"] == 4
    assert "ConnectError" in record["errors"]["endpoint"]
    assert "endpoint failed" in format_table(record)


@pytest.mark.parametrize("field,value,message", [
    ("streams", 0, "--streams must be >= 1"), ("new_tokens", -1, "--new-tokens must be >= 1"),
    ("sequential_streams", 9, "--sequential-streams must be in"), ("prefill_budget", 0, "--prefill-budget"),
])
def test_bad_sizes_are_refused_with_the_flag_named(field, value, message):
    with pytest.raises(InvalidParameterError, match=message):
        BatchingBenchConfig(**{"streams": 4, field: value}).validate()


def test_prompt_and_new_tokens_must_fit_the_context_window(tiny_bench):
    cfg = BatchingBenchConfig(streams=1, new_tokens=600, sequential_streams=0)
    with pytest.raises(InvalidParameterError, match="context window of 512"):
        run_batching_bench(tiny_bench, cfg, log=lambda s: None)


def test_the_sequential_baseline_defaults_to_at_most_the_streams():
    from kvtool.bench.batching import config_from_args
    from kvtool.cli import build_parser

    def parsed(*argv):
        return config_from_args(build_parser().parse_args(["bench", "batching", *argv])).validate()

    assert parsed("--streams", "2").sequential_streams == 2  # the default 4 refused --streams 2
    assert parsed().sequential_streams == BatchingBenchConfig.sequential_streams
    assert parsed("--streams", "8", "--sequential-streams", "0").sequential_streams == 0
