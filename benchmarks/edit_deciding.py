"""Field edits through cached reasoning, on cases whose answer the edit decides: `kvtool edit eval`'s
cached_reasoning mode on generated cases, kept only where full recompute's answer follows the edit.

    OMP_NUM_THREADS=1 python benchmarks/edit_deciding.py --model smollm2 --want 25 \\
        --out benchmarks/results/edit-cpu-smollm2-deciding.json

A seeded generator (`generate`) writes candidate cases: a short record (an account, a store, a ticket, an
order, a deploy...) in which one field decides a yes/no or a pick between two named options, often through a
rule line ("Rule: only an admin may delete accounts."); the other lines are random distractors, the field
sits among them at a random place, and the edit flips the field to the value that flips the answer (both
directions occur). Per model each candidate is screened by full recompute (`screen`): the model's greedy
reasoning to the question, generated with the old value (the cached_reasoning mode's "think step by step",
--reasoning-tokens), is a turn of the context; the final question is answered from a full prefill of the old
context and of the edited one. A candidate is deciding where the old context's answer names the old value's
answer and the edited context's names the new value's. Candidates whose new value does not tokenize in place
(same token count) are skipped. A deciding candidate then runs every edit way (kvtool.bench.edit.evaluate_case)
and counts where that run confirms it (`decided`: its unedited cache answers as the old value, its full
recompute as the new). Screening stops at --want counted cases or after --candidates.

The record is `kvtool edit eval`'s (rows, summary and verdict over the counted cases) plus `screen` (every
candidate's outcome) and `claims` (`claims`): per way its answer agreement with full recompute, first-token
agreement, next-token KL, share of the context recomputed and wall time against full's; for field_only the
share of the decision the field's own KV carries; and whether "about 1 % of the cost, close to full
recompute" holds for recompute_attended at 1 % (CLAIM).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

# "about 1 % of the cost, close to full recompute": the way recomputes at most this share of the context and its
# answer names full recompute's value in at least this share of the deciding cases; fidelity as issue #66's bar,
# the KL averaged over the answer's tokens (teacher-forced on full recompute's), which holds the deciding one
CLAIM = {"fraction_recomputed": 0.02, "answer_agreement": 0.9, "first_token_agreement": 0.98, "kl_mean": 0.05}
ONE_PERCENT = "recompute_attended:ratio=0.01"


class Scenario(NamedTuple):
    kind: str
    title: str  # the record's first line; {who} is a random name
    rule: str  # "" or a line that turns the field into the decision
    field: str
    values: tuple[str, str]
    answers: tuple[str, str]  # what the answer names under each value
    question: str


SCENARIOS = (
    Scenario("access", "Account check for {who}:", "Rule: only an admin may delete accounts.", "role",
             ("admin", "guest"), ("yes", "no"), "May {who} delete accounts? Answer yes or no."),
    Scenario("store", "Store info for {who}:", "", "status now", ("open", "closed"), ("yes", "no"),
             "Is the store open right now? Answer yes or no."),
    Scenario("umbrella", "Day plan for {who}:", "Rule: take an umbrella when the forecast is rain.", "forecast",
             ("rain", "sun"), ("yes", "no"), "Should {who} take an umbrella? Answer yes or no."),
    Scenario("routing", "Support ticket from {who}:",
             "Rule: urgent tickets go to the red team, all others to the blue team.", "priority",
             ("urgent", "normal"), ("red", "blue"), "Which team gets the ticket, red or blue?"),
    Scenario("payment", "Order from {who}:", "Rule: an order ships only when it is paid.", "payment",
             ("paid", "unpaid"), ("yes", "no"), "Can the order ship now? Answer yes or no."),
    Scenario("login", "User {who}:", "", "account", ("active", "locked"), ("yes", "no"),
             "Can {who} log in now? Answer yes or no."),
    Scenario("deploy", "Deploy request by {who}:",
             "Rule: deploys to production need a review; deploys to staging do not.", "target",
             ("production", "staging"), ("yes", "no"), "Does this deploy need a review? Answer yes or no."),
    Scenario("carrier", "Parcel for {who}:", "", "carrier", ("DHL", "UPS"), ("DHL", "UPS"),
             "Which carrier ships the parcel, DHL or UPS?"),
    Scenario("seat", "Flight booking for {who}:", "", "seat preference", ("window", "aisle"),
             ("window", "aisle"), "Which seat should be booked for {who}, window or aisle?"),
    Scenario("commute", "Commute plan for {who}:", "Rule: when it rains, take the bus; when it is dry, the bike.",
             "weather", ("rain", "dry"), ("bus", "bike"), "Should {who} take the bus or the bike today?"),
    Scenario("notify", "Preferences of {who}:", "", "notifications", ("on", "off"), ("yes", "no"),
             "Should the agent send {who} a push notification? Answer yes or no."),
    Scenario("dinner", "Dinner booking for {who}:", "Rule: vegan guests get the lentil dish, all others the fish.",
             "diet", ("vegan", "regular"), ("lentil", "fish"), "Which dish should {who} get, lentil or fish?"),
    Scenario("parcel", "Parcel for {who}:", "Rule: parcels over 5 kg go by truck, lighter ones by van.", "weight",
             ("8 kg", "2 kg"), ("truck", "van"), "Does the parcel go by truck or by van?"),
    Scenario("branch", "Customer {who}:", "Rule: customers in the north are served from Oslo, all others from Rome.",
             "area", ("north", "south"), ("Oslo", "Rome"), "Is {who} served from Oslo or from Rome?"),
    Scenario("reply", "Customer {who}:", "Rule: reply in French to customers from Canada, in English to all others.",
             "country", ("Canada", "Brazil"), ("French", "English"), "Should the reply be in French or in English?"),
    Scenario("assign", "Ticket from {who}:", "Rule: tickets about billing go to Anna, all others to Ben.", "topic",
             ("billing", "login"), ("Anna", "Ben"), "Does the ticket go to Anna or to Ben?"),
    # picks that read the field back, both options named in the question (what SmolLM2-135M can answer)
    Scenario("store_pick", "Store info for {who}:", "", "status now", ("open", "closed"), ("open", "closed"),
             "Is the store open or closed right now?"),
    Scenario("account_pick", "User {who}:", "", "account", ("active", "locked"), ("active", "locked"),
             "Is the account of {who} active or locked?"),
    Scenario("trip_pick", "Trip for {who}:", "", "destination", ("Paris", "Rome"), ("Paris", "Rome"),
             "Is {who} going to Paris or Rome?"),
    Scenario("drink_pick", "Cafe order for {who}:", "", "drink", ("tea", "coffee"), ("tea", "coffee"),
             "Does {who} want tea or coffee?"),
    Scenario("day_pick", "Meeting with {who}:", "", "day", ("Monday", "Friday"), ("Monday", "Friday"),
             "Is the meeting on Monday or Friday?"),
    Scenario("size_pick", "Shirt order for {who}:", "", "size", ("small", "large"), ("small", "large"),
             "Is the shirt small or large?"),
    # the field read back, no option named in the question
    Scenario("home_city", "Customer record for {who}:", "", "home city", ("Paris", "London"), ("Paris", "London"),
             "In which city does {who} live?"),
    Scenario("destination", "Trip request from {who}:", "", "destination", ("Madrid", "Rome"), ("Madrid", "Rome"),
             "Where is {who} going?"),
    Scenario("customer", "Support ticket, agent {who}:", "", "customer", ("Alice", "Bob"), ("Alice", "Bob"),
             "What is the customer's name?"),
    Scenario("ship_to", "Parcel from {who}:", "", "ship to", ("Canada", "Brazil"), ("Canada", "Brazil"),
             "Which country is the parcel shipped to?"),
    Scenario("month", "Booking for {who}:", "", "flight month", ("March", "April"), ("March", "April"),
             "In which month does {who} fly?"),
    Scenario("car", "Car rental for {who}:", "", "car colour", ("red", "blue"), ("red", "blue"),
             "What colour is the car of {who}?"),
)
# --kinds names a group as well as a kind
GROUPS = {"picks": ("routing", "carrier", "seat", "commute", "dinner", "parcel", "branch", "reply", "assign",
                    "store_pick", "account_pick", "trip_pick", "drink_pick", "day_pick", "size_pick"),
          "readback": ("store_pick", "account_pick", "trip_pick", "drink_pick", "day_pick", "size_pick", "home_city",
                       "destination", "customer", "ship_to", "month", "car")}
NAMES = ("Ana", "Omar", "Mei", "Lena", "Kim", "Sam", "Priya", "Jonas", "Ravi", "Elena", "Tom", "Yuki")
DISTRACTORS = (("id", ("4711", "2093", "5520", "8812", "1307")), ("created", ("2024-03-14", "2023-11-02")),
               ("region", ("north", "south", "east", "west")), ("owner", NAMES), ("tier", ("basic", "plus", "pro")),
               ("language", ("English", "Spanish", "German")), ("notes", ("none", "call first", "fragile")),
               ("time zone", ("UTC", "CET", "PST")), ("contact", ("email", "phone", "chat")))


def generate(seed: int, n: int, kinds=None) -> list:
    """n candidate EditCases, the scenarios (of `kinds`, default all) in turn; everything else drawn from
    random.Random(seed)."""
    from kvtool.bench.edit_cases import EditCase

    wanted = None if kinds is None else {k for name in kinds for k in GROUPS.get(name, (name,))}
    scenarios = [sc for sc in SCENARIOS if wanted is None or sc.kind in wanted]
    if not scenarios:
        raise ValueError(f"no scenario of kinds {list(kinds)}; known: {', '.join(sc.kind for sc in SCENARIOS)}")
    rng, out = random.Random(seed), []
    for i in range(n):
        sc = scenarios[i % len(scenarios)]
        turn = slice(None, None, -1 if rng.random() < 0.5 else 1)  # which value is the old one
        (old, new), answers, who = sc.values[turn], sc.answers[turn], rng.choice(NAMES)
        labels = [d for d in DISTRACTORS if d[0] != sc.field]
        lines = [f"- {label}: {rng.choice(values)}" for label, values in rng.sample(labels, rng.randint(2, 5))]
        lines.insert(rng.randint(0, len(lines)), f"- {sc.field}: {{v}}")
        facts = (sc.title.format(who=who), *([sc.rule] if sc.rule else []), *lines)
        out.append(EditCase(f"{sc.kind}-{seed}-{i:03d}", sc.kind, facts, old, new, f"the {sc.field}",
                            sc.question.format(who=who), answers))
    return out


def first_mention(text: str, case) -> int | None:
    """Where `text` first names one of the case's answers or values (a whole word, any case), or None."""
    words = {w.lower() for w in (*case.answers, case.old, case.new)}
    found = [m.start() for w in words for m in re.finditer(rf"(?<![a-z0-9]){re.escape(w)}(?![a-z0-9])", text.lower())]
    return min(found, default=None)


