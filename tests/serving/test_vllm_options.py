"""--engine / --engine-arg wiring (no model loads): kvtool-engine options are refused with --engine vllm,
--engine-arg values are typed by vLLM's EngineArgs, and settings defaults reach the environment."""

from __future__ import annotations

import pytest

from kvtool.cli import main
from kvtool.integrations.vllm import available

needs_vllm = pytest.mark.skipif(not available(), reason="vLLM is not installed (pip install -e '.[vllm]')")


@pytest.mark.parametrize("flag", [["--weights", "int4"], ["--forward", "reference"], ["--kv-bytes", "1000"]])
def test_kvtool_engine_options_are_refused_with_vllm(flag, capsys):
    assert main(["serve", "--engine", "vllm", *flag]) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]} configure kvtool's own engine" in err and "--engine-arg" in err


@pytest.mark.parametrize("flags,message", [
    (["--skills", "no/such/folder"], "--skills 'no/such/folder' is not a folder of skills"),
    (["--cache-save-every", "5"], "--cache-save-every saves the prefix store to --cache-file"),
])
def test_connector_options_are_checked_before_anything_loads(flags, message, capsys):
    assert main(["serve", "--engine", "vllm", *flags]) == 2
    assert message in capsys.readouterr().err


def test_engine_arg_needs_the_vllm_engine(capsys):
    assert main(["serve", "--engine-arg", "max_model_len=4096"]) == 2
    assert "--engine-arg passes settings to vLLM; it needs --engine vllm" in capsys.readouterr().err


@needs_vllm
def test_engine_args_are_typed():
    from kvtool.integrations.vllm.settings import parse_engine_args

    parsed = parse_engine_args(["max_model_len=4096", "enable_prefix_caching=false", "tensor-parallel-size=2",
                                "gpu_memory_utilization=0.5", "dtype=bfloat16", 'compilation_config={"mode": 0}'])
    assert parsed == {"max_model_len": 4096, "enable_prefix_caching": False, "tensor_parallel_size": 2,
                      "gpu_memory_utilization": 0.5, "dtype": "bfloat16", "compilation_config": {"mode": 0}}


@needs_vllm
@pytest.mark.parametrize("item,message", [
    ("max_modl_len=3", "vLLM has no engine argument 'max_modl_len'; did you mean max_model_len?"),
    ("max_model_len=abc", "--engine-arg max_model_len='abc': expected int"),
    ("enforce_eager=maybe", "--engine-arg enforce_eager='maybe': expected bool"),
    ("nokey", "expected KEY=VALUE"),
    ("model=x", "give the model with --model"),
    ("generation_config=vllm", "give it as --generation-config")])
def test_bad_engine_args_say_what_is_wrong(item, message):
    from kvtool.integrations.vllm.settings import parse_engine_args
    from kvtool.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match=None) as info:
        parse_engine_args([item])
    assert message in str(info.value)


def test_settings_keep_the_users_environment(monkeypatch):
    from kvtool.integrations.vllm.settings import ENV_DEFAULTS, apply_env_defaults

    import os

    for key in ENV_DEFAULTS:  # restored after the test
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    apply_env_defaults()

    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == ENV_DEFAULTS["VLLM_ENABLE_V1_MULTIPROCESSING"]


def test_engine_kwargs_defaults_then_user():
    from kvtool.integrations.vllm.settings import engine_kwargs

    cpu = engine_kwargs("/m", "auto", on_gpu=False, user={"max_model_len": 1024, "enforce_eager": False})
    assert cpu["dtype"] == "float32" and cpu["enforce_eager"] is False and cpu["max_model_len"] == 1024
    gpu = engine_kwargs("/m", "auto", on_gpu=True, user={})
    assert gpu["dtype"] == "auto" and "enforce_eager" not in gpu and gpu["enable_prefix_caching"]
    assert gpu["structured_outputs_config"] == {"backend": "guidance"}  # llguidance, as on kvtool's engine


def test_a_config_naming_no_architecture_gets_the_causal_lm_for_its_model_type():
    """A converted GGUF's config names no architecture; vLLM would load Gemma 3's as an embedding model."""
    from kvtool.integrations.vllm.settings import engine_kwargs

    named = engine_kwargs("/m", "auto", on_gpu=False, user={}, model_type="gemma3_text")
    assert named["hf_overrides"] == {"architectures": ["Gemma3ForCausalLM"]}
    assert "hf_overrides" not in engine_kwargs("/m", "auto", on_gpu=False, user={})
    mine = {"architectures": ["Mine"]}
    assert engine_kwargs("/m", "auto", False, {"hf_overrides": mine}, "gemma3_text")["hf_overrides"] == mine


@needs_vllm
def test_the_connectors_counters_sum_across_halves_and_reset_when_taken():
    from kvtool.integrations.vllm.connector import KvtoolConnector
    from kvtool.integrations.vllm.stats import COUNTERS, KvtoolStats

    scheduler, worker = KvtoolStats(), KvtoolStats()
    assert scheduler.take() is None  # nothing to report
    scheduler.add(block_tokens=700, store_tokens=34, composed_requests=1)
    worker.add(saved_blocks=49, load_ms=2.25)
    sent = KvtoolConnector.build_kv_connector_stats(worker.take().to_dict())  # as vLLM rebuilds it in its logger
    total = sent.aggregate(scheduler.take())
    assert set(total.data) == set(COUNTERS) and total.reduce()["block_tokens"] == 700
    assert total.reduce()["saved_blocks"] == 49 and total.reduce()["load_ms"] == 2.2  # rounded to 0.1 ms
    assert worker.is_empty() and scheduler.is_empty()
