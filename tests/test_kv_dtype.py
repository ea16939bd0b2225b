"""EngineConfig.kv_dtype: an engine's KV blocks in bf16 under an fp32 model on the C++ CPU path (keys and values
rounded as written, widened to fp32 as read), against fp32 blocks on SmolLM2: logits, greedy tokens, and every
path that reads or writes the pool (prefix hits, n choices, preemption, the cache file, the reference forward)."""

from types import SimpleNamespace

import pytest
import torch

from kvtool import SamplingParams
from kvtool.cache.kv import KVCache
from kvtool.cache.manager import attach_prefix_cache
from kvtool.cache.store import BlockPool, kv_dtype
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from kvtool.errors import InvalidParameterError
from kvtool.models.layers import ForwardPlan
from kvtool.testing.ops import ops_of

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based inks and a wooden press adapted from those used for wine. Within decades, presses "
        "spread across Europe, books became cheaper, and literacy rose. Scholars could compare identical copies of a "
        "text, which changed how knowledge was checked and shared. ") * 3
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def paged(runner, dtype):
    """An empty paged cache whose blocks come from an unsized pool of `dtype`, as an engine's requests' do."""
    pool = BlockPool.for_runner(runner, 16, 0, dtype)
    return KVCache.paged([], pool.take(), 0, 0, pool.take)


def logits_over(runner, ids, dtype, decode, path="auto"):
    """Logits of a prefill of ids (every row) then of `decode` tokens fed one by one, over a paged cache of dtype."""
    cache = paged(runner, dtype)
    rows = [runner.run(ForwardPlan([(ids, cache)], None, "all", None, path))[0]]
    for token in decode:
        rows.append(runner.run(ForwardPlan([([token], cache)], None, "last", None, path))[0])
    return torch.cat(rows), cache


