"""The fixed-shape decode path (CUDA graphs on CUDA) against the reference runner: same logits, same tokens."""

import pytest
import torch

from kvtool import SamplingParams
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from kvtool.engine.static import StaticDecoder, fast_decode_enabled
from kvtool.errors import ContextWindowError, InvalidParameterError
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner


def prefilled(runner, n, seed=0):
    ids = torch.randint(0, runner.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = runner.new_cache()
    logits = runner.prefill(ids, cache)
    return cache, logits


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_static_steps_match_the_reference_across_buckets(family, tmp_path):
    tiny_checkpoint(family, tmp_path)
    runner = tiny_runner(family, tmp_path)
    ref_cache, ref_logits = prefilled(runner, 11)
    cache, logits = prefilled(runner, 11)
    dec = StaticDecoder(runner, max_len=64, bucket_tokens=8)  # 11 + 30 tokens cross four buckets
    dec.load(cache)
    tok = int(logits.argmax(-1))
    for step in range(30):
        ref_logits = runner(torch.tensor([tok]), ref_cache)
        logits = dec.step(tok)
        assert (logits - ref_logits).abs().max().item() < 1e-4, f"step {step}"
        assert int(logits.argmax(-1)) == int(ref_logits.argmax(-1))
        tok = int(ref_logits.argmax(-1))
    dec.store(cache)
    assert cache.offset == ref_cache.offset == 41 and not dec.busy
    for a, b in zip(cache.layers, ref_cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


def test_full_decoder_and_bad_sizes_are_clear_errors(tmp_path):
    tiny_checkpoint("qwen3", tmp_path)
    runner = tiny_runner("qwen3", tmp_path)
    cache, logits = prefilled(runner, 6)
    dec = StaticDecoder(runner, max_len=8)
    dec.load(cache)
    dec.step(1)
    dec.step(2)
    with pytest.raises(ContextWindowError, match="full"):
        dec.step(3)
    dec.store(cache)
    with pytest.raises(ContextWindowError, match="holds 8 tokens"):
        dec.load(cache)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticDecoder(runner, max_len=8, graphs=True) if runner.device.type != "cuda" else pytest.skip("CUDA here")
    with pytest.raises(InvalidParameterError, match="fast_decode must be one of"):
        fast_decode_enabled("fast", runner.device)
    assert fast_decode_enabled("auto", torch.device("cuda")) and not fast_decode_enabled("auto", torch.device("cpu"))


PARAMS = dict(temperature=0, max_tokens=32)


@pytest.mark.real_model
def test_engine_fast_path_gives_the_reference_tokens_and_cache(smollm2):
    prompt = smollm2.encode(smollm2.render([{"role": "user", "content": "Name three rivers in Europe."}]))
    ref = Engine(smollm2, EngineConfig(fast_decode="off"))
    fast = Engine(smollm2, EngineConfig(fast_decode="on", static_max_tokens=512))
    want = ref.generate(prompt, SamplingParams(**PARAMS)).run()
    got = fast.generate(prompt, SamplingParams(**PARAMS)).run()
    assert got.token_ids == want.token_ids and got.text == want.text
    assert fast._static is not None and not fast._static.busy
    # sampling with a seed runs on the same logits: same tokens as well
    sampled = dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=24)
    assert (fast.generate(prompt, SamplingParams(**sampled)).run().token_ids
            == ref.generate(prompt, SamplingParams(**sampled)).run().token_ids)


@pytest.mark.real_model
def test_interleaved_generations_and_long_requests_fall_back(smollm2):
    from kvtool.cache.manager import attach_prefix_cache

    fast = Engine(smollm2, EngineConfig(fast_decode="on", static_max_tokens=256))
    attach_prefix_cache(fast, budget_bytes=64 << 20)
    ref = Engine(smollm2, EngineConfig(fast_decode="off"))
    prompts = [smollm2.encode(smollm2.render([{"role": "user", "content": q}])) for q in ("Hi!", "What is 2+2?")]
    a, b = (fast.generate(p, SamplingParams(**PARAMS)) for p in prompts)
    ia, ib = iter(a), iter(b)
    for _ in range(8):  # a holds the static decoder; b takes the reference path meanwhile
        next(ia, None)
        next(ib, None)
    a.run(), b.run()
    for p, g in zip(prompts, (a, b)):
        assert g.token_ids == ref.generate(p, SamplingParams(**PARAMS)).run().token_ids
    # the decoded KV reached the request cache: the same conversation continued hits the prefix cache
    again = fast.generate(prompts[0] + a.token_ids[:-1], SamplingParams(temperature=0, max_tokens=2)).run()
    assert again.timings.cached_tokens >= len(prompts[0]) + len(a.token_ids) - 1 - 16
    long = fast.generate(prompts[0], SamplingParams(temperature=0, max_tokens=400))
    assert fast.static_decoder(len(prompts[0]) + 400) is None  # beyond static_max_tokens: reference path
    long.close()


@pytest.mark.gpu
def test_cuda_graph_decode_matches_the_reference_on_gpu(tmp_path):
    from kvtool.testing.tiny import qwen3_0_6b_config, random_checkpoint
    from kvtool.models.loading import build_runner
    from kvtool.models.spec import ModelSpec
    from transformers import AutoConfig

    folder = random_checkpoint(qwen3_0_6b_config(), tmp_path)
    cfg = AutoConfig.from_pretrained(str(folder))
    runner = build_runner(ModelSpec.from_hf_config(cfg), cfg, folder, torch.device("cuda"), torch.bfloat16)
    ref_cache, ref_logits = prefilled(runner, 300)
    cache, logits = prefilled(runner, 300)
    dec = StaticDecoder(runner, max_len=1024)
    assert dec.use_graphs
    dec.load(cache)
    tok, ref_tok = int(logits.argmax(-1)), int(ref_logits.argmax(-1))
    same = 0
    for _ in range(64):
        ref_logits = runner(torch.tensor([ref_tok], device="cuda"), ref_cache)
        logits = dec.step(ref_tok)
        same += int(logits.argmax(-1)) == int(ref_logits.argmax(-1))
        ref_tok = int(ref_logits.argmax(-1))
    dec.store(cache)
    assert same >= 62, f"only {same}/64 greedy tokens agree (bf16)"
    assert dec.captured_buckets == [512]


@pytest.mark.gpu
def test_batched_cuda_graph_decode_matches_forward_batch_on_gpu(tmp_path):
    from transformers import AutoConfig

    from kvtool.engine.static import BatchedStaticDecoder
    from kvtool.models.loading import build_runner
    from kvtool.models.spec import ModelSpec
    from kvtool.testing.tiny import qwen3_0_6b_config, random_checkpoint

    folder = random_checkpoint(qwen3_0_6b_config(), tmp_path)
    cfg = AutoConfig.from_pretrained(str(folder))
    runner = build_runner(ModelSpec.from_hf_config(cfg), cfg, folder, torch.device("cuda"), torch.bfloat16)
    pairs = [prefilled(runner, n, seed=n) for n in (40, 300, 129)]
    refs = [prefilled(runner, n, seed=n)[0] for n in (40, 300, 129)]
    dec = BatchedStaticDecoder(runner, slots=8, max_len=1024)
    slots = [dec.load(cache) for cache, _ in pairs]
    toks = [int(logits.argmax(-1)) for _, logits in pairs]
    same = total = 0
    for _ in range(32):
        want = runner.forward_batch([([t], c) for t, c in zip(toks, refs)])
        got = dec.step(dict(zip(slots, toks)))
        for s, w in zip(slots, want):
            same += int(got[s].argmax(-1)) == int(w.argmax(-1))
            total += 1
        toks = [int(w.argmax(-1)) for w in want]
    assert same >= total - 3, f"only {same}/{total} greedy tokens agree (bf16)"
    assert dec.use_graphs and (4, 512) in dec._graphs