def reasoning_cut(model, case, most: int) -> int:
    """The most greedy reasoning tokens (at most `most`) that name none of the case's answers or values: the
    reasoning cached up to its conclusion, not through it. 0 where it opens with one."""
    from kvtool.bench.edit import cached_reasoning

    text = cached_reasoning(model, case, most)
    at = first_mention(text, case)
    if at is None:
        return most
    k = len(model.encode_rendered(text[:at].rstrip())) if text[:at].strip() else 0
    while k > 0 and first_mention(cached_reasoning(model, case, k), case) is not None:
        k -= 1  # the prefix re-tokenized longer than the greedy tokens it came from
    return k


def screen(model, case, reasoning_tokens: int, answer_tokens: int, cut: bool = True) -> dict:
    """The case under full recompute: the final question's answer after the old context and after the edited
    one, each prefilled whole (the cached reasoning, generated with the old value, in both; with `cut`, only
    its tokens before it first names an answer or a value, reasoning_cut)."""
    import torch

    from kvtool.bench.edit import Answerer, case_context, classify

    tokens = reasoning_cut(model, case, reasoning_tokens) if cut else reasoning_tokens
    out = {"case": case.name, "kind": case.kind, "old": case.old, "new": case.new, "reasoning_tokens": tokens}
    if tokens == 0:
        return {**out, "outcome": "reasoning_opens_with_answer"}
    edit, question, reasoning = case_context(model, case, "cached_reasoning", tokens)
    out.update(reasoning=reasoning, context_tokens=len(edit.old_ids))
    if not edit.in_place:
        return {**out, "outcome": "not_in_place"}
    caches, logits = [], []
    with torch.inference_mode():
        for ids in (edit.old_ids, edit.new_ids):
            caches.append(model.runner.new_cache(len(ids) + len(question) + answer_tokens + 1))
            logits.append(model.runner.prefill(ids + question, caches[-1]))
    before, after = (o["answer"] for o in Answerer(model, "direct", answer_tokens, reasoning_tokens)(caches, logits))
    said = (classify(before, case), classify(after, case))
    return {**out, "before": before, "after": after,
            "outcome": "deciding" if said == ("old", "new") else f"{said[0]}->{said[1]}"}


