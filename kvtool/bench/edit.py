"""`kvtool edit eval`: the ways to edit a field of a cached context (kvtool.skills.edit), scored against full
recompute on cases whose answer depends on the field (kvtool.bench.edit_cases).

Per case and mode the reference is the full recompute of the edited context, then the question and a greedy
continuation. Every way (and `unedited`: the old cache as it was, the baseline) is scored on
- decision agreement: its own greedy answer equals the reference's (agree_text), or names the same value
  (agree_value: old, new or neither, by the case's answers);
- next-token KL, top-1 agreement and logit cosine over the reference's continuation (teacher-forced);
- cost: context tokens recomputed through every layer (and appended, partially run), and the wall time of the
  edit plus the question's prefill against the full recompute's (median of `repeats` runs after a warm-up).
Modes: direct (the answer only) or reasoning (an explicit "think step by step" instruction, greedy reasoning,
then the cue "Answer:" and the answer; where the model ends its turn at the cue, the reasoning's last line
is the answer), both asked after the edit. cached_reasoning puts the reasoning in the cached context: the
question with the "think step by step" instruction and the model's greedy reasoning (generated with the old
value, before the edit) are turns of the context; the field then changes, and the final question (the answer
only) is asked of the edited context. The ways' recompute budgets (recompute_attended: the tokens after the
field the final question attends to most) then pick among the reasoning's tokens, and `full` recomputes the
old reasoning's KV over the new value. None of the models has <think> tokens (SmolLM2, Qwen2.5-Coder, Gemma 3),
so the reasoning is the instruction's plain text on all.
The KL gap closed, 1 - KL(way) / KL(unedited) at the first answer token, is the share of the decision the
way restores; for field_only it measures how much of the decision the field's own KV carries.
"""

from __future__ import annotations

import re
import statistics
from typing import Callable, Sequence

import torch

from kvtool.bench.edit_cases import CASES, EditCase
from kvtool.skills.edit import apply_edit, erratum_text, plan_edit, user_turn_ids
from kvtool.skills.evaluate import fidelity, timed

MODES = {"direct": "Reply with the answer only, in a few words.",
         "reasoning": "Think step by step in one or two short sentences, then give the answer.",
         "cached_reasoning": "Think step by step in one or two short sentences, then give the answer."}
FINAL_QUESTION = "So, what is the answer? Reply with the answer only, in a few words."  # cached_reasoning
ANSWER_CUE = "\nAnswer:"  # forced after the reasoning; the decision is what follows it
DEFAULT_BUDGETS = (0.01, 0.05, 0.10)
STRATEGIES = ("recompute_deviation", "recompute_attended")
RECOVERS = 0.9  # a way "recovers the decision" where it agrees with full recompute on this share of the cases
MIN_GAP = 1e-3  # nats: below this the edit did not move the first answer token, and no gap is measured


def ways(budgets: Sequence[float] = DEFAULT_BUDGETS) -> list[str]:
    return ["full", "unedited", "field_only", "erratum"] + [f"{s}:ratio={b:g}" for s in STRATEGIES for b in budgets]


def generation_prompt_ids(model) -> list[int]:
    system = [{"role": "system", "content": "S"}]
    head = model.render(system, add_generation_prompt=False)
    return model.encode_rendered(model.render(system, add_generation_prompt=True)[len(head):])


@torch.inference_mode()
def greedy_batch(runner, caches: list, logits: list[torch.Tensor], n: int, stop: set[int]):
    """Up to n greedy tokens per sequence from its `logits` [1, V] (a stop token ends it, included), every
    sequence's step in one forward_batch; every token but the last is fed to its cache.
    Returns per sequence (tokens, their logit rows [len, V], stopped)."""
    tokens = [[int(lg.argmax(-1))] for lg in logits]
    rows = [[lg[0]] for lg in logits]
    live = lambda i: tokens[i][-1] not in stop and len(tokens[i]) < n  # noqa: E731
    active = [i for i in range(len(caches)) if live(i)]
    while active:
        outs = runner.forward_batch([(torch.tensor([tokens[i][-1]]), caches[i]) for i in active])
        for i, out in zip(active, outs):
            rows[i].append(out[0])
            tokens[i].append(int(out.argmax(-1)))
        active = [i for i in active if live(i)]
    return [(t, torch.stack(r), t[-1] in stop) for t, r in zip(tokens, rows)]