@pytest.mark.real_model
def test_bf16_kv_logits_stay_close_to_fp32_kv_on_smollm2(smollm2):
    """A 184-token prefill and 24 decode steps of real text: top-1 agreement and the largest logit difference between
    bf16 and fp32 blocks (measured: every top-1 the same, max |diff| 0.18); both through the C++ ops, and the
    reference forward over the same bf16 cache agrees with them."""
    runner = smollm2.runner
    ids = smollm2.encode(TEXT)
    prompt, follow = ids[:-24], ids[-24:]
    assert len(prompt) > 150
    assert "kvtool_cpu::prefill_attention" in ops_of(lambda: logits_over(runner, prompt[:20], torch.bfloat16, []))
    assert "kvtool_cpu::layers" in ops_of(lambda: logits_over(runner, prompt[:20], torch.bfloat16, [5]))
    fp32, _ = logits_over(runner, prompt, torch.float32, follow)
    bf16, cache = logits_over(runner, prompt, torch.bfloat16, follow)
    assert cache.layers[0].blocks and all(b.dtype == torch.bfloat16 for b in cache.layers[0].blocks)
    agree = (fp32.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    diff = (fp32 - bf16).abs().max().item()
    print(f"bf16 / fp32 KV: top-1 agreement {agree:.4f}, max |logit diff| {diff:.4f}")
    assert agree >= 0.98 and diff < 0.5, (agree, diff)
    reference, _ = logits_over(runner, prompt, torch.bfloat16, follow, "reference")
    assert (reference.argmax(-1) == bf16.argmax(-1)).float().mean().item() >= 0.98
    assert (reference - bf16).abs().max().item() < 0.5


@pytest.mark.real_model
def test_a_bf16_kv_engine_answers_greedily_as_an_fp32_kv_one(smollm2):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    ids = smollm2.encode_chat(QUESTION)
    engines = {dtype: Engine(smollm2, EngineConfig(kv_dtype=dtype)) for dtype in ("float32", "bfloat16")}
    assert {d: e.pool.dtype for d, e in engines.items()} == {"float32": torch.float32, "bfloat16": torch.bfloat16}
    answers = {d: e.generate(ids, greedy).run() for d, e in engines.items()}
    assert answers["bfloat16"].token_ids == answers["float32"].token_ids
    assert "Paris" in answers["bfloat16"].text


def bf16_blocks(model, n, size):
    """Bytes of n bf16 KV blocks of `size` tokens for this model."""
    return n * size * model.runner.spec.kv_bytes_per_token(2)


@pytest.mark.real_model
def test_prefix_hits_n_choices_preemption_and_the_cache_file_work_on_a_bf16_pool(smollm2, tmp_path):
    """On a pool of seven bf16 blocks (and four for the prefix cache): four chat requests crowd it (preempted and
    recomputed), then one prompt's two choices (a fork) and a prefix hit; the greedy tokens are those of a large bf16
    pool with no prefix cache. The cache saved to a file loads into a bf16 engine and an fp32 one (converted as read)
    and hits there."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    questions = ["Name three colours.", "What is two plus two?", "Say hello in French.", "Count to five."]
    prompts = [smollm2.encode_chat([{"role": "user", "content": q}]) for q in questions]
    plain = Engine(smollm2, EngineConfig(kv_dtype="bfloat16"))
    want = [g.token_ids for g in plain.generate_batch(prompts, greedy)]
    engine = Engine(smollm2, EngineConfig(kv_dtype="bfloat16", prefill_chunk=64, prefix_block=16,
                                          kv_bytes=bf16_blocks(smollm2, 7, 16),
                                          cache_bytes=bf16_blocks(smollm2, 4, 16),
                                          cache_file=str(tmp_path / "bf16.kvc")))
    cache = attach_prefix_cache(engine)
    assert engine.pool.dtype == torch.bfloat16 and engine.pool.blocks == 11 and cache.store.dtype == torch.bfloat16
    gens = [engine.scheduler.submit(p, greedy) for p in prompts]
    engine.scheduler.run()
    assert [g.token_ids for g in gens] == want and engine.scheduler.preemptions > 0
    cache.check_integrity()
    two = engine.generate_batch([prompts[1]], greedy, n=2)
    assert [g.token_ids for g in two] == [want[1], want[1]]
    hits = cache.stats()["hit_tokens"]
    assert engine.generate(prompts[1], greedy).run().token_ids == want[1] and cache.stats()["hit_tokens"] > hits
    cache.save(tmp_path / "bf16.kvc", smollm2)
    for dtype in ("bfloat16", "float32"):
        other = Engine(smollm2, EngineConfig(kv_dtype=dtype, cache_file=str(tmp_path / "bf16.kvc")))
        loaded = attach_prefix_cache(other)
        assert loaded.loaded["loaded_tokens"] > 0 and loaded.store.dtype == getattr(torch, dtype)
        assert other.generate(prompts[1], greedy).run().token_ids == want[1]
        assert loaded.stats()["hit_tokens"] > 0


def test_kv_dtype_is_checked_and_auto_follows_the_weights():
    with pytest.raises(InvalidParameterError, match="kv_dtype='float16': must be one of auto, float32, bfloat16"):
        EngineConfig(kv_dtype="float16").validate()
    fp32 = SimpleNamespace(dtype=torch.float32, weights="dense")
    bf16_weights = SimpleNamespace(dtype=torch.float32, weights="bf16")

    def pick(setting, runner, paged):
        return kv_dtype(EngineConfig(kv_dtype=setting), runner, paged)

    assert pick("auto", fp32, True) == torch.float32 and pick("auto", bf16_weights, True) == torch.bfloat16
    assert pick("auto", bf16_weights, False) == torch.float32  # the reference forward keeps the model's
    assert pick("bfloat16", fp32, True) == torch.bfloat16 and pick("float32", bf16_weights, True) == torch.float32
    with pytest.raises(InvalidParameterError, match="this engine runs the reference forward"):
        pick("bfloat16", fp32, False)


@pytest.mark.real_model
def test_a_reference_forward_engine_refuses_a_bf16_kv(smollm2):
    with pytest.raises(InvalidParameterError, match="kv_dtype='bfloat16'.*cannot be used here: this engine runs the "
                                                    "reference forward"):
        Engine(smollm2, EngineConfig(kv_dtype="bfloat16", forward="reference"))


def test_skill_blocks_keep_the_model_dtype():
    """Skill blocks' repair (kvtool.skills.selective) attends over the cache in the model's dtype: with skills_dir, auto
    keeps it and bfloat16 is refused when the engine is built."""
    bf16_weights = SimpleNamespace(dtype=torch.float32, weights="bf16")
    assert kv_dtype(EngineConfig(kv_dtype="auto", skills_dir="skills"), bf16_weights, True) == torch.float32
    with pytest.raises(InvalidParameterError, match="skill blocks .skills_dir. are repaired in the model's dtype"):
        kv_dtype(EngineConfig(kv_dtype="bfloat16", skills_dir="skills"), bf16_weights, True)
