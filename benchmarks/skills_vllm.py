"""Skill composition in the research's serving setting, on this CPU: plain vLLM servers (kvtool's KV connector
mounted by --kv-transfer-config) and kvtool's engine side by side, in one run, on the real test models. Run it in
the vLLM environment:

    .venv-vllm/bin/python benchmarks/skills_vllm.py --out benchmarks/results/skills-vllm-cpu.json

A library of >= 16 skills (kvtool's 4 examples plus generated ones) after one shared system prompt; each
request loads 2-4 of them in a random order, then asks a short question. Three modes per engine, each over
the same requests: cold (full prefill: kvtool's prefix cache emptied before each request; a vLLM server without
prefix caching), prefix caching alone (the system prompt and repeated skill orders hit), and composition (the
blocks spliced by SkillSplicer on kvtool; on vLLM a server with prefix caching and the connector, given the
catalog's compiled .kvb files and a block store). Each vLLM mode runs on a server of its own
(`python -m vllm.entrypoints.openai.api_server`, vLLM's default multiprocessing, benchmarks/vllm_standalone.py),
warmed with one request before the timed ones; a request is token ids to /v1/completions and its TTFT the latency
of a one-token completion. Per mode: p50 / p90 TTFT, the share of prompt tokens not computed by the model (cache
+ blocks: vLLM's cached_tokens, which include what the connector supplied), and fidelity against the cold answer
(full recompute): top-1 agreement of the first token, next-token KL (kvtool: full distributions; vLLM: its top-20
logprobs, renormalised) and, on vLLM, exact match of the greedy answer (--max-tokens tokens). The connector runs
only repair `none`."""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, percentile, versions  # noqa: E402

WORDS = ("check validate parse render cache invoice ledger sensor schedule route ticket review deploy rollback "
         "audit metric budget quota archive export import retry timeout batch stream window queue").split()
SYSTEM = ("You are a careful assistant for an operations team. Use the loaded skills when they apply, cite the "
          "step you follow, and answer in at most three sentences. ") * 4


def generated_skills(folder: Path, n: int, words: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(n):
        steps = "\n".join(f"{j + 1}. {' '.join(rng.choice(WORDS) for _ in range(words // 8))}." for j in range(8))
        (folder / f"gen-{i:02d}.md").write_text(f"---\nname: gen-{i:02d}\ndescription: Procedure {i} for "
                                                f"{rng.choice(WORDS)} work.\n---\n# Procedure {i}\n{steps}\n")


def library(tmp: Path, generated: int, words: int, seed: int) -> Path:
    """tmp/skills: kvtool's example skills plus `generated` generated ones."""
    folder = tmp / "skills"
    folder.mkdir()
    for skill in Path(__file__).resolve().parent.parent.joinpath("examples", "skills").iterdir():
        if (skill / "SKILL.md").is_file():
            (folder / skill.name).mkdir()
            (folder / skill.name / "SKILL.md").write_text((skill / "SKILL.md").read_text())
    generated_skills(folder, generated, words, seed)
    return folder


def requests(model, catalog, n: int, seed: int) -> list[list[int]]:
    rng, names, out = random.Random(seed), catalog.names(), []
    for i in range(n):
        chosen = rng.sample(names, rng.randint(2, 4))
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Load the skills I need."}]
        for name in chosen:
            msgs += catalog.messages(name)
        msgs.append({"role": "user", "content": f"Which step comes first for case {i}?"})
        out.append(model.encode_chat(msgs, add_generation_prompt=True))
    return out


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum())


def stats(ttft: list[float], served: int, total: int) -> dict:
    return {"ttft_ms_p50": round(percentile(ttft, 50), 1), "ttft_ms_p90": round(percentile(ttft, 90), 1),
            "ttft_ms": [round(t, 1) for t in ttft], "hit_rate": round(served / total, 4)}


