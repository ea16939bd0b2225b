"""Realistic eval contexts: [system prompt + user task][skill turns...][user query + assistant start]."""

from __future__ import annotations

from kvtool.skills.evaluate import EvalCase

SYSTEM = ("You are a careful coding agent working in a Python repository on the user's machine. You can read and "
          "write files, run shell commands and load skills. A skill is a set of instructions for one kind of task; "
          "load it with the Skill tool when the task needs it and follow it exactly.")
FILLER = ["Keep answers short and concrete.", "Prefer small, reviewable changes over large rewrites.",
          "Never invent file names; list the directory first.", "Run the tests after every change you make.",
          "Explain what you changed and why in two or three sentences.", "Ask before deleting anything.",
          "Quote exact error messages when you report a failure.", "Use the project's existing style and tools."]
TASK = "I have a few things to do in this repository today. Load the skills you need, then help me."
QUERY = ("Using the skills you just loaded, what is the very first thing you should do for my request: "
         "turn the quarterly report PDF into a spreadsheet and then summarise the changes in a commit message? "
         "Answer in one short paragraph, and name the skill you would follow first.")
MORE_QUERIES = [
    "I am about to commit my changes to the parser and its tests. Following the skills you loaded, which commands "
    "should I run first, and what should the subject line of the commit message look like? Keep it brief.",
    "A colleague opened a pull request that changes how we parse dates in the billing module. Following the code "
    "review skill, list the first three things you would check, in order, and say why each one matters.",
    "I need a spreadsheet with monthly totals and a bar chart, built from a CSV export. According to the "
    "spreadsheet skill, which library should write the file, and how should derived values such as totals be written?",
]


def _turn_text(model, before: list[dict], turn: dict, generation_prompt: bool) -> str:
    head = model.render(before, add_generation_prompt=False)
    return model.render(before + [turn], add_generation_prompt=generation_prompt)[len(head):]


def build_case(model, blocks, prefix_tokens: int = 256, query: str = QUERY, listing: str = "",
               more_queries: list[str] = ()) -> EvalCase:
    """Prefix ~prefix_tokens (system prompt + catalog listing + padding + user task), blocks, then the query."""
    system = SYSTEM + (f"\n\nAvailable skills:\n{listing}" if listing else "")
    i = 0
    while True:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": TASK}]
        prefix = model.encode(model.render(messages, add_generation_prompt=False))
        if len(prefix) >= prefix_tokens or i >= 200:
            break
        system += " " + FILLER[i % len(FILLER)]
        i += 1
    encode = lambda q: model.encode(_turn_text(model, messages, {"role": "user", "content": q}, True))  # noqa: E731
    return EvalCase(prefix, list(blocks), encode(query), [encode(q) for q in more_queries])


def run_skill_eval(model, folder, blocks: int = 4, prefix_tokens: int = 256, repairs=None, n_greedy: int = 32,
                   queries: int = 1,
                   repeats: int = 1, scaling=(1, 2, 4), scaling_repairs=("none",),
                   cache_dir=None, log=print) -> dict:
    """The whole `kvtool skill eval`: compile/load the catalog, build the case, sweep repairs, time scaling."""
    from kvtool.skills.catalog import load_catalog
    from kvtool.skills.evaluate import DEFAULT_SWEEP, evaluate, ttft_scaling

    catalog = load_catalog(folder, model, cache_dir=cache_dir, log=log)
    names = catalog.names()[:blocks]
    if len(names) < blocks:
        log(f"kvtool: only {len(names)} skills in {folder}; evaluating with {len(names)} blocks")
    case = build_case(model, [catalog.block(n) for n in names], prefix_tokens, listing=catalog.listing(),
                      more_queries=MORE_QUERIES[: max(0, queries - 1)])
    record = evaluate(model.runner, case, repairs or DEFAULT_SWEEP, n_greedy=n_greedy, repeats=repeats, log=log)
    counts = sorted({c for c in scaling if 0 < c <= len(names)})
    if counts:
        log("TTFT vs total block tokens")
        record["ttft_scaling"] = ttft_scaling(model.runner, case, counts, scaling_repairs, repeats=1,
                                               known_full={len(names): record["ttft_ms_full"]}, log=log)
    record["model"] = model.name
    record["setup"] = {k: v for k, v in catalog.setup.items()}
    return record