def normalize(text: str) -> str:
    text = text.strip().split("\n")[0].lower()
    return " ".join(re.sub(r"[^a-z0-9/\-: ]", " ", text).split())


def classify(text: str, case: EditCase) -> str:
    """old, new or other: which of the case's answers the text names (word match; both or neither: other)."""
    has = [re.search(rf"(?<![a-z0-9]){re.escape(a.lower())}(?![a-z0-9])", text.lower()) is not None
           for a in case.answers]
    return "old" if has == [True, False] else "new" if has == [False, True] else "other"


class Answerer:
    """The continuations after the question, and the decisions, of several edited caches at once (batched)."""

    def __init__(self, model, mode: str, answer_tokens: int, reasoning_tokens: int):
        self.model, self.runner, self.mode = model, model.runner, mode
        self.stop = set(model.end_of_turn_ids())
        self.cue = model.encode_rendered(ANSWER_CUE)
        self.n_answer, self.n_reason = answer_tokens, reasoning_tokens

    @torch.inference_mode()
    def __call__(self, caches: list, logits: list, ref_tokens: list[int] | None = None) -> list[dict]:
        """Per cache: its own greedy continuation (tokens, rows), answer text (after the reasoning and the cue
        in reasoning mode), and with ref_tokens the rows of the reference's continuation fed to it. The caches
        are left as they came."""
        runner, pos = self.runner, [c.offset for c in caches]
        outs: list[dict] = [{} for _ in caches]
        if ref_tokens:
            forced = runner.forward_batch([(torch.tensor(ref_tokens[:-1]), c) for c in caches], logits="all") \
                if len(ref_tokens) > 1 else [None] * len(caches)
            for out, lg, f, c, p in zip(outs, logits, forced, caches, pos):
                out["rows_forced"] = lg if f is None else torch.cat([lg, f])
                c.truncate(p)
        n = self.n_reason if self.mode == "reasoning" else self.n_answer
        said = []
        for out, (tokens, rows, stopped) in zip(outs, greedy_batch(runner, caches, logits, n, self.stop)):
            out.update(tokens=tokens, rows=rows, stopped=stopped)
            said.append(tokens[:-1] if stopped else tokens)
        if self.mode == "reasoning":
            cued = runner.forward_batch([(torch.tensor(([] if o["stopped"] else o["tokens"][-1:]) + self.cue), c)
                                         for o, c in zip(outs, caches)])
            for out, text in zip(outs, said):
                out["reasoning"] = self.model.decode(text)
            said = [[t for t in tokens if t not in self.stop]
                    for tokens, _, _ in greedy_batch(runner, caches, cued, self.n_answer, self.stop)]
        for out, text, c, p in zip(outs, said, caches, pos):
            out["answer"] = self.model.decode(text).strip()
            if not out["answer"] and out.get("reasoning"):  # it ended its turn at the cue: the answer was said
                out["answer"] = [line for line in out["reasoning"].splitlines() if line.strip()][-1].strip()
            c.truncate(p)
        return outs


def _unedited(runner, cache, question):
    """The baseline: the old cache, as if nothing were edited, then the question."""
    out = cache.clone()
    out.reserve(out.offset + len(question) + 1)
    return out, runner.prefill(question, out)