@torch.inference_mode()
def kvtool_modes(model, catalog, prompts, repair: str, min_tokens: int) -> dict:
    from kvtool.cache.manager import PrefixCache
    from kvtool.skills.splice import SkillSplicer

    runner, out, full = model.runner, {}, []
    for name in ("cold", "prefix", "compose"):
        store = PrefixCache.for_runner(runner, 1 << 30)
        hook = SkillSplicer(catalog, repair, inner=store, min_tokens=min_tokens) if name == "compose" else store
        ttft, served, top1, kls, paths = [], 0, [], [], []
        for i, ids in enumerate(prompts):
            if name == "cold":
                store.reset()
            t0 = time.perf_counter()
            cache, ready, handle = hook.prepare(ids, runner)
            logits = runner.prefill(ids[ready:], cache)[-1]
            ttft.append((time.perf_counter() - t0) * 1000)
            hook.commit(handle, ids, cache)
            served += ready - (getattr(handle, "stats", None).gap_tokens if name == "compose" else 0)
            if name == "cold":
                full.append(logits)
            else:
                top1.append(int(logits.argmax() == full[i].argmax()))
                kls.append(kl(full[i], logits))
            if name == "compose":
                paths.append("splice" if handle.stats.block_tokens else "prefill")
        out[name] = stats(ttft, served, sum(map(len, prompts)))
        print(f"kvtool {name}: p50 {out[name]['ttft_ms_p50']} ms", file=sys.stderr, flush=True)
        if name != "cold":
            out[name].update(top1_agreement=sum(top1) / len(top1), kl_mean=round(sum(kls) / len(kls), 5))
        if paths:
            out[name]["paths"] = {p: paths.count(p) for p in set(paths)}
    return out