def decided(case_rows: list[dict]) -> bool:
    """evaluate_case's rows of one case confirm the screen: the unedited cache answers as the old value, full
    recompute of the edited context as the new."""
    way = {r["way"]: r for r in case_rows}
    return way["unedited"]["decision"] == "old" and way["full"]["decision"] == "new"


def claims(rows: list[dict]) -> dict:
    """Per way over the counted cases (each one the edit decides, so full recompute names the new value):
    answer agreement with full recompute (names its value / same text), first-token agreement, KL at the first
    answer token and over the answer, share recomputed, wall time against full's, and the KL gap closed over the
    answer, 1 - KL(way) / KL(unedited) per case (for field_only: the share of the decision the field's own KV
    carries); and the 1 % claim against CLAIM."""
    from kvtool.bench.edit import MIN_GAP

    stale = {r["case"]: r["kl_mean"] for r in rows if r["way"] == "unedited"}
    ways: dict = {}
    for way in dict.fromkeys(r["way"] for r in rows):
        rs = [r for r in rows if r["way"] == way]
        mean = lambda f: sum(map(f, rs)) / len(rs)  # noqa: E731
        gaps = [1 - r["kl_mean"] / stale[r["case"]] for r in rs if stale.get(r["case"], 0) > MIN_GAP]
        ways[way] = {"cases": len(rs), "answer_agreement": mean(lambda r: r["decision"] == "new"),
                     "text_agreement": mean(lambda r: r["agree_text"]),
                     "follows_old": mean(lambda r: r["decision"] == "old"),
                     "first_token_agreement": mean(lambda r: r["greedy_match_tokens"] >= 1),
                     "kl_next": mean(lambda r: r["kl_next"]), "kl_mean": mean(lambda r: r["kl_mean"]),
                     "kl_mean_median": statistics.median(r["kl_mean"] for r in rs),
                     "fraction_recomputed": mean(lambda r: r["fraction"]),
                     "recomputed_tokens": mean(lambda r: r["recomputed"]),
                     "context_tokens": mean(lambda r: r["context_tokens"]),
                     "time_vs_full_median": statistics.median(1 / r["speedup"] for r in rs if r["speedup"]),
                     "gap_closed_median": statistics.median(gaps) if gaps else None}
    out: dict = {"ways": ways}
    if "field_only" in ways:
        out["field_kv_carries"] = {k: ways["field_only"][k] for k in ("answer_agreement", "gap_closed_median")}
    at = ways.get(ONE_PERCENT)
    if at is not None:
        checks = {"fraction_recomputed": at["fraction_recomputed"] <= CLAIM["fraction_recomputed"],
                  "answer_agreement": at["answer_agreement"] >= CLAIM["answer_agreement"],
                  "first_token_agreement": at["first_token_agreement"] >= CLAIM["first_token_agreement"],
                  "kl_mean": at["kl_mean"] <= CLAIM["kl_mean"]}
        out["one_percent"] = {"way": ONE_PERCENT, "checks": checks, "holds": all(checks.values()),
                              "wall_time_vs_full": at["time_vs_full_median"]}
    return out


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(model, candidates, want: int, budgets, reasoning_tokens: int, answer_tokens: int, cut: bool = True,
        on_case=None) -> dict:
    """Screen candidates in order until `want` are counted; the record so far to on_case after each evaluation."""
    from kvtool.bench.edit import evaluate_case, summarize, verdict

    screens, rows, t0 = [], [], time.perf_counter()

    def record() -> dict:
        counted = sum(s.get("counted", False) for s in screens)
        summary = summarize(rows) if rows else {}
        return {"bench": "edit", "selection": "deciding", "model": model.name, "dtype": model.runner.precision,
                "cases": counted, "candidates_screened": len(screens), "modes": ["cached_reasoning"],
                "budgets": list(budgets), "answer_tokens": answer_tokens, "reasoning_tokens": reasoning_tokens, "cut": cut,
                "repeats": 0, "summary": summary, "verdict": verdict(rows, summary) if rows else {},
                "claims": claims(rows) if rows else {}, "screen": screens, "rows": rows,
                "seconds": round(time.perf_counter() - t0, 1), "loadavg_end": os.getloadavg()}

    for case in candidates:
        if sum(s.get("counted", False) for s in screens) >= want:
            break
        screens.append(screen(model, case, reasoning_tokens, answer_tokens, cut))
        s = screens[-1]
        log(f"[{len(screens)}] {case.name} {case.old!r}->{case.new!r}: {s['outcome']} "
            f"({s.get('before')!r} -> {s.get('after')!r}; {time.perf_counter() - t0:.0f} s)")
        if s["outcome"] == "deciding":
            case_rows = evaluate_case(model, case, ["cached_reasoning"], budgets, answer_tokens,
                                      s["reasoning_tokens"], 0, log)
            s["counted"] = decided(case_rows)
            rows += case_rows if s["counted"] else []
            if on_case is not None:
                on_case(record())
    return record()