def evaluate_case(model, case: EditCase, modes: Sequence[str], budgets: Sequence[float], answer_tokens: int,
                  reasoning_tokens: int, repeats: int, log: Callable[[str], None]) -> list[dict]:
    runner = model.runner
    erratum = user_turn_ids(model, erratum_text(case.old, case.new, case.label))
    rows = []
    for mode in modes:
        edit, question, cached = case_context(model, case, mode, reasoning_tokens)
        old_cache = runner.new_cache(len(edit.old_ids) + 1)
        runner.prefill(edit.old_ids, old_cache, logits="none")
        answer = Answerer(model, "direct" if cached is not None else mode, answer_tokens, reasoning_tokens)
        results: dict = {}
        for way in ways(budgets):
            if way == "unedited":
                fn = lambda: _unedited(runner, old_cache, question)  # noqa: E731
                (cache, logits), ms, _ = timed(fn, runner.device)
                res = {"cache": cache, "logits": logits, "recomputed": 0, "appended": 0, "partial": 0, "ms": [ms]}
            else:
                fn = lambda: apply_edit(runner, old_cache, edit, way, erratum, question)  # noqa: E731
                r = fn()
                res = {"cache": r.cache, "logits": r.logits, "recomputed": r.recomputed, "appended": r.appended,
                       "partial": r.partial * r.partial_layers / runner.spec.num_layers, "ms": [r.ms]}
            if repeats:  # the run above was the warm-up
                res["ms"] = [timed(fn, runner.device)[1] for _ in range(repeats)]
            results[way] = res
        ref = answer([results["full"]["cache"]], [results["full"]["logits"]])[0]
        ref_class = classify(ref["answer"], case)
        full_ms = statistics.median(results["full"]["ms"])
        others = [w for w in results if w != "full"]
        got_all = dict(zip(others, answer([results[w]["cache"] for w in others], [results[w]["logits"] for w in others],
                                          ref["tokens"])), full=ref)
        kl_unedited = None
        for way, res in results.items():
            got = got_all[way]
            fid = fidelity(ref["rows"], got.get("rows_forced", ref["rows"]), ref["tokens"])
            if way == "unedited":
                kl_unedited = fid["kl_next"]
            ms = statistics.median(res["ms"])
            row = {"case": case.name, "kind": case.kind, "mode": mode, "way": way,
                   "strategy": way.partition(":")[0], "budget": _budget(way),
                   "context_tokens": len(edit.old_ids), "field_tokens": edit.field_tokens,
                   "recomputed": res["recomputed"], "appended": res["appended"],
                   "partial_equiv": round(res["partial"], 2),
                   "fraction": res["recomputed"] / len(edit.new_ids), "ms": round(ms, 2),
                   "speedup": full_ms / ms if ms else None, "answer": got["answer"],
                   "decision": classify(got["answer"], case),
                   "agree_text": normalize(got["answer"]) == normalize(ref["answer"]),
                   "agree_value": classify(got["answer"], case) == ref_class,
                   **{k: fid[k] for k in ("kl_next", "kl_mean", "top1", "cos_next", "cos_mean", "greedy_match_tokens")}}
            if "reasoning" in got:
                row["reasoning"] = got["reasoning"]
            if cached is not None:
                row["cached_reasoning"] = cached
            rows.append(row)
        for row in rows[-len(results):]:
            gap = kl_unedited if kl_unedited is not None and kl_unedited > MIN_GAP else None
            row["gap_closed"] = None if gap is None else 1.0 - row["kl_next"] / gap
        log(f"  {case.name} [{mode}] full: {ref['answer']!r} ({ref_class}) | " + ", ".join(
            f"{r['way']}: {'=' if r['agree_text'] else 'x'}" for r in rows[-len(results):] if r["way"] != "full"))
    return rows


def case_context(model, case: EditCase, mode: str, reasoning_tokens: int):
    """(the edit of the field in the context the mode caches, the question's ids, the cached reasoning or None)"""
    cached = None
    if mode == "cached_reasoning":  # the reasoning, generated with the old value, becomes part of the context
        cached = cached_reasoning(model, case, reasoning_tokens)
        messages = case.messages(case.old) + [{"role": "user", "content": f"{case.question} {MODES[mode]}"},
                                              {"role": "assistant", "content": cached}]
        question = user_turn_ids(model, FINAL_QUESTION) + generation_prompt_ids(model)
    else:
        messages = case.messages(case.old)
        question = user_turn_ids(model, f"{case.question} {MODES[mode]}") + generation_prompt_ids(model)
    text = model.render(messages, add_generation_prompt=False)
    facts = model.render(case.messages(case.old), add_generation_prompt=False)
    span = case.field_span(facts if text.startswith(facts) else text)  # the facts turn's (reasoning may repeat it)
    return plan_edit(model, text, span, case.new), question, cached