def warmup_prompt(model, catalog) -> list[int]:
    """A request before the timed ones: the shared system prompt, then one skill (the connector saves the partial
    block that ends the shared prefix, and closes the seam before the first skill of every later request)."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Load the skills I need."},
            *catalog.messages(catalog.names()[0]), {"role": "user", "content": "Which skill is loaded?"}]
    return model.encode_chat(msgs, add_generation_prompt=True)


def vllm_modes(folder: str, catalog, prompts, warmup: list[int], min_tokens: int, max_tokens: int, tmp: Path) -> dict:
    """The three modes on plain vLLM servers (benchmarks/vllm_standalone.py), one server per mode, each warmed with
    one request: cold (no prefix caching), prefix (prefix caching), compose (prefix caching and kvtool's connector
    with the catalog's compiled blocks and a block store of its own)."""
    from vllm_standalone import account, complete, start

    blocks = [str(catalog.paths[n]) for n in catalog.names()]
    modes = {"cold": (False, None), "prefix": (True, None),
             "compose": (True, {"blocks": blocks, "kv_store": str(tmp / "kv-store"), "skill_min_tokens": min_tokens})}
    out, cold = {}, []
    for name, (caching, extra) in modes.items():
        server = start(folder, tmp / f"vllm-{name}.log", caching, extra, name=f"vllm {name}")
        try:
            complete(server.url, warmup)
            ttft, served, top1, kls, exact, paths, supplied = [], 0, [], [], [], [], {"store": 0, "block": 0}
            for i, ids in enumerate(prompts):
                ms, first = complete(server.url, ids, logprobs=20)
                ttft.append(ms)
                served += first["usage"]["prompt_tokens_details"]["cached_tokens"]
                lp = first["choices"][0]["logprobs"]["top_logprobs"][0]
                answer = first["choices"][0]["token_ids"]
                if max_tokens > 1:  # untimed; in the cached modes it reads the pages the timed request left
                    answer = complete(server.url, ids, max_tokens=max_tokens, ignore_eos=True)[1]["choices"][0][
                        "token_ids"]
                acc = account(first)
                if acc is not None:
                    paths.append(acc["skill_path"])
                    supplied["store"] += acc["store_tokens"]
                    supplied["block"] += acc["block_tokens"]
                if name == "cold":
                    cold.append((answer, lp))
                    continue
                ref_answer, ref_lp = cold[i]
                top1.append(int(answer[0] == ref_answer[0]))
                exact.append(int(answer == ref_answer))
                kls.append(top_kl(ref_lp, lp))
        finally:
            server.stop()
        out[name] = stats(ttft, served, sum(map(len, prompts)))
        print(f"vllm {name}: p50 {out[name]['ttft_ms_p50']} ms", file=sys.stderr, flush=True)
        if name != "cold":
            kl_mean = round(sum(kls) / len(kls), 5) + 0.0  # + 0.0: no -0.0 from rounding noise
            out[name].update(top1_agreement=sum(top1) / len(top1), kl_top20_mean=kl_mean,
                             greedy_exact=sum(exact) / len(exact))
        if extra is not None:
            out[name].update(paths={p: paths.count(p) for p in sorted(set(paths))},
                             store_tokens=supplied["store"], block_tokens=supplied["block"])
    return out


def top_kl(ref: dict, got: dict) -> float:
    """KL(ref || got) over ref's top tokens (token -> logprob), both renormalised there; a token got lacks takes
    got's floor."""
    ids = list(ref)
    floor = min(got.values())
    p = torch.log_softmax(torch.tensor([ref[t] for t in ids]), -1)
    q = torch.log_softmax(torch.tensor([got.get(t, floor) for t in ids]), -1)
    return float((p.exp() * (p - q)).sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen25"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--generated", type=int, default=12, help="generated skills beside the 4 examples")
    ap.add_argument("--skill-words", type=int, default=96, help="words per step line of a generated skill x 8")
    ap.add_argument("--min-tokens", type=int, default=0, help="blocks shorter than this are prefilled (both engines)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens of the greedy answer compared on vLLM")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", help="a line kept in the record, e.g. why the run is smaller than the defaults")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    command = " ".join(["python", "benchmarks/skills_vllm.py", *(sys.argv[1:] if argv is None else argv)])
    from vllm_standalone import describe

    from kvtool.models.loading import load, resolve_folder
    from kvtool.skills.catalog import load_catalog
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    # repair none on both engines: the connector computes nothing, so it runs no other (docs/vllm.md)
    record = {"benchmark": "skills_vllm", "command": command, "loadavg_start": os.getloadavg(), "repair": "none",
              "requests": args.requests, "vllm": describe(), "versions": versions(), "models": {}}
    if args.note:
        record["note"] = args.note
    with tempfile.TemporaryDirectory() as tmp:
        folder = library(Path(tmp), args.generated, args.skill_words, args.seed)
        for name in args.models:
            gguf = smollm2_gguf() if name == "smollm2" else qwen25_gguf()
            model = load(str(gguf), device="cpu", dtype="float32", progress=False)
            catalog = load_catalog(folder, model, cache_dir=Path(tmp) / "kvb", preamble="none", log=lambda m: None)
            prompts = requests(model, catalog, args.requests, args.seed)
            print(f"{name}: {len(catalog)} skills, prompts of {[len(p) for p in prompts]} tokens", file=sys.stderr,
                  flush=True)
            row = {"skills": len(catalog), "library_tokens": sum(len(catalog.block(n)) for n in catalog.names()),
                   "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1)}
            row["kvtool"] = kvtool_modes(model, catalog, prompts, "none", args.min_tokens)
            row["vllm"] = vllm_modes(str(resolve_folder(str(gguf))[0]), catalog, prompts,
                                     warmup_prompt(model, catalog), args.min_tokens, args.max_tokens, Path(tmp))
            for engine in ("kvtool", "vllm"):
                r = row[engine]
                r["p90_speedup_compose_vs_cold"] = round(r["cold"]["ttft_ms_p90"] / r["compose"]["ttft_ms_p90"], 2)
                r["p90_speedup_compose_vs_prefix"] = round(r["prefix"]["ttft_ms_p90"] / r["compose"]["ttft_ms_p90"], 2)
            record["models"][name] = row
            print(name, {e: {m: (row[e][m]["ttft_ms_p50"], row[e][m]["ttft_ms_p90"], row[e][m]["hit_rate"])
                             for m in ("cold", "prefix", "compose")} for e in ("kvtool", "vllm")}, file=sys.stderr)
    record["loadavg_end"] = os.getloadavg()
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
