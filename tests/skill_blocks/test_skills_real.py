"""Skill blocks on the real SmolLM2 (and Qwen2.5) GGUF models: render, compile, cache, splice, eval, CLI."""

import json
import warnings

import pytest
import torch

import kvtool
from kvtool.engine import Engine
from kvtool.errors import CacheFormatError
from kvtool.skills import SkillSplicer, compile_skill, compose, load_block, load_catalog, parse_skill, save_block
from kvtool.skills.render import render_skill

pytestmark = pytest.mark.real_model

HAIKU = ("---\nname: haiku\ndescription: Write haiku poems.\n---\n# Haiku\nWrite exactly three lines of 5, 7 and 5 "
         "syllables. Use one seasonal word. No title, no rhyme, no punctuation at the end of a line.\n")
LIMERICK = ("---\nname: limerick\ndescription: Write limericks.\n---\n# Limerick\nFive lines, rhyme scheme AABBA. "
            "Lines 1, 2 and 5 have three stressed beats; lines 3 and 4 have two. End with a twist.\n")


@pytest.fixture(scope="module")
def skills_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("skills")
    (d / "haiku.md").write_text(HAIKU)
    (d / "limerick.md").write_text(LIMERICK)
    return d


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvb")


@pytest.fixture(scope="module")
def catalog(smollm2, skills_dir, cache_dir):
    logs = []
    catalog = load_catalog(skills_dir, smollm2, cache_dir=cache_dir, log=logs.append)
    assert sum("compiled skill" in m for m in logs) == 2
    return catalog


def conversation_ids(model, catalog, *names):
    msgs = [{"role": "user", "content": "Write me two short poems about autumn."}]
    for name in names:
        msgs += catalog.messages(name)
    msgs.append({"role": "user", "content": "Now write them."})
    return model.encode_chat(msgs)


def test_render_is_a_whole_turn_and_boundary_safe(smollm2, catalog):
    r = render_skill(smollm2, parse_skill(HAIKU))
    assert r.text.startswith("<|im_start|>") and r.text.endswith("<|im_end|>\n") and r.boundary_safe
    ids = conversation_ids(smollm2, catalog, "haiku", "limerick")
    found = catalog.find(ids)
    assert [m.name for m, _ in found] == ["haiku", "limerick"]
    assert all(ids[m.start:m.end] == b.token_ids for m, b in found)


def test_catalog_is_cached_by_fingerprint_and_recompiles_tampered(smollm2, skills_dir, catalog, cache_dir):
    path = catalog.paths["haiku"]
    assert path.parent.parent == cache_dir and path.suffix == ".kvb"
    logs = []
    again = load_catalog(skills_dir, smollm2, cache_dir=cache_dir, log=logs.append)
    assert logs == [] and torch.equal(again.block("haiku").keys, catalog.block("haiku").keys)
    data = bytearray(path.read_bytes())
    data[-50] ^= 1
    path.write_bytes(bytes(data))
    load_catalog(skills_dir, smollm2, cache_dir=cache_dir, log=logs.append)
    assert any("recompiling skill 'haiku'" in m and "checksum mismatch" in m for m in logs)
    assert load_block(path).name == "haiku"  # rewritten


def test_block_metadata_records_the_setup(smollm2, catalog):
    block = catalog.block("haiku")
    fp = smollm2.fingerprint()
    assert {k: block.setup[k] for k in fp} == {k: str(v) for k, v in fp.items()}
    assert json.loads(block.setup["rope"])["rope"]["rope_theta"] == 100000.0
    assert block.canonical_start > 0 and block.meta["text"].count("# Haiku") == 1
    assert block.meta["render"] == "tool" and len(block.meta["text_sha256"]) == 64