@torch.inference_mode()
def cached_reasoning(model, case: EditCase, tokens: int) -> str:
    """The model's greedy reasoning (up to `tokens` tokens, its turn's end dropped) to the case's question with
    the "think step by step" instruction, given the old value: what a cached context would hold."""
    messages = case.messages(case.old) + [{"role": "user", "content": f"{case.question} {MODES['cached_reasoning']}"}]
    ids = model.encode_chat(messages, add_generation_prompt=True)
    cache = model.runner.new_cache(len(ids) + tokens + 1)
    stop = set(model.end_of_turn_ids())
    said, _, _ = greedy_batch(model.runner, [cache], [model.runner.prefill(ids, cache)], tokens, stop)[0]
    return model.decode([t for t in said if t not in stop]).strip() or "..."


def _budget(way: str):
    _, _, knobs = way.partition(":")
    return float(knobs.partition("=")[2]) if knobs.startswith("ratio=") else None


def summarize(rows: list[dict]) -> dict:
    """Per mode, per way: agreement, fidelity, cost (means over cases; times as medians)."""
    out: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        out[mode] = {}
        of_mode = [r for r in rows if r["mode"] == mode]
        for way in dict.fromkeys(r["way"] for r in of_mode):
            rs = [r for r in of_mode if r["way"] == way]
            mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
            gaps = [r["gap_closed"] for r in rs if r["gap_closed"] is not None]
            out[mode][way] = {
                "cases": len(rs), "agreement": mean("agree_text"), "agreement_value": mean("agree_value"),
                "follows_new": sum(r["decision"] == "new" for r in rs) / len(rs),
                "follows_old": sum(r["decision"] == "old" for r in rs) / len(rs),
                "kl_next": mean("kl_next"), "top1": mean("top1"), "cos_mean": mean("cos_mean"),
                "gap_closed_median": statistics.median(gaps) if gaps else None, "gap_cases": len(gaps),
                "fraction_recomputed": mean("fraction"), "recomputed_tokens": mean("recomputed"),
                "appended_tokens": mean("appended"), "partial_equiv_tokens": mean("partial_equiv"),
                "ms_median": statistics.median(r["ms"] for r in rs),
                "speedup_median": statistics.median(r["speedup"] for r in rs if r["speedup"])}
    return out


def verdict(rows: list[dict], summary: dict) -> dict:
    """The chapter's two claims, per mode, measured on the cases where the edit changes the answer."""
    out = {}
    for mode, ways_ in summary.items():
        of_mode = [r for r in rows if r["mode"] == mode]
        changed = {r["case"] for r in of_mode if r["way"] == "unedited" and not r["agree_text"]}
        on_changed = lambda way: [r for r in of_mode if r["way"] == way and r["case"] in changed]  # noqa: E731
        share = lambda way: (sum(r["agree_text"] for r in on_changed(way)) / len(changed)) if changed else None  # noqa: E731
        field_gap = ways_["field_only"]["gap_closed_median"]
        out[mode] = {
            "cases": ways_["full"]["cases"], "edit_changes_answer": len(changed),
            "field_only_recovers": share("field_only"), "erratum_recovers": share("erratum"),
            **{f"{w}_recovers": share(w) for w in ways_ if w.startswith("recompute_")},
            "field_only_gap_closed_median": field_gap,
            "claim_field_kv_under_1pct": None if field_gap is None else field_gap < 0.01,
            "claim_erratum_recovers": None if not changed else share("erratum") >= RECOVERS,
            **_one_percent(ways_)}
    return out


def _one_percent(ways_: dict) -> dict:
    """"About 1% of the cost, close to full recompute": the 1% query-guided way's agreement with full recompute
    (on every case) and its cost against full's, in recomputed tokens and in wall time."""
    at = ways_.get("recompute_attended:ratio=0.01")
    if at is None:
        return {}
    cost = 1.0 / at["speedup_median"] if at["speedup_median"] else None
    return {"at_1pct": {"agreement": at["agreement"], "fraction_recomputed": at["fraction_recomputed"],
                        "time_vs_full": cost},
            "claim_1pct_close_to_full": at["agreement"] >= RECOVERS}


