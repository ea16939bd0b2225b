"""Realistic eval contexts: [system prompt + user task]([Skill call][skill result])...[user query + assistant start]."""

from __future__ import annotations

from kvtool.errors import KvtoolError
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


def _prefix_messages(model, prefix_tokens: int, listing: str) -> list[dict]:
    """System prompt (+ the catalog listing, padded with FILLER to ~prefix_tokens) and the user's task."""
    system = SYSTEM + (f"\n\nAvailable skills:\n{listing}" if listing else "")
    for i in range(201):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": TASK}]
        if i == 200 or len(model.encode_chat(messages, add_generation_prompt=False)) >= prefix_tokens:
            return messages
        system += " " + FILLER[i % len(FILLER)]


def build_case(model, catalog, names: list[str], prefix_tokens: int = 256, query: str = QUERY,
               more_queries: list[str] = ()) -> EvalCase:
    """The conversation an agent has after loading skills `names` one by one: the prefix (system prompt with
    the catalog listing + user task, ~prefix_tokens), then per skill the assistant's Skill call (a gap) and
    its result (the block), then the user's query and the assistant start. The whole conversation is
    rendered by the chat template and cut where the blocks' exact ids are, as the server splices them."""
    messages = _prefix_messages(model, prefix_tokens, catalog.listing())
    prefix = model.encode_chat(messages, add_generation_prompt=False)
    for name in names:
        messages = messages + catalog.messages(name)

    def cut(question: str) -> tuple[list[list[int]], list[int]]:
        ids = model.encode_chat(messages + [{"role": "user", "content": question}], add_generation_prompt=True)
        found = catalog.find(ids, len(prefix))
        if ids[:len(prefix)] != prefix or [m.name for m, _ in found] != list(names):
            raise KvtoolError(f"the chat template of {model.name} does not render the skills {list(names)} "
                              "verbatim inside a conversation, so no block can be spliced; nothing to evaluate")
        ends = [len(prefix)] + [m.end for m, _ in found]
        return [ids[a:m.start] for a, (m, _) in zip(ends, found)], ids[ends[-1]:]

    gaps, first = cut(query)
    rest = [cut(q)[1] for q in more_queries]
    return EvalCase(prefix, [catalog.block(n) for n in names], first, rest, gaps)


EVAL_PREAMBLES = ("conversation", "deep:tokens=2048")  # the former default beside the current one


def catalog_case(model, folder, blocks: int = 4, prefix_tokens: int = 256, queries: int = 1,
                 preambles=EVAL_PREAMBLES, cache_dir=None, log=print):
    """The first `blocks` skills of `folder` (by name) compiled once per preamble, and the case they are
    loaded in: (case, {preamble: blocks}, catalog). The case holds the first preamble's blocks."""
    from kvtool.skill_settings import canonical_preamble
    from kvtool.skills.catalog import load_catalog

    preambles = list(dict.fromkeys(canonical_preamble(p) for p in preambles))
    catalogs = {p: load_catalog(folder, model, cache_dir=cache_dir, preamble=p, log=log) for p in preambles}
    catalog = catalogs[preambles[0]]
    names = catalog.names()[:blocks]
    if len(names) < blocks:
        log(f"kvtool: only {len(names)} skills in {folder}; evaluating with {len(names)} blocks")
    case = build_case(model, catalog, names, prefix_tokens, more_queries=MORE_QUERIES[: max(0, queries - 1)])
    return case, {p: [c.block(n) for n in names] for p, c in catalogs.items()}, catalog


def run_skill_eval(model, folder, blocks: int = 4, prefix_tokens: int = 256, repairs=None, n_greedy: int = 32,
                   queries: int = 1, repeats: int = 1, scaling=(1, 2, 4), scaling_repairs=("none",),
                   preambles=EVAL_PREAMBLES, cache_dir=None, log=print) -> dict:
    """The whole `kvtool skill eval`: compile/load the catalog per preamble, build the case, sweep repairs on
    each, time scaling."""
    from kvtool.skills.evaluate import DEFAULT_SWEEP, evaluate, ttft_scaling

    case, variants, catalog = catalog_case(model, folder, blocks, prefix_tokens, queries, preambles, cache_dir, log)
    record = evaluate(model.runner, case, repairs or DEFAULT_SWEEP, n_greedy=n_greedy, repeats=repeats, log=log,
                      variants=variants)
    counts = sorted({c for c in scaling if 0 < c <= len(case.blocks)})
    if counts:
        log("TTFT vs total block tokens")
        record["ttft_scaling"] = ttft_scaling(model.runner, case, counts, scaling_repairs, repeats=1,
                                               known_full={len(case.blocks): record["ttft_ms_full"]}, log=log)
    record["model"] = model.name
    record["setup"] = {k: v for k, v in catalog.setup.items()}
    return record
