"""Where a composed request's time goes, per repair: the skills_load library's prompts through an Engine whose
prefix hook splices the skill blocks (the server's path), every repair and a full recompute (no splicing) in turn
on each prompt, a few rounds after one that warms up. Per mode: time to the first token (wall), the process's CPU
seconds, and for a spliced request the CPU seconds of its phases: relocation and the token runs' pass (compose's
_one_pass), recompute_attended's scoring pass (attention_received) and its recompute of the chosen tokens and the
query (recompute_slots; the scoring pass runs through it too and is taken out). The load average goes with it:

    python benchmarks/skills_repair_cost.py --model smollm2 --requests 2 --rounds 2 --threads 1
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, versions  # noqa: E402

PHASES = {"relocate_and_runs": ("kvtool.skills.compose", "_one_pass"),
          "score": ("kvtool.skills.selective", "attention_received"),
          "recompute": ("kvtool.skills.selective", "recompute_slots")}


def timed_phases(spent: dict) -> None:
    """Wrap each phase's function (where its callers look it up) to add its CPU seconds to spent[phase]."""
    for phase, (module, name) in PHASES.items():
        mod = importlib.import_module(module)
        inner = getattr(mod, name)

        def wrapper(*a, _inner=inner, _phase=phase, **k):
            t = time.process_time()
            try:
                return _inner(*a, **k)
            finally:
                spent[_phase] = spent.get(_phase, 0.0) + time.process_time() - t
        setattr(mod, name, wrapper)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen25"])
    ap.add_argument("--repair", action="append", help="repeatable (default: none, recompute_attended:ratio=0.1)")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--most", type=int, default=4, help="skills a request loads at most (at least 2)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import kvtool
    from kvtool.bench.loading import model_path
    from kvtool.bench.skill_library import library, messages, requests, write_library
    from kvtool.cache.manager import attach_prefix_cache
    from kvtool.engine import Engine
    from kvtool.skills.catalog import load_catalog
    from kvtool.skills.splice import SkillSplicer

    model = kvtool.load(model_path(args.model, lambda m: print(m, file=sys.stderr)), device="cpu", dtype="float32",
                        progress=False)
    skills, work = library(0), Path(os.environ.get("TMPDIR", "/tmp")) / "kvtool-repair-cost"
    chats = [(r, model.encode_chat(messages(r, skills))) for r in requests(skills, 8 * args.requests, 0, most=args.most)]
    chats = [(r, ids) for r, ids in chats if len(ids) < model.context_window - 1][: args.requests]
    used = {name for r, _ in chats for name in r.skills}  # only these are compiled
    write_library(work / args.model, [s for s in skills if s.skill.name in used])
    catalog = load_catalog(work / args.model, model, cache_dir=work / "kvb", log=lambda m: None)
    prompts = [ids for _, ids in chats]
    modes = {"full": None, **{r: r for r in args.repair or ["none", "recompute_attended:ratio=0.1"]}}
    engines = {}
    for mode, repair in modes.items():
        engine = Engine(model)
        inner = attach_prefix_cache(engine)
        if repair:
            engine.prefix_cache = SkillSplicer(catalog, repair, inner=inner, min_tokens=128)
        engines[mode] = (engine, inner)
    spent, rows = {}, {m: [] for m in modes}
    timed_phases(spent)
    params, load = kvtool.SamplingParams(temperature=0, max_tokens=1), [os.getloadavg()[0]]
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for ids in prompts:
            for mode, (engine, inner) in engines.items():
                inner.reset()
                spent.clear()
                t, c = time.perf_counter(), time.process_time()
                gen = engine.generate(ids, params).run()
                row = {"prompt": len(ids), "ttft_s": time.perf_counter() - t, "cpu_s": time.process_time() - c,
                       "computed_tokens": gen.timings.prefill_tokens, **{f"{k}_cpu_s": v for k, v in spent.items()}}
                if "score_cpu_s" in row:  # the scoring pass runs through recompute_slots
                    row["recompute_cpu_s"] -= row["score_cpu_s"]
                if rnd:
                    rows[mode].append(row)
        load.append(os.getloadavg()[0])
    summary = {m: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for m, rs in rows.items()}
    emit({"benchmark": "skills_repair_cost", "model": args.model, "threads": args.threads, "rounds": args.rounds,
          "load_average": load, "median": summary, "runs": rows, "versions": versions()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
