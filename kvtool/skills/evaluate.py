"""Fidelity and TTFT of composed caches against full recompute of the SAME token sequence.

Metrics (all vs the full-prefill reference, which also defines the greedy continuation):
- kl_next: KL(p_full || p_composed) of the next token after the prompt (nats);
- cos_next / cos_mean: cosine of the logit vectors, next token / mean over the 32 greedy steps;
- top1: fraction of the greedy steps where the composed argmax equals the reference greedy token,
  both fed the reference's greedy tokens (teacher forcing);
- greedy_exact: the composed model's own greedy output equals the reference's. Greedy decoding
  diverges exactly at the first teacher-forced mismatch, so this is top1 == 1 and
  `greedy_match_tokens` (the common prefix) is the index of that first mismatch;
- kl_top20_next / kl_top20_mean: KL over the reference's TOP_K most likely tokens, both distributions
  renormalised there (what a server's top-20 logprobs allow; kvtool's server benchmarks score the same);
- misses / near_tie_misses: teacher-forced steps where the argmaxes differ, and those of them where
  the reference itself was nearly undecided (log p1 - log p2 < NEAR_TIE nats). A small model's
  greedy path has such steps, and any change to the context (even recomputing half the block
  tokens) can flip them, so they say how much of a top-1 shortfall is real divergence.
With several queries (EvalCase.more_queries) each is scored after the same [prefix][blocks] and
the record holds the means (cos_min: the minimum; greedy_exact_rate: share of exact queries).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from kvtool.config import EngineConfig
from kvtool.skills.block import SkillBlock
from kvtool.skills.compose import compose_segments
from kvtool.skills.repair import describe, is_query_guided, make_repair

DEFAULT_SWEEP = ("none", "recompute_first_k:k=4", "recompute_first_k:k=16", "recompute_first_k:k=32",
                 "recompute_deviation:ratio=0.05", "recompute_deviation:ratio=0.1", "recompute_deviation:ratio=0.2",
                 "recompute_attended:ratio=0.05", "recompute_attended:ratio=0.1")

NEAR_TIE = 0.5  # nats between the reference's top two tokens
TOP_K = 20  # kl_top20: the reference's most likely tokens the top-k KL is taken over
CHUNK = EngineConfig.prefill_chunk  # full prefill and composed token runs prefill as the engine does


@dataclass
class EvalCase:
    """[prefix][gap 0][block 0][gap 1][block 1]...[query]: a gap is the token run that precedes its block in
    the conversation (an agent's Skill call before the skill's result); gaps default to empty."""
    prefix: list[int]
    blocks: list[SkillBlock]
    query: list[int]  # timed (TTFT) and scored
    more_queries: list[list[int]] = field(default_factory=list)  # scored too, on the same composed context
    gaps: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self.gaps = [list(g) for g in self.gaps] or [[] for _ in self.blocks]
        if len(self.gaps) != len(self.blocks):
            raise ValueError(f"an eval case needs one gap per block: {len(self.gaps)} gaps, {len(self.blocks)} blocks")

    @property
    def queries(self) -> list[list[int]]:
        return [self.query, *self.more_queries]

    def context_segments(self) -> list:
        """The gaps and blocks after the prefix, in order (empty gaps left out)."""
        return [seg for gap, block in zip(self.gaps, self.blocks) for seg in (gap, block) if len(seg)]

    @property
    def context(self) -> list[int]:
        """Token ids of the prefix, gaps and blocks: what every query follows."""
        return self.prefix + [t for seg in self.context_segments() for t in (getattr(seg, "token_ids", seg))]

    @property
    def sequence(self) -> list[int]:
        return self.context + self.query

    @property
    def block_tokens(self) -> int:
        return sum(len(b) for b in self.blocks)

    def first(self, count: int, query: list[int] | None = None) -> "EvalCase":
        """The case cut to its first `count` blocks (and their gaps), optionally with another query."""
        return EvalCase(self.prefix, self.blocks[:count], self.query if query is None else query,
                        gaps=self.gaps[:count])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn: Callable, device) -> tuple[object, float, float]:
    """(result, wall ms, process CPU ms). CPU time is steadier than wall time on a shared machine."""
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - t0) * 1000.0, (time.process_time() - c0) * 1000.0


def runs(fn: Callable, n: int, device, first: tuple[float, float] | None = None) -> dict:
    """Summary of n timed runs (plus an already measured (wall, cpu) pair): wall median/min/max, CPU median."""
    pairs = ([first] if first else []) + [timed(fn, device)[1:] for _ in range(n)]
    wall, cpu = [p[0] for p in pairs], [p[1] for p in pairs]
    return {"median": statistics.median(wall), "min": min(wall), "max": max(wall), "n": len(wall),
            "cpu_median": statistics.median(cpu), "runs": [round(w, 2) for w in wall]}


@torch.inference_mode()
def greedy(runner, cache, logits: torch.Tensor, n: int) -> dict:
    """n greedy steps from `logits` (of the last prompt token): rows [n, V] (row i predicts token i), tokens."""
    rows, tokens = [logits[0]], [int(logits.argmax(-1))]
    for _ in range(n - 1):
        logits = runner.forward(torch.tensor([tokens[-1]]), cache)
        rows.append(logits[0])
        tokens.append(int(logits.argmax(-1)))
    return {"rows": torch.stack(rows), "tokens": tokens}


@torch.inference_mode()
def full_reference(runner, seq: list[int], n: int, chunk: int = CHUNK) -> dict:
    """Full prefill (timed: TTFT) + n greedy steps."""
    def first():
        cache = runner.new_cache(len(seq) + n + 1)
        logits = runner.prefill(seq, cache, chunk=chunk)
        int(logits.argmax(-1))
        return cache, logits

    (cache, logits), ttft, ttft_cpu = timed(first, runner.device)
    return {**greedy(runner, cache, logits, n), "ttft_ms": (ttft, ttft_cpu)}


@torch.inference_mode()
def teacher_forced(runner, cache, logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Rows [n, V]: next-token `logits`, then the logits after each reference greedy token fed to `cache`."""
    rest = runner.forward(torch.tensor(tokens[:-1]), cache, logits="all") if len(tokens) > 1 else None
    return logits if rest is None else torch.cat([logits, rest])


