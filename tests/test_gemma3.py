"""Gemma 3 270M (the real GGUF, session fixture): parity with transformers, per-layer RoPE in skill relocation,
sliding-window layers in attention views, compose notes, the prefix cache, and the served OpenAI routes."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch

from kvtool.errors import ModelLoadError

pytestmark = pytest.mark.real_model

WINDOW_CROSSING = 560  # tokens: past the 512-token window of the sliding layers


def long_ids(model, n: int = WINDOW_CROSSING) -> list[int]:
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box on shelf {i % 7}." for i in range(200))
    return model.encode(text)[:n]  # <bos> first, as the tokenizer adds it


def test_the_gguf_is_assembled_from_its_pieces_with_the_listed_sha256(gemma3):
    from kvtool.models.offline import GEMMA_SIZE, gemma3_gguf

    path = gemma3_gguf(install=False)
    assert path.stat().st_size == GEMMA_SIZE
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest.startswith("a5fd3b62")


def test_a_wrong_sha256_is_refused(tmp_path):
    from kvtool.models.offline import _concatenate

    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"GGUF" + b"\0" * 12)
    parts[1].write_bytes(b"\1" * 16)
    with pytest.raises(ModelLoadError, match="sha256"):
        _concatenate(parts, tmp_path / "out.gguf", 32, "test", sha256="0" * 64)
    assert not (tmp_path / "out.gguf").exists()
    good = hashlib.sha256(parts[0].read_bytes() + parts[1].read_bytes()).hexdigest()
    assert _concatenate(parts, tmp_path / "out.gguf", 32, "test", sha256=good).stat().st_size == 32


def test_spec_has_local_and_global_layers_and_two_rope_bases(gemma3):
    spec, runner = gemma3.spec, gemma3.runner
    assert spec.model_type == "gemma3_text" and spec.num_layers == 18
    assert [i for i in range(18) if i not in spec.sliding_layers] == [5, 11, 17]
    assert spec.sliding_window == 512
    assert spec.rope["rope_theta"] == 1e6 and spec.rope_local["rope_theta"] == 1e4
    assert torch.equal(runner.layer_inv_freq(0), runner.inv_freq_local)
    assert torch.equal(runner.layer_inv_freq(5), runner.inv_freq)
    assert not torch.allclose(runner.inv_freq, runner.inv_freq_local)
    # a hit stores every layer's KV of every token; attention can read only the window on 15 of 18 layers
    stored = spec.kv_bytes_per_token(4) * 4096
    assert spec.kv_bytes_read(4096, 4) == stored * (3 * 4096 + 15 * 512) // (18 * 4096)


def test_chat_template_and_end_of_turn(gemma3):
    text = gemma3.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert gemma3.tokenizer.convert_tokens_to_ids("<end_of_turn>") in gemma3.end_of_turn_ids()


def test_logits_match_transformers_across_the_window(gemma3, gemma3_hf):
    ids = long_ids(gemma3)
    with torch.no_grad():
        want = torch.log_softmax(gemma3_hf(torch.tensor([ids])).logits[0].float(), -1)
    got = torch.log_softmax(gemma3.runner.prefill(ids, gemma3.runner.new_cache(), chunk=200, logits="all"), -1)
    assert (got - want).abs().max().item() < 2e-3
    assert torch.equal(got[-40:].argmax(-1), want[-40:].argmax(-1))


def test_greedy_tokens_match_transformers(gemma3, gemma3_hf):
    from kvtool import SamplingParams
    from kvtool.engine import Engine

    prompt = gemma3.encode_chat([{"role": "user", "content": "Name three colours."}])
    with torch.no_grad():
        want = gemma3_hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    out = Engine(gemma3).generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)).run()
    assert out.token_ids == want


def test_relocated_skill_keys_use_each_layers_rope_base(gemma3):
    """Keys relocated by delta equal the keys a forward at the shifted positions computes, on local and global
    layers alike; one base for every layer would be wrong on the local ones."""
    from kvtool.kernels import rerotate
    from kvtool.skills.repair import rerotate_layers

    runner, ids, delta = gemma3.runner, long_ids(gemma3, 64), 300
    at0, shifted = runner.new_cache(), runner.new_cache()
    runner.forward(ids, at0, logits="none")
    runner.forward(ids, shifted, positions=torch.arange(delta, delta + len(ids)), logits="none")
    keys0, _ = at0.stacked(0, len(ids))
    want, _ = shifted.stacked(0, len(ids))
    moved = rerotate_layers(runner, keys0, delta)
    assert (moved - want).abs().max().item() < 1e-3
    one_base = rerotate(keys0.contiguous(), delta, runner.inv_freq)
    assert (one_base[runner.spec.sliding_layers] - want[runner.spec.sliding_layers]).abs().max().item() > 0.1


def test_compose_says_when_a_block_is_beyond_the_window_and_still_runs(gemma3):
    from kvtool.cache.kvfile import setup_of
    from kvtool.skills import compose
    from kvtool.skills.block import compile_ids
    from kvtool.skills.compose import SkillWindowWarning

    runner = gemma3.runner
    bos = [gemma3.tokenizer.bos_token_id]
    block = compile_ids(runner, gemma3.encode_rendered("Skill: answer in French, in one short sentence."),
                        setup_of(gemma3), "french", preamble=bos)
    filler = long_ids(gemma3, 540)[1:]
    query = gemma3.encode_rendered(" What colour is item 3?")
    with pytest.warns(SkillWindowWarning, match="only the 3 global layers attend to it"):
        far = compose(runner, bos, [block], filler + query)
    assert far.logits.shape == (1, gemma3.spec.vocab_size) and torch.isfinite(far.logits).all()
    assert far.stats()["notes"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkillWindowWarning)
        near = compose(runner, bos, [block], query)
    assert near.notes == []


def test_attention_views_mark_local_layers_and_respect_the_window(gemma3):
    from kvtool.viz.heatmap import compute_heatmap
    from kvtool.viz.probs import attention_rows
    from kvtool.viz.tokens import make_tokens

    ids = long_ids(gemma3)
    last = len(ids) - 1
    probs = attention_rows(gemma3, ids, [0, 5], [0], [last])[:, 0, 0]  # [2 layers, S]
    assert probs[0, : last - 511].sum().item() == 0.0  # layer 0 is local: nothing beyond the window
    assert probs[1, : last - 511].sum().item() > 0.0  # layer 5 is global
    assert torch.allclose(probs.sum(-1), torch.ones(2), atol=1e-4)
    data = compute_heatmap(gemma3, make_tokens(gemma3, ids[:40]), [0, 5], [0])
    assert data.meta["sliding_layers"] == [0] and data.meta["sliding_window"] == 512
    assert "local" in data.titles[0] and "local" not in data.titles[1]


def test_prefix_cache_hit_gives_the_same_tokens(gemma3):
    from kvtool import SamplingParams
    from kvtool.cache.manager import attach_prefix_cache
    from kvtool.engine import Engine

    system = "You answer questions about a warehouse inventory. " + " ".join(
        f"Box {i} holds {i * 3} bolts." for i in range(60))
    prompts = [gemma3.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in ("How many bolts are in box 7?", "How many bolts are in box 12?")]
    params = SamplingParams(temperature=0, max_tokens=6)
    plain = [Engine(gemma3).generate(p, params).run().token_ids for p in prompts]
    cached = Engine(gemma3)
    attach_prefix_cache(cached, budget_bytes=256 << 20)
    outs = [cached.generate(p, params).run() for p in prompts]
    assert [o.token_ids for o in outs] == plain
    assert outs[1].timings.cached_tokens > 400  # the shared system prompt, past the sliding window, came from the cache
