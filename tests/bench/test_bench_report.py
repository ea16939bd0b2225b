"""`kvtool bench all` and the per-benchmark modules on a tiny random model: records, the report's tables,
targets beside measured values, errors recorded without stopping the run, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.bench import report as report_mod
from kvtool.bench.decode import DecodeBenchConfig, run_decode_bench
from kvtool.bench.protocol import device_name, emit
from kvtool.bench.report import ReportConfig, run_report
from kvtool.bench.skills import SkillsBenchConfig, run_skills_bench
from kvtool.bench.targets import Target
from kvtool.cli import build_parser, main
from kvtool.errors import InvalidParameterError
from kvtool.kernels import cpu_gemm

PNG = b"\x89PNG\r\n\x1a\n"


def test_records_name_files_under_the_working_directory_relative_to_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    record = {"config": {"skills": str(tmp_path / "examples" / "skills"), "out": "/elsewhere/r.json",
                         "files": [str(tmp_path / "a.png"), 3]}, "name": str(tmp_path)}
    emit(record, tmp_path / "out" / "r.json")
    written = json.loads((tmp_path / "out" / "r.json").read_text())
    assert written == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert written["config"] == {"skills": "examples/skills", "out": "/elsewhere/r.json", "files": ["a.png", 3]}
    assert written["name"] == str(tmp_path)  # the directory itself is not a file under it


def test_targets_apply_only_on_their_device_and_to_measured_values():
    fast, low = Target("tok_s", "t", ">=", 10, "tok/s"), Target("ms", "m", "<=", 5, "ms", device_type=None)
    assert [fast.check(v, "cuda")["status"] for v in (12, 10, 9.9, None)] == ["met", "met", "missed", "n/a"]
    assert fast.check(12, "cpu")["status"] == "n/a" and fast.check(12, "cuda", applies=False)["status"] == "n/a"
    assert [low.check(v, "cpu")["status"] for v in (4, 6)] == ["met", "missed"]
    assert fast.check(12, "cuda")["measured"] == 12 and fast.check(12, "cuda")["target"] == ">= 10 tok/s"


def test_decode_record_ratios_come_from_the_measured_medians(tiny_bench):
    cfg = DecodeBenchConfig(decode_tokens=4, ttft_lengths=[16, 32], prompt_tokens=8, repeats=2, warmup=0)
    rec = run_decode_bench(tiny_bench, cfg, log=lambda s: None)
    half = cpu_gemm._op_works(torch.bfloat16) is None  # oneDNN's bf16 path runs on this CPU
    assert list(rec["results"]) == [
        "decode_tok_s", "decode_tok_s_engine", "decode_tok_s_int4", *["decode_tok_s_bf16"][:half], "ttft_ms_16",
        *["ttft_ms_16_bf16"][:half], "ttft_ms_32", *["ttft_ms_32_bf16"][:half]]
    assert ("bf16_fidelity" in rec) == half
    # and, where it runs, a bf16-weight copy, decode and TTFT, with its fidelity (decode steps and one prefill)
    fid = rec.get("bf16_fidelity", {"steps": 4, "top1_agreement": 1, "prefill_top1_agreement": 1})
    assert fid["steps"] == 4 and 0 <= fid["top1_agreement"] <= 1 and 0 <= fid["prefill_top1_agreement"] <= 1
    for metric in ("decode_tok_s_bf16", "ttft_ms_16_bf16", "ttft_ms_32_bf16")[:3 * half]:
        copy, t = rec["results"].pop(metric)["kvtool"], rec["results"][metric[:-5]]["transformers"]["median"]
        want = copy["median"] / t if metric.startswith("decode") else t / copy["median"]
        assert copy["n"] == 2 and rec["speedup_vs_transformers"][metric] == pytest.approx(want, abs=1e-3)
    # on CPU an int4 copy of the model is timed in the same runs, with its fidelity to the dense model
    packed, t = rec["results"].pop("decode_tok_s_int4")["kvtool"], rec["results"]["decode_tok_s"]["transformers"]
    assert packed["n"] == 2 and rec["speedup_vs_transformers"]["decode_tok_s_int4"] == pytest.approx(
        packed["median"] / t["median"], abs=1e-3)
    fid = rec["int4_fidelity"]
    assert fid["steps"] == 4 and 0 <= fid["top1_agreement"] <= 1 and 0 < fid["kl_mean"] <= fid["kl_max"]
    assert tiny_bench.runner.weights == "dense"  # the copy, not the bench model, was packed
    # Engine.generate's decode steps, timed in the same runs beside the same baseline
    whole, t = rec["results"].pop("decode_tok_s_engine")["kvtool"], rec["results"]["decode_tok_s"]["transformers"]
    assert whole["n"] == 2 and whole["median"] > 0 and rec["speedup_vs_transformers"]["decode_tok_s_engine"] == \
        pytest.approx(whole["median"] / t["median"], abs=1e-3)
    for metric, row in rec["results"].items():
        k, t = row["kvtool"]["median"], row["transformers"]["median"]
        assert row["kvtool"]["n"] == row["transformers"]["n"] == 2 and k > 0 and t > 0
        want = k / t if metric.startswith("decode") else t / k
        assert rec["speedup_vs_transformers"][metric] == pytest.approx(want, abs=1e-3)
        runs = [(a / b if metric.startswith("decode") else b / a) for a, b in zip(row["kvtool"]["runs"],
                                                                                   row["transformers"]["runs"])]
        pair = rec["paired_speedup_vs_transformers"][metric]  # run by run: each kvtool run over its baseline run
        assert pair["n"] == 2 and pair["median"] == pytest.approx(sum(runs) / 2, abs=1e-3)
        assert pair["min"] == pytest.approx(min(runs), abs=1e-3) and pair["max"] == pytest.approx(max(runs), abs=1e-3)
    checks = {c["metric"]: c for c in rec["target_checks"]}
    assert checks["decode_tok_s"]["measured"] == rec["results"]["decode_tok_s"]["kvtool"]["median"]
    assert checks["ttft_ms_512"]["measured"] is None and {c["status"] for c in checks.values()} == {"n/a"}
    with pytest.raises(InvalidParameterError, match="context window of 512"):
        run_decode_bench(tiny_bench, DecodeBenchConfig(ttft_lengths=[600]), log=lambda s: None)


def test_skills_on_random_weights_use_synthetic_blocks(tiny_bench):
    cfg = SkillsBenchConfig(blocks=2, block_tokens=16, prefix_tokens=8, query_tokens=4, greedy_tokens=3,
                            repairs=["none", "recompute_first_k:k=4"], scaling=[1, 2])
    rec = run_skills_bench(tiny_bench, cfg, log=lambda s: None)
    assert rec["block_tokens"] == 32 and rec["prompt_tokens"] == 8 + 32 + 4 and rec["random_weights"]
    assert [r["repair"] for r in rec["repairs"]][0] == "none" and len(rec["repairs"]) == 2
    assert rec["repairs"][1]["recomputed_tokens"] == 8  # first 4 tokens of each of the 2 blocks
    assert [row["blocks"] for row in rec["ttft_scaling"]] == [1, 2]
    assert {t["status"] for t in rec["target_checks"]} == {"n/a"}  # set for >= 4 blocks
    assert {r["preamble"] for r in rec["repairs"]} == {"as compiled"}  # synthetic blocks: one set


def test_skills_bench_flags_pick_the_preambles():
    from kvtool.bench.skills import config_from_args
    from kvtool.cli import build_parser

    args = build_parser().parse_args(["bench", "skills", "--preamble", "none", "--preamble", "deep:tokens=64"])
    assert config_from_args(args).preambles == ["none", "deep:tokens=64"]
    assert config_from_args(build_parser().parse_args(["bench", "skills"])).preambles == ["conversation",
                                                                                        "deep:tokens=2048"]


def test_bench_all_writes_tables_plots_json_and_records_a_failing_benchmark(tiny_bench, tmp_path, monkeypatch,
                                                                            capsys):
    def boom(bm, cfgs, rc, log):
        raise RuntimeError("prefix exploded")

    monkeypatch.setitem(report_mod.JOBS, "prefix", [("prefix", boom, False)])
    out = tmp_path / "report"
    record = run_report(ReportConfig(quick=True, out_dir=str(out)), bm=tiny_bench, log=lambda s: None)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads((out / "report.json").read_text()) == json.loads(json.dumps(record))
    assert record["errors"]["prefix"] == "RuntimeError: prefix exploded"
    assert "chat template" in record["errors"]["ttft"]  # random weights, no tokenizer: recorded, not fatal
    assert set(record["records"]) == {"decode", "skills", "batching"}
    md = (out / "report.md").read_text()
    for title in ("## Targets", "## Decode (bs=1) and cold TTFT", "## TTFT per context layout",
                  "## Prefix-cache hit vs cold prefill", "## Composed skill blocks", "## Concurrent streams"):
        assert title in md
    assert device_name(torch.device("cpu")) in md and "| dtype | float32 |" in md
    assert f"torch {torch.__version__}" in md and "quick" in md
    assert "**error (prefix):** `RuntimeError: prefix exploded`" in md
    assert "| metric | kvtool | transformers | kvtool vs transformers | run by run |" in md
    pair = record["records"]["decode"]["paired_speedup_vs_transformers"]["decode_tok_s"]
    assert f"| {pair['median']:.2f}x ({pair['min']:.2f}-{pair['max']:.2f}) |" in md
    assert "| engine | streams | output tok/s |" in md
    decode = record["records"]["decode"]["results"]["decode_tok_s"]["kvtool"]["median"]
    assert f"| decode | decode tok/s, bs=1 | >= 800 tok/s | H200-class CUDA GPU, Qwen3-0.6B shape, bf16 | " \
           f"{report_mod._num(decode, 'tok/s')} | n/a |" in md
    for png in ("decode.png", "skills.png", "batching.png"):
        assert (out / png).read_bytes()[:8] == PNG and f"]({png})" in md
    assert not (out / "prefix.png").exists()
    assert not (out / "partial.json").exists()  # the finished report replaces it


def test_a_run_stopped_midway_keeps_what_finished(tiny_bench, tmp_path, monkeypatch):
    def stop(bm, cfgs, rc, log):
        raise KeyboardInterrupt  # what `timeout -s INT` does to a run that outlasts its lease

    monkeypatch.setitem(report_mod.JOBS, "decode", [("decode", lambda bm, cfgs, rc, log: {"tok_s": 1.0}, False)])
    monkeypatch.setitem(report_mod.JOBS, "ttft", [("ttft", stop, False)])
    out = tmp_path / "report"
    with pytest.raises(KeyboardInterrupt):
        run_report(ReportConfig(quick=True, out_dir=str(out), only=["decode", "ttft"]), bm=tiny_bench,
                   log=lambda s: None)
    partial = json.loads((out / "partial.json").read_text())
    assert partial["records"] == {"decode": {"tok_s": 1.0}} and set(partial["seconds"]) == {"decode"}
    assert not (out / "report.json").exists()


def test_cli_parses_bench_all_and_refuses_bad_input_before_loading(capsys, monkeypatch):
    args = build_parser().parse_args(["bench", "all", "--quick", "--shape", "qwen3-0.6b", "--endpoint",
                                      "http://h:8000/v1", "--only", "decode", "batching", "--out-dir", "d"])
    assert (args.quick, args.shape, args.endpoint, args.only, args.out_dir) == \
        (True, "qwen3-0.6b", "http://h:8000/v1", ["decode", "batching"], "d")
    assert args.func.__name__ == "run_all"
    args = build_parser().parse_args(["bench", "batching", "--streams", "4", "--new-tokens", "16"])
    assert (args.streams, args.new_tokens, args.func.__name__) == (4, 16, "run_batching")

    import kvtool.bench.loading

    monkeypatch.setattr(kvtool.bench.loading, "load_bench_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["bench", "batching", "--streams", "0"]) == 2
    assert "--streams must be >= 1 (got 0)" in capsys.readouterr().err
    assert main(["bench", "decode", "--ttft-lengths", "0"]) == 2
    assert "--ttft-lengths must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "all", "--only", "nonsense"])


def test_model_and_shape_together_is_a_clear_error():
    from kvtool.bench.loading import load_bench_model

    with pytest.raises(InvalidParameterError, match="either --model or --shape"):
        load_bench_model("smollm2", "qwen3-0.6b")


def test_shape_runs_render_prompts_with_a_tokenizer_folder(qwen25, monkeypatch):
    """A GPU machine has no embedded SmolLM2: `bench all --shape qwen3-0.6b --tokenizer DIR` brings Qwen's."""
    from transformers import Qwen3Config

    import kvtool.bench.loading as loading
    from kvtool.bench.backends import InProcessBackend
    from kvtool.bench.scenarios import ChatRequest
    from kvtool.testing.tiny import TINY_COMMON

    small = {**TINY_COMMON, "vocab_size": 151936}  # the shape's vocabulary, a tiny body
    monkeypatch.setitem(loading.SHAPES, "qwen3-0.6b", lambda: Qwen3Config(**small, head_dim=32))
    with loading.load_bench_model(shape="qwen3-0.6b", device="cpu", tokenizer=str(qwen25.folder)) as bm:
        assert bm.name == f"qwen3-0.6b shape (random weights, tokenizer from {qwen25.folder})" and bm.random_weights
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        ids = bm.model.encode_chat(messages)
        assert ids == qwen25.encode_chat(messages) and "<|im_start|>" in bm.model.render(messages)
        result = InProcessBackend.for_model(bm.model, max_tokens=2).send(ChatRequest(messages, None, "q"))
        assert result.prompt_tokens == len(ids) and result.output_tokens == 2
    with pytest.raises(InvalidParameterError, match="has 151936 tokens; the model's vocabulary has only 256"):
        loading.folder_tokenizer(str(qwen25.folder), 256)
    with pytest.raises(InvalidParameterError, match="--tokenizer /no/such: no such folder"):
        loading.load_bench_model(shape="qwen3-0.6b", tokenizer="/no/such")
    with pytest.raises(InvalidParameterError, match="--tokenizer goes with --shape"):
        loading.load_bench_model("smollm2", tokenizer=str(qwen25.folder))


