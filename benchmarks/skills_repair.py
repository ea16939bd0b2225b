"""Skill-block repairs against full recompute on the long-skill library: how much fidelity each repair buys for
the share of prompt tokens it leaves uncomputed. kvtool's own engine through the Python API, no server:

    OMP_NUM_THREADS=1 python benchmarks/skills_repair.py --model smollm2 --requests 16 --most-skills 3 \\
        --out skills-repair.json --plot skills-repair.png

The skills are kvtool.bench.skill_library's (the --skills shortest of its 16), compiled into a catalog with
--preamble (default: the engine's). Each request loads --least..--most of them after the shared system prompt
and asks about one; its conversation is cut where the blocks' exact ids are, as the server splices them
(prefix = the system prompt and the user's task, then per skill its Skill call and its block, then the
question). kvtool.skills.evaluate scores every repair on every request against a full prefill of the same
tokens. Per repair the record keeps:
- uncomputed_share: prompt tokens the model did not compute over all prompt tokens, the prefix counted as a
  prefix-cache hit (it is the same for every request): (prefix + block tokens - recomputed) / prompt tokens;
- computed_token_layers: the compute a repair spends, in token-layers over the prompt's, counting the runs
  between and after the blocks, recomputed tokens, recompute_deviation's pass of every block token through
  layers 0..layer and recompute_attended's extra pass over the question;
- first_token_agreement, kl_top20_mean (the first token's KL over the reference's top 20, both renormalised
  there, averaged over requests), greedy_identical (share of requests whose --greedy-tokens greedy answer is
  the reference's), and whether the three meet the bar (BAR).
The plot: KL and identical greedy answers against the share not computed, one point per repair.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SWEEP = ("none", "recompute_first_k:k=4", "recompute_first_k:k=16", "recompute_first_k:k=32",
         "recompute_attended:ratio=0.01", "recompute_attended:ratio=0.02", "recompute_attended:ratio=0.05",
         "recompute_deviation:ratio=0.02", "recompute_deviation")
BAR = {"first_token_agreement": 0.98, "kl_top20_mean": 0.05, "greedy_identical": 0.8}  # >=, <=, >=


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def library_case(model, catalog, request, skills):
    """The request's conversation as an EvalCase: [system + task][Skill call][block]...[question]."""
    from kvtool.bench.skill_library import messages
    from kvtool.errors import KvtoolError
    from kvtool.skills.evaluate import EvalCase

    chat = messages(request, skills)
    prefix = model.encode_chat(chat[:2], add_generation_prompt=False)
    ids = model.encode_chat(chat, add_generation_prompt=True)
    found = catalog.find(ids, len(prefix))
    if ids[:len(prefix)] != prefix or [m.name for m, _ in found] != list(request.skills):
        raise KvtoolError(f"{model.name}'s chat template does not render skills {list(request.skills)} verbatim "
                          "after the system prompt, so no block can be spliced; nothing to measure")
    ends = [len(prefix)] + [m.end for m, _ in found]
    gaps = [ids[a:m.start] for a, (m, _) in zip(ends, found)]
    return EvalCase(prefix, [b for _, b in found], ids[ends[-1]:], gaps=gaps)


def request_rows(record: dict, num_layers: int) -> list[dict]:
    """One request's evaluate() record as one row per repair: its token counts and first-query fidelity."""
    prompt, prefix, blocks = record["prompt_tokens"], record["prefix_tokens"], record["block_tokens"]
    runs = prompt - prefix - blocks  # the Skill calls between blocks and the question: always prefilled
    out = []
    for row in record["repairs"]:
        q = row["per_query"][0]
        extra = 0.0
        if row["strategy"] == "recompute_deviation":  # every block token through layers 0..layer
            extra = blocks * (_knob(row["repair"], "layer", 1) + 1) / num_layers
        elif row["strategy"] == "recompute_attended":  # the question prefilled once more to measure attention
            extra = record["query_tokens"]
        out.append({"repair": row["repair"], "prompt_tokens": prompt, "prefix_tokens": prefix, "block_tokens": blocks,
                    "recomputed_tokens": row["recomputed_tokens"], "computed_tokens": runs + row["recomputed_tokens"],
                    "extra_token_equivalents": extra,
                    "first_token_agree": q["greedy_match_tokens"] >= 1, "kl_top20_next": q["kl_top20_next"],
                    "kl_next": q["kl_next"], "kl_mean": q["kl_mean"], "top1": q["top1"],
                    "greedy_identical": q["greedy_exact"], "greedy_match_tokens": q["greedy_match_tokens"],
                    "misses": q["misses"], "near_tie_misses": q["near_tie_misses"],
                    "speedup_cold": row["speedup_cold"]})
    return out


