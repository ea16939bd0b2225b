"""PrefixCache with the real SmolLM2 model: greedy output token-identical to no cache, reported
cached tokens, faults (tiny budget, reset mid-generation, interleaved requests), pin by messages."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool import SamplingParams
from kvtool.cache.manager import attach_prefix_cache
from kvtool.engine import Engine
from kvtool.errors import PrefixCacheWarning

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0, max_tokens=8)
QUESTION = "How much is a croissant, and when can I pick one up?"  # shared so the reference is computed once
SYSTEM = ("You are a careful assistant for a small bakery. Answer in one or two sentences, quote prices in "
          "euros, and never invent opening hours: the shop opens at 7:00 and closes at 18:00, Monday to Saturday.")


def chat_ids(model, user, system=SYSTEM):
    return model.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])


class Reference:
    """Greedy outputs without any prefix cache, computed once per prompt."""

    def __init__(self, model):
        self.engine, self.memo = Engine(model), {}

    def generate(self, prompt, params=GREEDY):
        key = (tuple(prompt), params.max_tokens)
        if key not in self.memo:
            self.memo[key] = self.engine.generate(prompt, params).run()
        return self.memo[key]


@pytest.fixture(scope="module")
def reference(smollm2):
    return Reference(smollm2)


@pytest.fixture
def engines(smollm2, reference):
    cached = Engine(smollm2)
    attach_prefix_cache(cached, budget_bytes=64 << 20)
    return reference, cached


def test_greedy_tokens_identical_for_0_50_99_100_percent_sharing(smollm2, engines):
    plain, engine = engines
    base = chat_ids(smollm2, QUESTION)
    other = smollm2.encode_rendered(" Tell me about the sourdough loaves and rye breads you bake every morning, "
                                    "please.")
    prompts = {"0%": chat_ids(smollm2, "Do you sell gluten-free cakes?", system="You are a pirate. Speak like one."),
               "50%": base[: len(base) // 2] + other[: len(base) - len(base) // 2],
               "99%": base[:-1] + smollm2.encode_rendered(" Thanks!")[:1],
               "100%": base}
    first = engine.generate(base, GREEDY).run()
    assert first.timings.cached_tokens == 0 and first.token_ids == plain.generate(base).token_ids
    for share, prompt in prompts.items():
        got = engine.generate(prompt, GREEDY).run()
        assert got.token_ids == plain.generate(prompt).token_ids, share
        covered = (len(base) + len(first.token_ids) - 1) // 16 * 16  # full blocks the first request left
        t = got.timings
        if share in ("99%", "100%"):  # prompt[:-1] == base[:-1]: reused to the token, as far as it is cached
            assert t.cached_tokens == min(len(prompt) - 1, covered), share
        elif share == "50%":
            assert len(base) // 2 - 16 < t.cached_tokens <= len(base) // 2
        assert t.prefill_tokens == len(prompt) - t.cached_tokens and t.ttft_ms > 0
    stats = engine.prefix_cache.stats()
    assert stats["queries"] == 5 and stats["hit_tokens"] > 0 and stats["bytes_in_use"] <= stats["budget_bytes"]
    engine.prefix_cache.check_integrity()


def test_a_prefix_ending_inside_a_block_is_reused_exactly(smollm2, engines):
    plain, engine = engines
    cache, runner = engine.prefix_cache, smollm2.runner
    base = chat_ids(smollm2, QUESTION)
    engine.generate(base, GREEDY).run()
    tail = smollm2.encode_rendered(" Also, do you bake rye bread on Sundays?")
    cuts = [n for n in range(len(base) - 12, 0, -1) if n % 16][:2]  # leave the cache inside a block
    prompts = [base[:n] + tail for n in cuts]
    kv, n, handle = cache.prepare(prompts[0], runner)
    cold = runner.new_cache()
    want = runner.prefill(prompts[0], cold)
    got = runner.prefill(prompts[0][n:], kv)
    cache.commit(handle, prompts[0], kv)
    assert n == cuts[0] and n % 16 and torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    cache.reset()
    engine.generate(base, GREEDY).run()
    single = engine.generate(prompts[0], GREEDY).run()
    assert single.token_ids == plain.generate(prompts[0]).token_ids and single.timings.cached_tokens == cuts[0]
    cache.reset()
    engine.generate(base, GREEDY).run()
    batch = engine.generate_batch(prompts, GREEDY)  # continuous batching reads the same slices
    assert [g.token_ids for g in batch] == [plain.generate(p).token_ids for p in prompts]
    assert [g.timings.cached_tokens for g in batch] == cuts
    cache.check_integrity()


@pytest.mark.parametrize("name", ["smollm2", "qwen25"])
def test_a_hit_reads_the_cached_blocks_in_place_and_copies_only_a_partial_one(name, request):
    """The C++ CPU path reads a hit's full blocks where the cache keeps them (no copy), the partly reused
    block is copied; prefill and decode over them give the bits of the same KV copied into one buffer; commit
    keeps the block the request filled as it is (no copy either)."""
    from kvtool.cache.kv import KVCache

    model = request.getfixturevalue(name)
    engine, runner = Engine(model), model.runner
    cache = attach_prefix_cache(engine, budget_bytes=64 << 20)
    base = chat_ids(model, QUESTION)
    engine.generate(base, GREEDY).run()
    prompt = base[:40] + model.encode_rendered(" And rye bread?")  # 2 full blocks of 16 and 8 tokens of a third
    kv, n, handle = cache.prepare(prompt, runner)
    assert runner.cpu_decode and n == 40 and cache.stats()["copied_tokens"] == 8
    assert [b.data_ptr() for b in kv.layers[5].blocks] == [b.data_ptr() for b in
                                                           cache.store.tensors(handle.block_ids[:2])]
    copied = KVCache.from_state(kv.state())  # the same KV in one buffer per layer
    assert not copied.layers[0].blocks and torch.equal(copied.layers[3].keys, kv.layers[3].keys)
    got, want = runner.prefill(prompt[n:], kv), runner.prefill(prompt[n:], copied)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, runner.prefill(prompt, runner.new_cache()), atol=1e-4, rtol=1e-4)
    token, tokens = int(got.argmax()), list(prompt)
    while kv.offset < 48:  # the third block fills up in the request's page
        got, want = runner.forward([token], kv), runner.forward([token], copied)
        assert torch.equal(got, want) and kv.offset == copied.offset
        tokens.append(token)
        token = int(got.argmax())
    assert torch.equal(kv.layers[2].values, copied.layers[2].values) and kv.layers[2].base == 32
    page = kv.layers[0].page
    cache.commit(handle, tokens, kv)  # keeps the request's full page as the third block, without a copy
    chain = cache.index.match(tokens, record=False)
    assert len(chain) == 3 and cache.store.tensors(chain)[2] is page and kv.layers[2].base == 48
    cache.check_integrity()


def test_requests_that_read_one_cached_prefix_in_place_run_together_under_a_small_kv_budget(smollm2, engines):
    """The scheduler's KV budget counts a request's own tokens, not the cached blocks it reads in place: two
    requests on one cached prefix run at once under a budget that two copies of the prefix would not fit."""
    from kvtool.engine.scheduler import BatchScheduler

    plain, engine = engines
    prefix = chat_ids(smollm2, QUESTION)
    engine.prefix_cache.pin(prefix)
    a, b = prefix + smollm2.encode_rendered(" In euros."), prefix + smollm2.encode_rendered(" And on Sundays?")
    sched = BatchScheduler(engine, max_running=2, prefill_budget=512, kv_budget_tokens=len(prefix) + 40)
    ga, gb = sched.submit(a, GREEDY), sched.submit(b, GREEDY)
    sched.step()
    assert len(sched.running) == 2 and sched.kv_in_use < len(prefix)  # copies would hold 2 x len(prefix)
    sched.run()
    assert ga.timings.cached_tokens >= 64 and gb.timings.cached_tokens >= 64
    assert ga.token_ids == plain.generate(a).token_ids and gb.token_ids == plain.generate(b).token_ids


def test_budget_too_small_runs_uncached_with_a_warning(smollm2, reference):
    engine = Engine(smollm2)
    cache = attach_prefix_cache(engine, budget_bytes=1000)  # less than one 16-token block
    prompt = chat_ids(smollm2, QUESTION)
    with pytest.warns(PrefixCacheWarning, match="does not fit"):
        got = engine.generate(prompt, GREEDY).run()
    assert got.token_ids == reference.generate(prompt).token_ids
    again = engine.generate(prompt, GREEDY).run()
    assert again.timings.cached_tokens == 0 and again.token_ids == got.token_ids
    assert cache.stats()["bytes_in_use"] == 0
    cache.check_integrity()


def test_reset_mid_generation_and_interleaved_requests(smollm2, engines):
    plain, engine = engines
    cache = engine.prefix_cache
    a = chat_ids(smollm2, QUESTION)
    b = chat_ids(smollm2, "Can I order a birthday cake for Friday?")
    engine.generate(a, SamplingParams(temperature=0, max_tokens=2)).run()  # caches the shared system prompt
    ga, gb = engine.generate(a, GREEDY), engine.generate(b, GREEDY)
    ia, ib = iter(ga), iter(gb)
    out_a, out_b = [], []
    for step in range(GREEDY.max_tokens):
        out_a.append(next(ia).token_id)
        if step == 4:
            cache.reset()  # while both run
            cache.check_integrity()
        out_b.append(next(ib).token_id)
    assert ga.timings.cached_tokens >= 48 and gb.timings.cached_tokens >= 48  # both hit the system prompt
    for it in (ia, ib):
        assert list(it) == []
    assert out_a == plain.generate(a).token_ids
    assert out_b == plain.generate(b).token_ids
    assert cache.stats()["blocks"] == 0 and cache.stats()["resets"] == 1
    cache.check_integrity()


def test_pin_system_prompt_over_http_then_hit(smollm2, engines):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvtool.serving.cache_http import cache_router

    _, engine = engines
    app = FastAPI()
    app.include_router(cache_router(lambda: engine.prefix_cache, lambda: smollm2))
    client = TestClient(app)
    system = [{"role": "system", "content": SYSTEM}]
    r = client.post("/v1/cache/pin", json={"messages": system})
    assert r.status_code == 200, r.text
    n_system = len(smollm2.encode_chat(system, add_generation_prompt=False))
    assert r.json()["tokens"] == n_system and r.json()["pinned_tokens"] == n_system // 16 * 16
    got = engine.generate(chat_ids(smollm2, "Are you open on Sunday?"), GREEDY).run()
    assert got.timings.cached_tokens == n_system // 16 * 16
    assert client.post("/v1/cache/pin", json={"prompt": "short"}).status_code == 400  # under one block
    r = client.post("/v1/cache/unpin", json={"messages": system})
    assert r.status_code == 200 and r.json()["cache"]["pinned_blocks"] == 0
    r = client.post("/v1/cache/pin", json={"messages": [{"content": "no role"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_prompt_is_shared_while_its_request_still_decodes(smollm2, engines):
    from kvtool.engine.scheduler import BatchScheduler

    plain, engine = engines
    a, b = chat_ids(smollm2, QUESTION), chat_ids(smollm2, "Can I order a birthday cake for Friday?")
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    sched = BatchScheduler(engine, max_running=2, prefill_budget=512)
    ga = sched.submit(a, GREEDY)
    sched.step()  # a's prompt is prefilled; it decodes from here on
    assert ga.token_ids and ga.finish_reason is None
    gb = sched.submit(b, GREEDY)
    sched.run()
    assert gb.timings.cached_tokens == shared >= 48  # the system prompt, from a request still running, to the token
    assert ga.token_ids == plain.generate(a).token_ids and gb.token_ids == plain.generate(b).token_ids
    stats = engine.prefix_cache.stats()
    assert stats["over_budget"] == 0 and stats["queries"] == 2
    engine.prefix_cache.check_integrity()


def test_a_saved_cache_serves_a_new_engine_and_another_model_refuses_it(smollm2, qwen25, reference, tmp_path):
    from kvtool.errors import CacheFormatError

    engine = Engine(smollm2)
    cache = attach_prefix_cache(engine, budget_bytes=64 << 20)
    prompts = [chat_ids(smollm2, QUESTION), chat_ids(smollm2, "Do you sell rye bread?")]
    for prompt in prompts:
        engine.generate(prompt, GREEDY).run()
    cache.pin(chat_ids(smollm2, "")[:48])
    info = cache.save(tmp_path / "smol.kvc", smollm2)
    assert info["blocks"] == cache.stats()["blocks"] and info["pins"] == 1

    again = Engine(smollm2)
    loaded = attach_prefix_cache(again, budget_bytes=64 << 20)
    assert loaded.load(tmp_path / "smol.kvc", smollm2)["loaded_tokens"] == info["tokens"]
    loaded.check_integrity()
    for prompt in prompts:
        got = again.generate(prompt, GREEDY).run()
        covered = (len(prompt) + len(got.token_ids) - 1) // 16 * 16  # full blocks of prompt + reply (saved)
        assert got.timings.cached_tokens == min(len(prompt) - 1, covered)
        assert got.token_ids == reference.generate(prompt).token_ids
    assert loaded.unpin(chat_ids(smollm2, "")[:48])["unpinned_tokens"] == 48

    other = attach_prefix_cache(Engine(qwen25), budget_bytes=64 << 20)
    with pytest.raises(CacheFormatError, match="different setup: model: file has 'SmolLM2-135M-Instruct.Q4_1', "
                                               "this model has 'Qwen2.5-Coder-0.5B-Instruct-Q4_K_M'"):
        other.load(tmp_path / "smol.kvc", qwen25)
    assert other.stats()["blocks"] == 0


def test_generate_cache_file_skips_the_prefill_of_a_prompt_seen_before(tmp_path, capsys):
    from kvtool.cli import main
    from kvtool.testing.models import smollm2_gguf

    path = tmp_path / "gen.kvc"
    argv = ["generate", QUESTION, "--chat", "--system", SYSTEM, "--model", str(smollm2_gguf()), "--max-tokens", "8",
            "--temperature", "0", "--cache-file", str(path)]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "not there yet; it is written after this run" in first.err and "| cached 0 tok" in first.err
    assert f"to {path}" in first.err and path.is_file()
    assert main(argv) == 0
    second = capsys.readouterr()
    assert "kvtool: prefix cache file" in second.err and "loaded" in second.err
    cached = int(second.err.split("| cached ")[1].split(" tok")[0])
    assert cached >= 48 and second.out == first.out  # the system turn and the question came from the file


def test_cache_info_describes_a_saved_file(smollm2, tmp_path, capsys):
    from kvtool.cli import main
    from kvtool.testing.models import smollm2_gguf

    engine = Engine(smollm2)
    cache = attach_prefix_cache(engine, budget_bytes=64 << 20)
    for question in (QUESTION, "Do you sell rye bread?"):
        engine.generate(chat_ids(smollm2, question), GREEDY).run()
    cache.pin(chat_ids(smollm2, "")[:48])
    path = tmp_path / "info.kvc"
    cache.save(path, smollm2)
    assert main(["cache", "info", str(path), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["setup"]["model"] == smollm2.name and described["blocks"] == cache.stats()["blocks"]
    root = described["tree"][0]
    assert len(described["tree"]) == 1 and len(root["children"]) == 2 and root["pinned_tokens"] >= 48
    assert "text" not in root  # no model asked for: no tokenizer to decode with
    assert main(["cache", "info", str(path), "--text", "--model", str(smollm2_gguf())]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: prefix cache of {smollm2.name} (float32), ")
    assert lines[1].startswith(f"  [0, {root['tokens']}) {root['tokens']} tokens, ") and "careful assistant" in lines[1]
    assert len(lines) == 4 and all(line.startswith(f"    [{root['tokens']}, ") for line in lines[2:])
    assert any("rye" in line for line in lines[2:])

    assert main(["cache", "info", str(tmp_path / "none.kvc")]) == 2
    assert "no such prefix cache file" in capsys.readouterr().err
    assert main(["cache", "info", str(path), "--text", "--model", str(smollm2_gguf()), "--dtype", "bfloat16"]) == 2
    assert "saved for another setup (dtype: file has 'float32', this model has 'bfloat16')" in capsys.readouterr().err