def test_bench_decode_cli_prints_the_table_and_the_record_last(tiny_bench, tmp_path, monkeypatch, capsys):
    import kvtool.bench.loading

    monkeypatch.setattr(kvtool.bench.loading, "load_bench_model", lambda *a, **k: tiny_bench)
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--decode-tokens", "3", "--ttft-lengths", "8", "--repeats", "1",
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert record == json.loads(out.read_text()) and record["benchmark"] == "decode"
    assert any(line.startswith("decode_tok_s") for line in lines)
    assert any(line.startswith("ttft_ms_8") for line in lines)


@pytest.mark.gpu
def test_gpu_targets_apply_on_cuda(tmp_path):
    from kvtool.bench.loading import from_checkpoint
    from kvtool.testing.tiny import tiny_checkpoint

    tiny_checkpoint("qwen3", tmp_path)
    with from_checkpoint(tmp_path, "tiny-qwen3", device="cuda", dtype="bfloat16") as bm:
        rec = run_decode_bench(bm, DecodeBenchConfig(decode_tokens=8, ttft_lengths=[256], repeats=2, baseline=False),
                               log=lambda s: None)
    status = {c["metric"]: c["status"] for c in rec["target_checks"]}
    assert status["decode_tok_s"] in ("met", "missed") and status["ttft_ms_512"] == "n/a"