def test_relocated_layer0_kv_equals_full_prefill(smollm2, catalog):
    blocks = [catalog.block("haiku"), catalog.block("limerick")]
    prefix, suffix = smollm2.encode_rendered("<|im_start|>user\nHello there, poet.<|im_end|>\n"), [198]
    out = compose(smollm2.runner, prefix, blocks, suffix, repair="none")
    seq = prefix + blocks[0].token_ids + blocks[1].token_ids + suffix
    ref = smollm2.runner.new_cache(len(seq) + 1)
    smollm2.runner.prefill(seq, ref)
    k, v = out.cache.stacked()
    k_ref, v_ref = ref.stacked()
    assert (k[0] - k_ref[0]).abs().max().item() < 1e-4 * k_ref[0].abs().max().item()
    assert (v[0] - v_ref[0]).abs().max().item() < 1e-4 * v_ref[0].abs().max().item()


def test_engine_splices_blocks_and_full_recompute_matches_plain(smollm2, catalog):
    ids = conversation_ids(smollm2, catalog, "haiku", "limerick")
    params = kvtool.SamplingParams(temperature=0, max_tokens=2)
    plain = Engine(smollm2).generate(ids, params).run()
    exact = SkillSplicer(catalog, repair="recompute_first_k:k=100000")
    same = Engine(smollm2, prefix_cache=exact).generate(ids, params).run()
    assert same.token_ids == plain.token_ids
    cheap = SkillSplicer(catalog, repair="none")
    gen = Engine(smollm2, prefix_cache=cheap).generate(ids, params).run()
    stats = cheap.last_stats
    n_blocks = len(catalog.block("haiku")) + len(catalog.block("limerick"))
    assert stats.block_tokens == n_blocks and stats.reused_block_tokens == n_blocks
    assert gen.timings.skill_block_tokens == n_blocks and gen.timings.cached_tokens == 0
    assert gen.timings.prefill_tokens == len(ids) - n_blocks and gen.finish_reason in ("length", "stop")
    assert len(gen.token_ids) >= 1


def test_attention_received_matches_transformers_eager(smollm2, smollm2_hf):
    from kvtool.skills.selective import attention_received

    ids = conversation_ids(smollm2, None)
    head, tail = ids[: len(ids) - 9], ids[len(ids) - 9:]
    cache = smollm2.runner.new_cache(len(ids) + 1)
    smollm2.runner.prefill(head, cache)
    ours = attention_received(smollm2.runner, cache, tail, window=6, chunk=4)  # rows split across chunks
    cache.truncate(len(head))
    weighted = attention_received(smollm2.runner, cache, tail, window=6, chunk=4, values=True)
    previous = smollm2_hf.config._attn_implementation
    with torch.no_grad():
        smollm2_hf.set_attn_implementation("eager")
        try:
            out = smollm2_hf(torch.tensor([ids]), output_attentions=True, use_cache=True)
        finally:
            smollm2_hf.set_attn_implementation(previous)
    att = torch.stack(out.attentions)[:, 0, :, len(ids) - 6:, : len(head)].float()  # [L, H, 6, head]
    ref = att.sum((0, 1, 2))
    assert cache.offset == len(ids) and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.max().item()
    group = smollm2.spec.num_heads // smollm2.spec.num_kv_heads
    norms = torch.stack([layer.values[0, :, : len(head)].float().norm(dim=-1) for layer in out.past_key_values.layers])
    ref_weighted = (att * norms.repeat_interleave(group, 1)[:, :, None]).sum((0, 1, 2))  # [L, H, head] norms
    assert (weighted - ref_weighted).abs().max().item() <= 1e-4 * ref_weighted.max().item()
    assert (weighted.argsort()[-20:] != ours.argsort()[-20:]).any()  # the weighting changes the ranking