@torch.inference_mode()
def extra_query_scores(runner, base_cache, queries: list[list[int]], refs: list[dict] | None, n: int):
    """For each query appended to a clone of base_cache: its greedy reference (refs None) or fidelity vs refs."""
    out = []
    for i, q in enumerate(queries):
        cache = base_cache.clone()
        cache.reserve(cache.offset + len(q) + n + 1)
        logits = runner.prefill(q, cache)
        out.append(greedy(runner, cache, logits, n) if refs is None else
                   fidelity(refs[i]["rows"], teacher_forced(runner, cache, logits, refs[i]["tokens"]), refs[i]["tokens"]))
    return out


def aggregate(per_query: list[dict]) -> dict:
    """Means over queries (cos_min: the minimum); greedy_exact only if exact for every query."""
    mean = lambda key: sum(m[key] for m in per_query) / len(per_query)  # noqa: E731
    out = {k: mean(k) for k in ("kl_next", "kl_mean", "kl_top20_next", "kl_top20_mean", "cos_next", "cos_mean",
                                "top1", "greedy_match_tokens")}
    out.update(cos_min=min(m["cos_min"] for m in per_query), greedy_exact=all(m["greedy_exact"] for m in per_query),
               greedy_exact_rate=mean("greedy_exact"), queries=len(per_query),
               misses=sum(m["misses"] for m in per_query), near_tie_misses=sum(m["near_tie_misses"] for m in per_query))
    return out