def test_prefix_record_takes_the_engines_path(tiny_bench):
    from kvtool.bench import prefix as prefix_mod

    cfg = prefix_mod.PrefixBenchConfig(prefix_tokens=64, suffix_tokens=8, repeats=2, warmup=1)
    rec = prefix_mod.run_prefix_bench(tiny_bench, cfg, log=lambda s: None)
    assert rec["first_token_match"]
    k = rec["results"]["kvtool"]
    assert k["hit_ms"]["n"] == k["cold_ms"]["n"] == 2 and k["speedup"] == pytest.approx(
        k["cold_ms"]["median"] / k["hit_ms"]["median"])
    assert rec["cache"]["hit_tokens"] >= 64 * (cfg.warmup + cfg.repeats)
    # a restart: load the saved cache file, then hit (its own hit must be the whole prefix, or it raises)
    assert k["file_load_hit_ms"]["n"] == 2 and k["file_bytes"] > 64 * tiny_bench.runner.spec.kv_bytes_per_token(4)
    assert k["file_speedup"] == pytest.approx(k["cold_ms"]["median"] / k["file_load_hit_ms"]["median"])
    assert "kvtool .kvc" in prefix_mod.format_table(rec)


def test_repeat_words_cuts_filler_to_the_word():
    from kvtool.bench.protocol import repeat_words

    assert repeat_words("a b c", 7) == "a b c a b c a"
    assert repeat_words("one two. ", 3) == "one two. one" and repeat_words("x", 0) == ""


def test_bar_panels_leave_out_a_panel_the_run_did_not_measure(tmp_path):
    """A peers run of decode alone drew empty panels for the TTFT workloads it left out."""
    from matplotlib.image import imread

    from kvtool.bench.plots import bar_panels

    def width(panels):
        return imread(bar_panels(tmp_path / "p.png", "t", panels)).shape[1]

    one = width({"decode": {"a": 1.0}})
    assert width({"decode": {"a": 1.0}, "ttft": {}, "hit": {"a": None}}) == one
    assert width({"decode": {"a": 1.0}, "ttft": {"a": 2.0}}) > one
    with pytest.raises(ValueError, match="no values to plot"):
        bar_panels(tmp_path / "q.png", "t", {"ttft": {}})
