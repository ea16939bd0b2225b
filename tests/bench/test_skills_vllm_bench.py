"""benchmarks/skills_vllm.py's pieces that need no vLLM server: the generated skill library (with the examples, >= 16
skills), requests of 2-4 skills in varying order after one system prompt, the warm-up request, the top-k KL it
reports for vLLM, and the plain vLLM servers it starts (benchmarks/vllm_standalone.py: the modes' command lines,
the connector mounted by --kv-transfer-config alone)."""

from __future__ import annotations

import json
import math

import pytest

from tests.bench.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("skills_vllm")


@pytest.fixture(scope="module")
def server():
    return load_script("vllm_standalone")


def test_top_kl_is_zero_for_equal_lists_and_positive_otherwise(bench):
    ref = {"token_id:1": math.log(0.7), "token_id:2": math.log(0.2), "token_id:3": math.log(0.1)}
    assert bench.top_kl(ref, ref) == pytest.approx(0.0, abs=1e-7)
    assert bench.top_kl(ref, {"token_id:1": math.log(0.2), "token_id:2": math.log(0.7)}) > 0.1  # 3 takes the floor


def test_the_modes_run_plain_vllm_servers(server):
    plain = server.command("/m", 8000, prefix_caching=False)
    assert plain[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--no-enable-prefix-caching" in plain
    assert "--kv-transfer-config" not in plain and "--enable-prompt-tokens-details" in plain
    assert server.ENV["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # vLLM's default: the engine core in its own process
    assert server.account({"kv_transfer_params": {"kvtool": {"block_tokens": 3}}}) == {"block_tokens": 3}
    assert server.account({"choices": []}) is None


def test_compose_mounts_the_connector_by_kv_transfer_config_alone(server, tmp_path):
    pytest.importorskip("vllm")
    from kvtool.integrations.vllm.mount import MountSettings

    (tmp_path / "a.kvb").write_bytes(b"")
    argv = server.command("/m", 8000, True, {"blocks": [str(tmp_path / "a.kvb")], "kv_store": str(tmp_path / "s"),
                                             "skill_min_tokens": 0})
    assert "--enable-prefix-caching" in argv
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_module_path"] == "kvtool.integrations.vllm.connector"
    assert MountSettings.from_extra(config["kv_connector_extra_config"]).kv_store == str(tmp_path / "s")


@pytest.mark.real_model
def test_requests_load_two_to_four_skills_in_varying_order(bench, smollm2, tmp_path):
    from kvtool.skills.catalog import load_catalog

    folder = tmp_path / "skills"
    folder.mkdir()
    bench.generated_skills(folder, 16, 16, seed=0)
    catalog = load_catalog(folder, smollm2, cache_dir=tmp_path / "kvb", preamble="none", log=lambda m: None)
    assert len(catalog) == 16
    prompts = bench.requests(smollm2, catalog, 4, seed=0)
    orders = [[m.name for m in catalog.index.find(ids)] for ids in prompts]
    assert all(2 <= len(o) <= 4 for o in orders) and len({tuple(o) for o in orders}) == 4
    shared = next(i for i in range(min(map(len, prompts))) if len({ids[i] for ids in prompts}) > 1)
    assert shared >= len(smollm2.encode(bench.SYSTEM)), shared  # one system prompt before every request's skills
    warm = bench.warmup_prompt(smollm2, catalog)
    assert warm[:shared] == prompts[0][:shared] and len(catalog.index.find(warm)) == 1