def fidelity(ref_rows: torch.Tensor, rows: torch.Tensor, tokens: list[int]) -> dict:
    ref_lp, lp = F.log_softmax(ref_rows.float(), -1), F.log_softmax(rows.float(), -1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
    top = ref_lp.topk(min(TOP_K, ref_lp.shape[-1]), -1).indices  # [n, k]
    ref_top, top_lp = F.log_softmax(ref_lp.gather(-1, top), -1), F.log_softmax(lp.gather(-1, top), -1)
    kl_top = (ref_top.exp() * (ref_top - top_lp)).sum(-1)
    cos = F.cosine_similarity(ref_rows.float(), rows.float(), dim=-1)
    agree = (rows.argmax(-1).cpu() == torch.tensor(tokens)).tolist()
    first_miss = agree.index(False) if False in agree else len(agree)
    top2 = ref_lp.topk(2, -1).values
    margin = (top2[:, 0] - top2[:, 1]).cpu().tolist()
    missed = [m for m, ok in zip(margin, agree) if not ok]
    return {"misses": len(missed), "near_tie_misses": sum(m < NEAR_TIE for m in missed),
            "kl_next": float(kl[0]), "kl_mean": float(kl.mean()), "kl_top20_next": float(kl_top[0]),
            "kl_top20_mean": float(kl_top.mean()), "cos_next": float(cos[0]),
            "cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "top1": sum(agree) / len(agree),
            "greedy_exact": first_miss == len(agree), "greedy_match_tokens": first_miss}


def _compose(runner, case: EvalCase, repair, prefix_cache=None, chunk: int = CHUNK, query: bool = True):
    tail = [case.query] if query else []
    if prefix_cache is None:
        return compose_segments(runner, [case.prefix, *case.context_segments(), *tail], repair, chunk=chunk)
    cache = prefix_cache.clone()
    return compose_segments(runner, [*case.context_segments(), *tail], repair, cache=cache, chunk=chunk)


def _first_token(runner, cache, ids: list[int]) -> int:
    """The engine's prefill of ids after what `cache` holds (ModelRunner.run, in CHUNK-token chunks); the argmax."""
    return int(runner.prefill(ids, cache, chunk=CHUNK).argmax(-1))


def _full_ttft(runner, seq: list[int]) -> int:
    return _first_token(runner, runner.new_cache(len(seq) + 1), seq)


def _composed_ttft(runner, case: EvalCase, repair, prefix_cache=None) -> int:
    """First token of the composed context: the blocks placed and repaired, then the query prefilled."""
    return int(_compose(runner, case, repair, prefix_cache).logits.argmax(-1))


def evaluate(runner, case: EvalCase, repairs: Sequence = DEFAULT_SWEEP, n_greedy: int = 32, repeats: int = 1,
             warm_prefix: bool = True, log: Callable[[str], None] = print,
             variants: dict[str, list[SkillBlock]] | None = None) -> dict:
    """One record: the full-prefill reference, then per repair its fidelity and TTFT (cold and warm prefix).

    cold: prefix prefilled + blocks placed + query prefilled, first token sampled (argmax).
    warm: the prefix KV comes from a cache (cloned each run, as a prefix-cache hit copies it).
    TTFT takes the engine's forward (ModelRunner.run, prefill in the engine's chunks) on every device.
    variants: the same skills compiled other ways (label -> blocks with the case's token ids, e.g. one set
    per preamble); every repair is scored on each against the one reference. Rows carry the label
    ("preamble"); without variants it is the blocks' own preamble.
    """
    runner = getattr(runner, "runner", runner)
    dev = runner.device
    seq = case.sequence
    if not variants:
        variants = {case.blocks[0].meta.get("preamble", "as compiled") if case.blocks else "as compiled": case.blocks}
    for label, blocks in variants.items():
        if [b.token_ids for b in blocks] != [b.token_ids for b in case.blocks]:
            raise ValueError(f"variant {label!r} has other token ids than the case's blocks")
    gaps = sum(len(g) for g in case.gaps)
    log(f"full prefill of {len(seq)} tokens ({len(case.prefix)} prefix + {case.block_tokens} in "
        f"{len(case.blocks)} blocks" + (f" + {gaps} between them" if gaps else "") +
        f" + {len(case.query)} query), then {n_greedy} greedy tokens")
    ref = full_reference(runner, seq, n_greedy)
    refs = [ref]
    if case.more_queries:
        base = runner.new_cache(len(seq) + 1)
        runner.prefill(case.context, base, logits="none")
        refs += extra_query_scores(runner, base, case.more_queries, None, n_greedy)
    full = runs(lambda: _full_ttft(runner, seq), repeats, dev, first=ref["ttft_ms"])
    log(f"  full TTFT runs: {[round(v) for v in full['runs']]} ms")
    prefix_cache = None
    if warm_prefix:
        prefix_cache = runner.new_cache(len(case.prefix) + 1)
        runner.prefill(case.prefix, prefix_cache)
    rows_out = []
    for label, blocks in variants.items():
        if len(variants) > 1:
            log(f" blocks compiled with preamble {label}")
        vcase = replace(case, blocks=list(blocks))
        for spec in repairs:
            row = {"preamble": label, **_repair_row(runner, vcase, make_repair(spec), refs, full, prefix_cache,
                                                    repeats)}
            log(f"  {row['repair']:<34} recomputed {row['recomputed_fraction']:6.1%}  top1 {row['top1']:.3f}  "
                f"(misses {row['misses']}, {row['near_tie_misses']} near ties)  cos {row['cos_mean']:.4f}  "
                f"KL {row['kl_mean']:.4f}  TTFT {row['ttft_ms_cold']['median']:.0f} ms "
                f"({row['speedup_cold']:.1f}x)")
            rows_out.append(row)
    return {"prompt_tokens": len(seq), "prefix_tokens": len(case.prefix), "block_tokens": case.block_tokens,
            "gap_tokens": gaps, "preambles": list(variants),
            "blocks": [{"name": b.name, "tokens": len(b)} for b in case.blocks], "query_tokens": len(case.query),
            "queries_scored": len(case.queries), "n_greedy": n_greedy,
            "greedy_reference": [r["tokens"] for r in refs], "ttft_ms_full": full, "repairs": rows_out,
            "prefill_chunk": CHUNK}


def _repair_row(runner, case: EvalCase, repair, refs: list[dict], full: dict, prefix_cache, repeats: int) -> dict:
    """One repair on one case: fidelity over every query against refs, TTFT cold (and warm with prefix_cache)."""
    dev, ref = runner.device, refs[0]
    comp, *first = timed(lambda: _compose(runner, case, repair), dev)  # also the warm-up
    per_query = [fidelity(ref["rows"], teacher_forced(runner, comp.cache, comp.logits, ref["tokens"]),
                          ref["tokens"])]
    if case.more_queries and is_query_guided(repair):  # the repaired blocks depend on the query: compose each
        for q, r in zip(case.more_queries, refs[1:]):
            qc = _compose(runner, case.first(len(case.blocks), q), repair)
            per_query.append(fidelity(r["rows"], teacher_forced(runner, qc.cache, qc.logits, r["tokens"]),
                                      r["tokens"]))
    elif case.more_queries:
        base = comp.cache  # [prefix][gaps, blocks][query][greedy]: cut back to the shared context
        base.truncate(len(case.context))
        per_query += extra_query_scores(runner, base, case.more_queries, refs[1:], len(ref["tokens"]))
    cold = runs(lambda: _composed_ttft(runner, case, repair), repeats, dev, first=None if repeats else tuple(first))
    warm = runs(lambda: _composed_ttft(runner, case, repair, prefix_cache), repeats,
                dev) if prefix_cache is not None and repeats else None
    row = {"repair": describe(repair), "strategy": repair.name,
           "knob": getattr(repair, repair.knob) if repair.knob else None,
           "recomputed_tokens": comp.recomputed_tokens,
           "recomputed_fraction": comp.recomputed_tokens / max(1, case.block_tokens),
           **aggregate(per_query), "per_query": per_query, "ttft_ms_cold": cold, "ttft_ms_warm_prefix": warm,
           "speedup_cold": full["median"] / cold["median"],
           "speedup_cold_cpu": full["cpu_median"] / cold["cpu_median"]}
    if warm:
        row["speedup_warm_prefix"] = full["median"] / warm["median"]
        row["speedup_warm_prefix_cpu"] = full["cpu_median"] / warm["cpu_median"]
    return row


def ttft_scaling(runner, case: EvalCase, counts: Sequence[int], repairs: Sequence = ("none",), repeats: int = 1,
                 known_full: dict[int, dict] | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """TTFT of full prefill vs composition as the number of blocks (total block tokens) grows.

    known_full: full-prefill summaries already measured for some block counts (reused, not re-run).
    Run after evaluate(), which warms every code path up.
    """
    runner = getattr(runner, "runner", runner)
    out = []
    for count in counts:
        sub = case.first(count)
        seq = sub.sequence
        full = (known_full or {}).get(count) or runs(lambda: _full_ttft(runner, seq), repeats, runner.device)
        row = {"blocks": count, "block_tokens": sub.block_tokens, "ttft_ms_full": full}
        for spec in repairs:
            repair = make_repair(spec)
            row[f"ttft_ms_{describe(repair)}"] = runs(lambda: _composed_ttft(runner, sub, repair), repeats,
                                                      runner.device)
        log(f"  {count} blocks ({sub.block_tokens} tokens): full {full['median']:.0f} ms, "
            + ", ".join(f"{k[8:]} {v['median']:.0f} ms" for k, v in row.items() if k.startswith("ttft_ms_")
                        and k != "ttft_ms_full"))
        out.append(row)
    return out
