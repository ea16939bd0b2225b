"""The fixed-shape decode path (CUDA graphs on CUDA) against the reference runner: same logits, same tokens."""

import pytest
import torch

from kvtool import SamplingParams
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from kvtool.engine.static import StaticDecoder, fast_decode_enabled
from kvtool.errors import ContextWindowError, InvalidParameterError
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner


BF16_TOL = 0.1  # logits of the fast and reference paths in bf16: same math, different rounding order


def decisive_mismatches(ref_logits: torch.Tensor, logits: torch.Tensor, tol: float = BF16_TOL) -> int:
    """Steps where the greedy tokens differ although the reference's top-2 gap exceeds 2 * tol.
    Random weights give near-uniform logits, so bf16 rounding alone may flip near-ties."""
    top2 = ref_logits.float().topk(2, -1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 2 * tol
    return int(((logits.argmax(-1) != ref_logits.argmax(-1)) & decisive).sum())


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


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_extend_matches_the_reference_prefill(family, tmp_path):
    tiny_checkpoint(family, tmp_path)
    runner = tiny_runner(family, tmp_path)
    ids = torch.randint(0, runner.spec.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = runner.new_cache()
    dec = StaticDecoder(runner, max_len=64, bucket_tokens=8)
    dec.load(runner.new_cache())
    # from empty (causal, 11 tokens padded to 16), then after it (masked window), then a decode step
    for lo, hi in ((0, 11), (11, 18), (18, 37)):
        want = runner.prefill(ids[lo:hi], ref)
        got = dec.extend(ids[lo:hi])
        assert (got - want).abs().max().item() < 1e-4, (lo, hi)
    assert (dec.step(ids[37]) - runner(torch.tensor([ids[37]]), ref)).abs().max().item() < 1e-4
    cache = runner.new_cache()
    dec.store(cache)
    assert cache.offset == ref.offset == 38
    for a, b in zip(cache.layers, ref.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    # a prefilled cache loaded, then extended: the prefix-cache hit path
    hit = runner.new_cache()
    runner.prefill(ids[:30], hit)
    dec.load(hit)
    assert (dec.extend(ids[30:40]) - runner.prefill(ids[30:40], hit.clone())).abs().max().item() < 1e-4
    with pytest.raises(ContextWindowError, match="do not fit"):
        dec.extend(ids * 2)
    dec.store(hit)


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
    prompt = smollm2.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
    ref = Engine(smollm2, EngineConfig(fast_decode="off"))
    fast = Engine(smollm2, EngineConfig(fast_decode="on", static_max_tokens=512))
    want = ref.generate(prompt, SamplingParams(**PARAMS)).run()
    got = fast.generate(prompt, SamplingParams(**PARAMS)).run()
    assert got.token_ids == want.token_ids and got.text == want.text
    rows = fast.scheduler.static
    assert rows is not None and rows.max_len == 512 and sorted(rows.free) == list(range(rows.slots))  # all handed back
    # a generation that would outgrow the static rows runs through the reference path from the start
    small = Engine(smollm2, EngineConfig(fast_decode="on", static_max_tokens=len(prompt) + 8))
    moved = small.generate(prompt, SamplingParams(**PARAMS)).run()
    assert moved.token_ids == want.token_ids and len(want.token_ids) > 9
    assert not small.scheduler.static.fits(len(prompt) + PARAMS["max_tokens"])
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
    prompts = [smollm2.encode_chat([{"role": "user", "content": q}]) for q in ("Hi!", "What is 2+2?")]
    a, b = (fast.generate(p, SamplingParams(**PARAMS)) for p in prompts)
    ia, ib = iter(a), iter(b)
    for _ in range(8):  # both run in the engine's scheduler, each in a static row
        next(ia, None)
        next(ib, None)
    a.run(), b.run()
    for p, g in zip(prompts, (a, b)):
        assert g.token_ids == ref.generate(p, SamplingParams(**PARAMS)).run().token_ids
    # the decoded KV reached the request cache: the same conversation continued hits the prefix cache
    again = fast.generate(prompts[0] + a.token_ids[:-1], SamplingParams(temperature=0, max_tokens=2)).run()
    assert again.timings.cached_tokens >= len(prompts[0]) + len(a.token_ids) - 1 - 16
    long = fast.generate(prompts[0], SamplingParams(temperature=0, max_tokens=400))
    assert not fast.scheduler.static.fits(len(prompts[0]) + 400)  # beyond static_max_tokens: reference path
    first = [event.token_id for _, event in zip(range(12), long)]
    long.close()
    assert first == ref.generate(prompts[0], SamplingParams(temperature=0, max_tokens=12)).run().token_ids[:len(first)]


def assert_bf16_steps_agree(runner, dec, ref_cache, ref_logits, steps: int) -> None:
    """Teacher-forced on the reference's greedy tokens: logits within BF16_TOL, no decisive mismatch."""
    ref_tok = int(ref_logits.argmax(-1))
    for step in range(steps):
        ref_logits = runner(torch.tensor([ref_tok], device=runner.device), ref_cache)
        logits = dec.step(ref_tok)
        diff = (logits - ref_logits).abs().max().item()
        assert diff <= BF16_TOL and decisive_mismatches(ref_logits, logits) == 0, f"step {step}: diff {diff}"
        ref_tok = int(ref_logits.argmax(-1))


def test_static_steps_in_bf16_agree_with_the_reference(tmp_path):
    from transformers import AutoConfig

    from kvtool.models.loading import build_runner
    from kvtool.models.spec import ModelSpec

    tiny_checkpoint("qwen3", tmp_path)
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    runner = build_runner(ModelSpec.from_hf_config(cfg), cfg, tmp_path, torch.device("cpu"), torch.bfloat16,
                          progress=False)
    ref_cache, ref_logits = prefilled(runner, 20)
    ids = torch.randint(0, runner.spec.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = runner.new_cache()
    runner.prefill(ids[:12], cache)
    dec = StaticDecoder(runner, max_len=128, bucket_tokens=16)
    dec.load(cache)
    got = dec.extend(ids[12:])  # the same 20 tokens: 12 loaded, 8 through extend()
    assert (got - ref_logits).abs().max().item() <= BF16_TOL and decisive_mismatches(ref_logits, got) == 0
    assert_bf16_steps_agree(runner, dec, ref_cache, ref_logits, 40)


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
    ids = torch.randint(0, runner.spec.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    hit = runner.new_cache()
    runner.prefill(ids[:256], hit)
    for cache, rest in ((runner.new_cache(), ids), (hit, ids[256:])):  # cold (causal graph), then a prefix hit
        dec = StaticDecoder(runner, max_len=1024)
        assert dec.use_graphs
        dec.load(cache)
        for _ in range(2):  # the second call replays the captured graph
            dec.batched.length[0] = cache.offset
            got = dec.extend(rest)
            assert (got - ref_logits).abs().max().item() <= BF16_TOL and decisive_mismatches(ref_logits, got) == 0
    assert_bf16_steps_agree(runner, dec, ref_cache.clone(), ref_logits, 64)
    assert dec.captured_buckets == [512] and ("extend", 0, 64, 512, False) in dec.batched._graphs


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
    for _ in range(32):
        want = runner.forward_batch([([t], c) for t, c in zip(toks, refs)])
        got = dec.step(dict(zip(slots, toks)))
        for s, w in zip(slots, want):
            assert (got[s] - w).abs().max().item() <= BF16_TOL and decisive_mismatches(w, got[s]) == 0
        toks = [int(w.argmax(-1)) for w in want]
    assert dec.use_graphs and (4, 512) in dec._graphs


VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "transpose", "t", "unsqueeze", "squeeze", "expand",
            "chunk", "split", "split_with_sizes", "detach", "detach_", "alias", "lift_fresh", "as_strided"}


def test_decode_step_dispatches_few_ops_per_layer(tmp_path):
    """Kernel launches bound batch-1 decode on a GPU; the step keeps to ~20 non-view ops a layer in bf16
    (the reference layer dispatches about 40: casts around every norm, rotate_half, repeated K/V)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig

    from kvtool.models.loading import build_runner
    from kvtool.models.spec import ModelSpec

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in VIEW_OPS and not (name == "reshape" and args[0].numel() == 0):
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    tiny_checkpoint("qwen3", tmp_path)
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    runner = build_runner(ModelSpec.from_hf_config(cfg), cfg, tmp_path, torch.device("cpu"), torch.bfloat16,
                          progress=False)
    cache, _ = prefilled(runner, 10)
    dec = StaticDecoder(runner, max_len=64, bucket_tokens=16)
    dec.load(cache)
    dec.step(3)
    with Count() as fast:
        dec.step(4)
    with Count() as ref:
        runner(torch.tensor([4]), cache)
    layers = runner.spec.num_layers
    assert sum(fast.ops.values()) <= 20 * layers + 16, fast.ops  # + embedding, mask, final norm, lm_head
    assert sum(ref.ops.values()) >= 1.5 * sum(fast.ops.values()), (ref.ops, fast.ops)


@pytest.mark.gpu
def test_engine_on_gpu_samples_there_and_matches_the_reference(tmp_path):
    """Prefill, decode and sampling all on CUDA: fast path vs reference, greedy and seeded top-p."""
    from kvtool.bench.loading import from_checkpoint

    tiny_checkpoint("qwen3", tmp_path)
    bm = from_checkpoint(tmp_path, "tiny-qwen3", device="cuda", dtype="float32")
    fast, ref = Engine(bm.model), Engine(bm.model, EngineConfig(fast_decode="off"))
    prompt = list(range(3, 40))
    for params in (dict(temperature=0, max_tokens=24), dict(temperature=0.9, top_p=0.8, seed=3, max_tokens=24),
                   dict(temperature=0, max_tokens=8, logprobs=2)):
        got = fast.generate(prompt, SamplingParams(**params)).run()
        assert got.token_ids == ref.generate(prompt, SamplingParams(**params)).run().token_ids, params
    assert fast.scheduler.static is not None and fast.scheduler.static.use_graphs
    assert fast.generate(prompt, SamplingParams(temperature=0.9, seed=3, max_tokens=24)).run().token_ids == \
        fast.generate(prompt, SamplingParams(temperature=0.9, seed=3, max_tokens=24)).run().token_ids


def test_prefill_padding_keeps_few_shapes_and_little_waste():
    from kvtool.engine.static import padded_length

    assert [padded_length(t, 8192) for t in (1, 16, 17, 300, 512, 513, 4096, 8256)] == \
        [16, 16, 32, 512, 512, 1024, 4096, 8192]
    assert padded_length(8300, 10000) == 8704 and padded_length(40, 30) == 30
    assert len({padded_length(t, 8192) for t in range(1, 8193)}) == 6 + 15  # 16..512, then 1024, 1536, .., 8192
