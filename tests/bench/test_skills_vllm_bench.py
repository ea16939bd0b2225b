"""benchmarks/skills_vllm.py's pieces that need no vLLM: the generated skill library (with the examples, >= 16
skills), requests of 2-4 skills in varying order after one system prompt, and the top-k KL it reports for vLLM."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tests.bench.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("skills_vllm")


def test_top_kl_is_zero_for_equal_lists_and_positive_otherwise(bench):
    lp = lambda x: SimpleNamespace(logprob=math.log(x))  # noqa: E731
    ref = {1: lp(0.7), 2: lp(0.2), 3: lp(0.1)}
    assert bench.top_kl(ref, ref) == pytest.approx(0.0, abs=1e-7)
    assert bench.top_kl(ref, {1: lp(0.2), 2: lp(0.7)}) > 0.1  # token 3 missing: it takes got's floor


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