def _knob(spec: str, name: str, default):
    """A knob's value in a describe()d repair 'name:k=v,k=v' (default when absent)."""
    for item in spec.partition(":")[2].split(","):
        key, _, value = item.partition("=")
        if key == name:
            return type(default)(value)
    return default


def summarise(rows: list[dict], bar: dict = BAR) -> list[dict]:
    """Per repair, in first-seen order: shares over all its requests' prompt tokens, means over requests, the bar."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["repair"], []).append(r)
    out = []
    for repair, rs in by.items():
        n, prompt = len(rs), sum(r["prompt_tokens"] for r in rs)
        mean = lambda key: sum(float(r[key]) for r in rs) / n  # noqa: E731
        s = {"repair": repair, "label": rs[0].get("label", repair), "requests": n, "prompt_tokens": prompt,
             "uncomputed_share": sum(r["prompt_tokens"] - r["computed_tokens"] for r in rs) / prompt,
             "recomputed_block_share": sum(r["recomputed_tokens"] for r in rs)
             / max(1, sum(r["block_tokens"] for r in rs)),
             "computed_token_layers": sum(r["computed_tokens"] + r["extra_token_equivalents"] for r in rs) / prompt,
             "first_token_agreement": mean("first_token_agree"), "kl_top20_mean": mean("kl_top20_next"),
             "kl_top20_max": max(r["kl_top20_next"] for r in rs), "kl_next_mean": mean("kl_next"),
             "kl_greedy_steps_mean": mean("kl_mean"), "top1_teacher_forced": mean("top1"),
             "greedy_identical": mean("greedy_identical"), "greedy_match_tokens_mean": mean("greedy_match_tokens"),
             "misses": sum(r.get("misses", 0) for r in rs),  # teacher-forced steps whose argmax differs
             "near_tie_misses": sum(r.get("near_tie_misses", 0) for r in rs),
             "speedup_cold_median": sorted(r["speedup_cold"] for r in rs)[n // 2]}
        s["meets_bar"] = meets_bar(s, bar)
        out.append(s)
    return out


def meets_bar(s: dict, bar: dict = BAR) -> bool:
    return (s["first_token_agreement"] >= bar["first_token_agreement"] and s["kl_top20_mean"] <= bar["kl_top20_mean"]
            and s["greedy_identical"] >= bar["greedy_identical"])


def cheapest(summary: list[dict]) -> str | None:
    """The repair meeting the bar that leaves the most prompt tokens uncomputed (None: none meets it)."""
    good = [s for s in summary if s["meets_bar"]]
    return max(good, key=lambda s: (s["uncomputed_share"], -s["computed_token_layers"]))["repair"] if good else None


def short_label(spec: str) -> str:
    """'recompute_attended:ratio=0.01' -> 'attended 0.01', 'recompute_first_k:k=4' -> 'first_k 4'."""
    name, _, knobs = spec.removeprefix("recompute_").partition(":")
    return " ".join([name, *(item.partition("=")[2] for item in knobs.split(",") if item)])


def plot(path: str, title: str, summary: list[dict], bar: dict = BAR) -> None:
    """Two panels against the share of prompt tokens not computed: mean top-20 KL, identical greedy answers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    x = [100 * s["uncomputed_share"] for s in summary]
    for ax, key, scale, label in ((axes[0], "kl_top20_mean", 1, "mean KL, first token (top 20, nats)"),
                                  (axes[1], "greedy_identical", 100, "identical greedy answers (%)")):
        y = [scale * s[key] for s in summary]
        ax.scatter(x, y, c=["tab:green" if s["meets_bar"] else "tab:red" for s in summary], zorder=3)
        for i, (xi, yi, s) in enumerate(zip(x, y, summary)):  # labels alternate sides: points sit close together
            ax.annotate(short_label(s["label"]), (xi, yi), fontsize=7, xytext=(4, 8 - 16 * (i % 2)),
                        textcoords="offset points", rotation=20)
        ax.axhline(scale * bar[key], ls="--", c="grey", lw=1)
        ax.set(xlabel="prompt tokens not computed (%)", ylabel=label)
        ax.grid(alpha=0.3)
    fig.suptitle(title + " (green: meets the bar)")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    from kvtool.config import EngineConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen25", "gemma3"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--skills", type=int, default=16, help="the library's N shortest skills (of 16)")
    ap.add_argument("--least-skills", type=int, default=2)
    ap.add_argument("--most-skills", type=int, default=3, help="most skills a request loads")
    ap.add_argument("--repair", action="append", help=f"repeatable; default: {' '.join(SWEEP)}")
    ap.add_argument("--preamble", default=EngineConfig.skill_preamble, help="what the blocks are compiled after")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", help="PNG of fidelity against the share not computed")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    from common import emit, versions
    from kvtool.bench.loading import load_bench_model
    from kvtool.bench.skill_library import library, requests, write_library
    from kvtool.skills.catalog import load_catalog
    from kvtool.skills.evaluate import evaluate
    from kvtool.skills.repair import describe, make_repair

    torch.set_num_threads(args.threads)
    repairs = [describe(make_repair(spec)) for spec in args.repair or SWEEP]  # a typo fails before the model loads
    record = {"benchmark": "skills_repair", "engine": "kvtool", "config": vars(args), "bar": BAR,
              "command": " ".join([f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", "python",
                                   *sys.argv]), "loadavg_start": os.getloadavg(), "versions": versions()}
    bm = load_bench_model(args.model, announce=log)
    skills = library(args.seed)[:args.skills]  # sizes grow along the library: its first skills are the shortest
    reqs = requests(skills, args.requests, args.seed, least=args.least_skills, most=args.most_skills)
    used = sorted({n for r in reqs for n in r.skills})
    labels = dict(zip(repairs, args.repair or SWEEP))
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        write_library(Path(tmp), [s for s in skills if s.skill.name in used])
        catalog = load_catalog(tmp, bm.model, preamble=args.preamble, log=log)
    for i, req in enumerate(reqs):
        case = library_case(bm.model, catalog, req, skills)
        log(f"[{i + 1}/{len(reqs)}] {', '.join(req.skills)} -> {req.target} ({time.perf_counter() - t0:.0f} s)")
        result = evaluate(bm.runner, case, repairs, n_greedy=args.greedy_tokens, repeats=0, warm_prefix=False,
                          log=log, path="reference")
        rows += [{"request": i, "label": labels[r["repair"]], **r}
                 for r in request_rows(result, bm.runner.spec.num_layers)]
    summary = summarise(rows)
    for s in summary:
        log(f"{s['label']:<30} not computed {s['uncomputed_share']:6.1%}  first token {s['first_token_agreement']:.3f}"
            f"  KL(top20) {s['kl_top20_mean']:.4f}  greedy identical {s['greedy_identical']:.0%}"
            f"  {'meets' if s['meets_bar'] else 'misses'} the bar")
    record.update({"model": bm.name, "device": str(bm.device), "dtype": bm.dtype, "threads": torch.get_num_threads(),
                   "skills": {s.skill.name: len(catalog.block(s.skill.name)) for s in skills if s.skill.name in used},
                   "requests": [{"skills": list(r.skills), "target": r.target, "question": r.fact.question}
                                for r in reqs],
                   "summary": summary, "cheapest_meeting_bar": cheapest(summary), "rows": rows,
                   "seconds": round(time.perf_counter() - t0, 1), "loadavg_end": os.getloadavg()})
    if args.plot:
        plot(args.plot, f"skill repairs, {bm.name}, {len(reqs)} requests", summary)
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