def test_engine_splices_with_query_guided_repair(smollm2, catalog):
    ids = conversation_ids(smollm2, catalog, "haiku", "limerick")
    params = kvtool.SamplingParams(temperature=0, max_tokens=3)
    plain = Engine(smollm2).generate(ids, params).run()
    exact = SkillSplicer(catalog, repair="recompute_attended:ratio=1.0")
    assert Engine(smollm2, prefix_cache=exact).generate(ids, params).run().token_ids == plain.token_ids
    guided = SkillSplicer(catalog, repair="recompute_attended:ratio=0.25,window=16")
    gen = Engine(smollm2, prefix_cache=guided).generate(ids, params).run()
    stats, n_blocks = guided.last_stats, len(catalog.block("haiku")) + len(catalog.block("limerick"))
    assert stats.block_tokens == n_blocks and stats.recomputed_block_tokens == int(0.25 * n_blocks)
    assert stats.ready_tokens == len(ids) - 1 and stats.gap_tokens == len(ids) - 1 - n_blocks
    assert gen.timings.skill_block_tokens == stats.reused_block_tokens
    assert gen.timings.prefill_tokens == len(ids) - stats.reused_block_tokens and len(gen.token_ids) >= 1


def test_cli_eval_reports_metrics_json_and_plot(smollm2, skills_dir, cache_dir, tmp_path, monkeypatch, capsys):
    import kvtool.cli.skill as cli_skill
    from kvtool.cli import main

    monkeypatch.setattr(cli_skill, "load_from_args", lambda args: smollm2)
    out, plot = tmp_path / "eval.json", tmp_path / "eval.png"
    argv = ["skill", "eval", str(skills_dir), "--blocks", "1", "--prefix-tokens", "0", "--greedy-tokens", "4",
            "--queries", "2", "--repeats", "0", "--scaling", "1", "--cache-dir", str(cache_dir),
            "--repair", "none", "--repair", "recompute_first_k:k=100000", "--repair", "recompute_deviation:ratio=0.2",
            "--repair", "recompute_attended:ratio=0.2",
            "--out", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == rec
    assert rec["queries_scored"] == 2 and rec["blocks"][0]["name"] == "haiku" and rec["ttft_scaling"]
    assert rec["preambles"] == ["conversation", "deep:tokens=2048"] and len(rec["repairs"]) == 8  # each repair twice
    rows = {r["strategy"]: r for r in rec["repairs"] if r["preamble"] == "deep:tokens=2048"}  # the default
    exact = rows["recompute_first_k"]
    assert exact["top1"] == 1.0 and exact["greedy_exact"] and exact["cos_mean"] > 0.9999 and exact["kl_next"] < 1e-4
    assert exact["recomputed_fraction"] == 1.0
    for r in rec["repairs"]:
        assert 0 <= r["top1"] <= 1 and -1 <= r["cos_mean"] <= 1 + 1e-5 and r["kl_next"] >= -1e-6
        assert r["ttft_ms_cold"]["median"] > 0 and len(r["per_query"]) == 2
    assert 0 < rows["recompute_deviation"]["recomputed_fraction"] <= 0.25
    guided = rows["recompute_attended"]  # composed per query; more of the answer's context repaired than none
    assert 0.19 < guided["recomputed_fraction"] <= 0.2
    assert guided["kl_mean"] < rows["none"]["kl_mean"]
    assert plot.stat().st_size > 10_000


def test_cli_compile_and_info(smollm2, skills_dir, tmp_path, monkeypatch, capsys):
    import kvtool.cli.skill as cli_skill
    from kvtool.cli import main

    monkeypatch.setattr(cli_skill, "load_from_args", lambda args: smollm2)
    out = tmp_path / "h.kvb"
    assert main(["skill", "compile", str(skills_dir / "haiku.md"), "-o", str(out)]) == 0
    assert "haiku" in capsys.readouterr().out
    assert main(["skill", "info", str(out), "--check-model"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "haiku" and info["compatible_with_model"] and info["canonical_start"] > 0
    out.write_bytes(out.read_bytes()[:-100])
    assert main(["skill", "info", str(out)]) == 2
    assert "truncated" in capsys.readouterr().err
    (tmp_path / "bad.md").write_text("no frontmatter here")
    assert main(["skill", "compile", str(tmp_path / "bad.md")]) == 2
    assert "bad.md: missing YAML frontmatter" in capsys.readouterr().err


def test_block_for_smollm2_is_refused_by_qwen25(qwen25, catalog, tmp_path):
    from kvtool.skills import setup_of

    path = save_block(catalog.block("haiku"), tmp_path / "haiku.kvb")
    with pytest.raises(CacheFormatError) as err:
        load_block(path, expected_setup=setup_of(qwen25))
    msg = str(err.value)
    for label in ("model:", "model config:", "tokenizer:", "RoPE setting:"):
        assert label in msg
    assert "dtype:" not in msg  # both float32
    with pytest.raises(CacheFormatError, match="this model needs"):
        compose(qwen25.runner, [1, 2], [catalog.block("haiku")], [3])


def test_qwen25_compile_and_relocate(qwen25):
    block = compile_skill(qwen25, parse_skill(HAIKU), preamble="none")
    assert block.meta["boundary_safe"] == "true" and block.token_ids[0] == 151644  # <|im_start|>
    assert block.canonical_start == 0
    prefix = qwen25.encode_rendered("<|im_start|>user\nHi<|im_end|>\n")
    out = compose(qwen25.runner, prefix, [block], [], repair="none")
    ref = qwen25.runner.new_cache()
    qwen25.runner.prefill(prefix + block.token_ids, ref)
    k, k_ref = out.cache.stacked()[0][0], ref.stacked()[0][0]  # layer 0 (q/k/v biases included)
    assert (k - k_ref).abs().max().item() < 1e-4 * k_ref.abs().max().item()


def test_deep_preamble_compiles_deep_and_shares_its_system_turn(smollm2):
    haiku, limerick = parse_skill(HAIKU), parse_skill(LIMERICK)
    shared: dict = {}
    deep = [compile_skill(smollm2, s, preamble="deep:tokens=300", shared_kv=shared) for s in (haiku, limerick)]
    alone = [compile_skill(smollm2, s, preamble="deep:tokens=300") for s in (haiku, limerick)]
    head = len(render_skill(smollm2, haiku).head_ids)
    for a, b in zip(deep, alone):  # the system turn's KV, prefilled once, is the KV a whole prefill computes
        assert a.canonical_start == b.canonical_start and 300 < a.canonical_start < 300 + head + 16
        assert (a.keys - b.keys).abs().max().item() < 1e-4 * b.keys.abs().max().item()
        assert a.meta["preamble"] == "deep:tokens=300" and a.meta["preamble_sha256"] == b.meta["preamble_sha256"]
    assert len(shared) == 1 and next(iter(shared.values())).offset < deep[0].canonical_start
    from kvtool.skills.preamble import preamble_ids

    rendered, window = render_skill(smollm2, haiku), smollm2.runner.spec.max_position
    huge, _ = preamble_ids(smollm2, haiku, rendered, "deep:tokens=1000000")  # cut to what the window leaves
    assert window - len(rendered.ids) - head - 64 < len(huge) <= window - len(rendered.ids)


def test_catalog_recompiles_when_the_deep_preamble_text_changes(smollm2, skills_dir, tmp_path, monkeypatch):
    import kvtool.skills.preamble as preamble

    logs = []
    first = load_catalog(skills_dir, smollm2, cache_dir=tmp_path, preamble="deep:tokens=64", log=logs.append)
    load_catalog(skills_dir, smollm2, cache_dir=tmp_path, preamble="deep:tokens=64", log=logs.append)
    assert sum("compiled skill" in m for m in logs) == 2  # the second load read the cache
    monkeypatch.setattr(preamble, "context_text", lambda: "Other standing instructions. " * 40)
    again = load_catalog(skills_dir, smollm2, cache_dir=tmp_path, preamble="deep:tokens=64", log=logs.append)
    assert sum("compiled skill" in m for m in logs) == 4
    assert again.block("haiku").meta["preamble_sha256"] != first.block("haiku").meta["preamble_sha256"]


def test_deep_preamble_brings_blocks_closer_to_full_prefill(smollm2, tmp_path):
    """Four example skills loaded one by one after a ~256-token prefix: compiled deep, the composed cache
    (first 48 tokens of each block recomputed) scores closer to full prefill than compiled after the
    conversation head alone. A 512-token preamble shows it (KL 0.0089 against 0.0192 on SmolLM2) at 30 s less
    than the default 2,048 (0.0049)."""
    from kvtool.bench.skills import EXAMPLE_SKILLS
    from kvtool.skills.cases import catalog_case
    from kvtool.skills.evaluate import evaluate

    case, variants, catalog = catalog_case(smollm2, EXAMPLE_SKILLS, blocks=4, cache_dir=tmp_path, log=lambda m: None,
                                           preambles=("conversation", "deep:tokens=512"))
    assert list(variants) == ["conversation", "deep:tokens=512"] and len(case.gaps) == 4
    assert not any(case.gaps)  # each block opens with its Skill call: skills loaded one after another are adjacent
    assert [m.name for m, _ in catalog.find(case.sequence)] == catalog.names()[:4]
    rec = evaluate(smollm2, case, ["recompute_first_k:k=48"], n_greedy=8, repeats=0, warm_prefix=False,
                   log=lambda m: None, variants=variants)
    conv, deep = rec["repairs"]
    assert (conv["preamble"], deep["preamble"]) == ("conversation", "deep:tokens=512")
    assert conv["recomputed_tokens"] == deep["recomputed_tokens"] == 4 * 48
    assert deep["kl_mean"] < 0.7 * conv["kl_mean"] and deep["cos_mean"] > conv["cos_mean"]


def test_n_choices_share_a_spliced_prompt_over_the_prefix_cache(smollm2, catalog):
    """n=2: the sibling starts from its leader's prompt KV and holds no prefix-cache handle of its own; both
    finish, hand their KV back and equal the unspliced greedy run (full recompute)."""
    from kvtool.cache.manager import PrefixCache
    from kvtool.errors import PrefixCacheWarning

    ids = conversation_ids(smollm2, catalog, "haiku", "limerick")
    params = kvtool.SamplingParams(temperature=0, max_tokens=3)
    plain = Engine(smollm2).generate(ids, params).run()
    prefix = PrefixCache.for_runner(smollm2.runner)
    splicer = SkillSplicer(catalog, repair="recompute_first_k:k=100000", inner=prefix)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gens = Engine(smollm2, prefix_cache=splicer).generate_batch([ids, ids[:-2]], params, n=2)
    assert not [w for w in caught if issubclass(w.category, PrefixCacheWarning)], "every KV hand-back worked"
    assert [g.token_ids for g in gens[:2]] == [plain.token_ids] * 2
    assert all(g.finish_reason in ("length", "stop") for g in gens)
    prefix.check_integrity()
    again = Engine(smollm2, prefix_cache=splicer).generate(ids, params).run()  # the prompt's KV was handed back
    assert again.token_ids == plain.token_ids and again.timings.cached_tokens > 0


def test_blocks_spliced_over_the_paged_prefix_cache_give_the_reference_forwards_tokens(smollm2, catalog):
    """Skill blocks spliced after the prefix cache's paged KV, through the C++ ops and through the reference
    forward: the same greedy tokens, the second time over the prompt the first handed back to the cache."""
    from kvtool.cache.manager import PrefixCache

    ids = conversation_ids(smollm2, catalog, "haiku", "limerick")
    params = kvtool.SamplingParams(temperature=0, max_tokens=6)

    def run():
        splicer = SkillSplicer(catalog, repair="none", inner=PrefixCache.for_runner(smollm2.runner, 64 << 20))
        engine = Engine(smollm2, prefix_cache=splicer)
        gens = [engine.generate(ids, params).run() for _ in range(2)]
        return [(g.token_ids, g.timings.cached_tokens, g.timings.skill_block_tokens) for g in gens]

    paged = run()
    smollm2.runner.use_cpu_decode(False)
    try:
        reference = run()
    finally:
        smollm2.runner.use_cpu_decode(True)
    assert paged == reference and paged[1][1] > 0