def merge(records: list[dict]) -> dict:
    """One record from runs of one model and one set of settings over disjoint candidates (--first): screens
    and rows together, summary, verdict and claims computed again."""
    from kvtool.bench.edit import summarize, verdict

    keys = ("model", "dtype", "budgets", "answer_tokens", "reasoning_tokens", "cut")
    differ = [k for rec in records[1:] for k in keys if rec.get(k) != records[0].get(k)]
    if differ:
        raise ValueError(f"cannot merge records that differ in {sorted(set(differ))}")
    screens = [s for rec in records for s in rec["screen"]]
    if len({s["case"] for s in screens}) != len(screens):
        raise ValueError("the records screened a candidate twice; merge runs over disjoint --first ranges")
    rows = [r for rec in records for r in rec["rows"]]
    summary = summarize(rows)
    return {**records[0], "cases": sum(rec["cases"] for rec in records), "screen": screens, "rows": rows,
            "candidates_screened": len(screens), "summary": summary, "verdict": verdict(rows, summary),
            "claims": claims(rows), "merged_from": [rec.get("config", {}).get("first") for rec in records],
            "seconds": max(rec["seconds"] for rec in records), "partial": any(rec.get("partial") for rec in records)}


def main(argv=None) -> int:
    from kvtool.bench.edit import DEFAULT_BUDGETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen25", "gemma3"])
    ap.add_argument("--want", type=int, default=25, help="deciding cases to count")
    ap.add_argument("--candidates", type=int, default=240, help="most candidates to screen")
    ap.add_argument("--first", type=int, default=0, help="skip the generator's first N candidates (split runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=None, help="scenario kinds or groups, comma-separated (default: all): "
                    + ", ".join([*GROUPS, *(sc.kind for sc in SCENARIOS)]))
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in DEFAULT_BUDGETS))
    ap.add_argument("--reasoning-tokens", type=int, default=24, help="most greedy reasoning tokens cached")
    ap.add_argument("--no-cut", action="store_true", help="cache all --reasoning-tokens, not only those before "
                                                          "the reasoning first names an answer or a value")
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out")
    ap.add_argument("--merge", nargs="+", metavar="RECORD", help="join the records of split runs into --out")
    args = ap.parse_args(argv)
    import json

    if args.merge:
        from common import emit

        emit(merge([json.loads(Path(p).read_text()) for p in args.merge]), args.out)
        return 0

    import torch

    from common import emit, versions
    from kvtool.bench.loading import load_bench_model

    torch.set_num_threads(args.threads)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    kinds = args.kinds.split(",") if args.kinds else None
    candidates = generate(args.seed, args.first + args.candidates, kinds)[args.first:]
    meta = {"config": vars(args), "claim": CLAIM, "loadavg_start": os.getloadavg(), "versions": versions(),
            "command": " ".join([f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", "python", *sys.argv])}
    bm = load_bench_model(args.model, announce=log)

    def partial(rec: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps({**meta, **rec, "partial": True}, indent=1) + "\n")

    record = run(bm.model, candidates, args.want, budgets, args.reasoning_tokens, args.answer_tokens, not args.no_cut,
                 partial)
    record = {**meta, **record, "device": str(bm.device), "threads": torch.get_num_threads()}
    one = record["claims"].get("one_percent")
    log(f"{record['cases']} deciding cases of {record['candidates_screened']} screened; "
        f"1 % claim: {'holds' if one and one['holds'] else 'does not hold'} {one and one['checks']}")
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