def run_edit_eval(model, cases: Sequence[EditCase] = CASES, modes: Sequence[str] = tuple(MODES),
                  budgets: Sequence[float] = DEFAULT_BUDGETS, answer_tokens: int = 12, reasoning_tokens: int = 48,
                  repeats: int = 1, log: Callable[[str], None] = print,
                  on_case: Callable[[dict], None] | None = None) -> dict:
    """The record of every case in every mode; on_case(record so far) after each case (a long run's partial
    results survive an interruption)."""
    from kvtool.bench.protocol import device_name, versions
    from kvtool.errors import InvalidParameterError

    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise InvalidParameterError(f"unknown mode(s) {bad or modes}; use {', '.join(MODES)}")
    if any(not 0.0 < b <= 1.0 for b in budgets):
        raise InvalidParameterError(f"budgets are shares of the context in (0, 1], got {list(budgets)}")
    rows: list[dict] = []

    def record(done: int) -> dict:
        summary = summarize(rows)
        return {"bench": "edit", "model": model.name, "device": device_name(model.runner.device),
                "dtype": model.runner.precision, "cases": done, "cases_planned": len(cases), "modes": list(modes),
                "budgets": list(budgets), "mode_instructions": {m: MODES[m] for m in modes}, "answer_cue": ANSWER_CUE,
                "answer_tokens": answer_tokens, "reasoning_tokens": reasoning_tokens, "repeats": repeats,
                "torch_threads": torch.get_num_threads(), "summary": summary, "verdict": verdict(rows, summary),
                "rows": rows, "versions": versions()}

    for i, case in enumerate(cases, 1):
        log(f"case {i}/{len(cases)}: {case.name} ({case.kind}): {case.old!r} -> {case.new!r}")
        rows += evaluate_case(model, case, modes, budgets, answer_tokens, reasoning_tokens, repeats, log)
        if on_case is not None and i < len(cases):
            on_case(record(i))
    return record(len(cases))


def merge_records(records: list[dict]) -> dict:
    """One record from runs of one model and one set of settings over different cases (a long run split by
    case into several processes): the rows together, summary and verdict computed again over all of them."""
    from kvtool.errors import InvalidParameterError

    keys = ("model", "dtype", "budgets", "answer_tokens", "reasoning_tokens", "repeats")
    for rec in records[1:]:
        differ = [k for k in keys if rec.get(k) != records[0].get(k)]
        if differ:
            raise InvalidParameterError(f"cannot merge records that differ in {differ}")
    seen = [(r["case"], r["mode"]) for rec in records for r in rec["rows"] if r["way"] == "full"]
    if len(seen) != len(set(seen)):
        raise InvalidParameterError("the records share a case in one mode; merge runs over different cases")
    rows = [r for rec in records for r in rec["rows"]]
    summary = summarize(rows)
    cases = len({r["case"] for r in rows})
    return {**records[0], "cases": cases, "cases_planned": cases, "partial": any(r.get("partial") for r in records),
            "modes": list(dict.fromkeys(m for rec in records for m in rec["modes"])),
            "merged_from": len(records), "summary": summary, "verdict": verdict(rows, summary), "rows": rows}


def plot_records(records: list[dict], path) -> object:
    """Agreement with full recompute against the share of the context recomputed: a line per strategy (the
    field_only point, then its budgets), a marker for erratum, unedited and full; one panel per model (records
    of one model, e.g. a direct and a reasoning run, share its panel, one line style per mode)."""
    from kvtool.bench.plots import line_panels

    panels: dict = {}
    modes = {mode for rec in records for mode in rec["summary"]}
    for rec in records:
        lines = panels.setdefault(rec["model"], {"cases": [], "lines": {}})
        for mode, ways_ in rec["summary"].items():
            lines["cases"].append(f"{mode}: {ways_['full']['cases']} cases")
            style = "" if len(modes) == 1 else f" ({mode})"
            point = lambda w: (ways_[w]["fraction_recomputed"], ways_[w]["agreement"])  # noqa: E731
            for strategy in STRATEGIES:
                pts = [point("field_only")] + sorted(point(w) for w in ways_ if w.startswith(strategy + ":"))
                lines["lines"][strategy + style] = pts
            for way in ("erratum", "unedited", "full"):
                lines["lines"][way + style] = [point(way)]
    return line_panels(path, "field edit: decision agreement with full recompute",
                       {f"{model}\n({', '.join(p['cases'])})": p["lines"] for model, p in panels.items()},
                       xlabel="share of the context recomputed", ylabel="answer agreement with full recompute")
