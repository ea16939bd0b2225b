"""A library of long skills written like real SKILL.md files, and requests that load several of them.

Each skill documents one fictional operations tool: when to use it, a numbered procedure with commands, a table of
error codes, limits as `key: value` lines and a Python example. Everything comes from one seed, so the same seed
gives the same text on every machine; the facts each skill holds (an error code's action, a port, a retry limit)
are kept beside it so that a question can name one fact and its expected answer. Pure Python.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtool.skills.render import skill_messages
from kvtool.skills.skillfile import Skill, parse_skill

TOPICS = ("invoice-reconcile", "sensor-calibration", "release-rollback", "schema-migration", "incident-triage",
          "cache-warmup", "log-retention", "access-review", "backup-restore", "quota-planning", "api-deprecation",
          "data-export", "cert-rotation", "queue-drain", "cost-report", "feature-flags")
VERBS = ("check", "validate", "sync", "render", "export", "import", "lock", "unlock", "drain", "rotate", "snapshot",
         "compare", "archive", "notify", "retry", "pause", "resume", "tag", "scan", "promote")
OBJECTS = ("ledger", "manifest", "batch", "shard", "replica", "bucket", "ticket", "window", "queue", "report",
           "snapshot", "index", "channel", "segment", "policy", "bundle")
MEANINGS = ("the upstream service timed out", "the checksum of the {o} does not match", "a lock on the {o} is held",
            "the {o} is older than the retention window", "the credentials for the {o} expired",
            "the {o} is larger than the batch limit", "a replica of the {o} is missing", "the {o} was already "
            "processed", "the schema version of the {o} is unknown", "the quota for the {o} is exhausted")
ACTIONS = ("wait {n} minutes and run step {s} again", "page the {team} on-call and stop", "release the lock with "
           "`{tool} unlock --force` and restart from step {s}", "re-import the {o} from the last snapshot",
           "rotate the credentials, then resume at step {s}", "split the {o} into {n} parts and retry each",
           "mark the {o} as skipped and continue", "open a ticket for the {team} with the full log",
           "roll back to the previous {o} and notify the {team}", "run `{tool} repair --{o}` and check again")
TEAMS = ("platform team", "finance team", "data team", "security team", "storage team", "release team")
SENTENCES = ("Keep the output of every command in the run log; reviewers read it before they approve.",
             "Never run two instances of {tool} against the same {o} at once.",
             "Each step is idempotent, so a step that failed half-way can simply be run again.",
             "The {team} owns {tool} and reviews changes to this procedure every quarter.",
             "Work on a copy of the {o} first when the change touches more than one region.",
             "If anything in this procedure disagrees with a runbook, this procedure wins.")


@dataclass(frozen=True)
class Fact:
    question: str  # asked after the skills are loaded; names the skill
    answer: str  # a short string the right answer contains


@dataclass(frozen=True)
class LibrarySkill:
    skill: Skill
    facts: tuple[Fact, ...]

    @property
    def text(self) -> str:
        return f"---\nname: {self.skill.name}\ndescription: {self.skill.description}\n---\n{self.skill.body}\n"


def _skill(rng: random.Random, name: str, rows: int, steps: int) -> LibrarySkill:
    tool = name.split("-")[0] + "ctl"
    team, port, retries = rng.choice(TEAMS), rng.randrange(7000, 9900), rng.randint(2, 9)
    timeout, batch = rng.choice((15, 30, 45, 60, 90, 120)), rng.choice((100, 250, 500, 1000, 5000))
    fill = {"tool": tool, "team": team}

    def say(template: str) -> str:
        return template.format(o=rng.choice(OBJECTS), n=rng.randint(2, 12), s=rng.randint(1, steps), **fill)

    title = name.replace("-", " ").capitalize()
    lines = [f"# {title}", "", f"Use this skill for every {name.replace('-', ' ')} task. It drives `{tool}`, which "
             f"listens on port {port}. {say(rng.choice(SENTENCES))} {say(rng.choice(SENTENCES))}", "",
             "## When to use", *(f"- The user asks to {rng.choice(VERBS)} a {rng.choice(OBJECTS)} of the "
                                  f"{rng.choice(OBJECTS)} service." for _ in range(4)), "", "## Procedure"]
    for s in range(1, steps + 1):
        verb, obj = rng.choice(VERBS), rng.choice(OBJECTS)
        lines.append(f"{s}. Run `{tool} {verb} --{obj} $ID --timeout {timeout}` and {say(rng.choice(ACTIONS))} "
                     f"if it fails. {say(rng.choice(SENTENCES))}")
    lines += ["", "## Error codes", "", "| code | meaning | action |", "|---|---|---|"]
    prefix, codes, facts = "".join(w[0] for w in name.split("-")).upper(), set(), []
    while len(codes) < rows:
        codes.add(rng.randrange(1000, 9999))
    for code in sorted(codes):
        action = say(rng.choice(ACTIONS))
        lines.append(f"| {prefix}-{code} | {say(rng.choice(MEANINGS))} | {action} |")
        if len(facts) < 3 and rng.random() < 0.3:
            facts.append(Fact(f"According to the {name} skill, what must be done on error {prefix}-{code}?",
                              action))
    lines += ["", "## Limits", f"- port: {port}", f"- retries: {retries}", f"- timeout: {timeout} seconds",
              f"- batch size: {batch}", f"- owner: the {team}", "", "## Example", "", "```python",
              "import subprocess", "", f"def run_{name.replace('-', '_')}(item_id: str) -> str:",
              f"    for attempt in range({retries}):",
              f"        done = subprocess.run([\"{tool}\", \"check\", \"--id\", item_id, \"--port\", \"{port}\"],",
              f"                              capture_output=True, text=True, timeout={timeout})",
              "        if done.returncode == 0:", "            return done.stdout",
              f"    raise RuntimeError(f\"{tool} failed {retries} times for {{item_id}}\")", "```", "",
              "## Checklist", *(f"- [ ] {say(rng.choice(SENTENCES))}" for _ in range(3))]
    facts += [Fact(f"According to the {name} skill, which port does {tool} listen on?", str(port)),
              Fact(f"According to the {name} skill, how many retries are allowed?", str(retries))]
    description = f"Run {name.replace('-', ' ')} with {tool} (procedure, error codes, limits)."
    skill = parse_skill(f"---\nname: {name}\ndescription: {description}\n---\n" + "\n".join(lines) + "\n",
                        f"<library:{name}>")
    return LibrarySkill(skill, tuple(facts))


def library(seed: int = 0, count: int = 16) -> list[LibrarySkill]:
    """`count` skills (at most len(TOPICS)) whose sizes spread evenly over about 1,000 to 3,000 tokens."""
    if not 1 <= count <= len(TOPICS):
        raise ValueError(f"count must be in [1, {len(TOPICS)}]; got {count}")
    rng, out = random.Random(seed), []
    for i, name in enumerate(TOPICS[:count]):
        share = i / max(count - 1, 1)  # a row of the error table is ~32 tokens, a step ~45
        out.append(_skill(rng, name, rows=int(14 + 38 * share), steps=int(6 + 10 * share)))
    return out


@dataclass(frozen=True)
class SkillRequest:
    skills: tuple[str, ...]  # loaded in this order
    target: str  # the skill the question is about
    fact: Fact


def requests(skills: list[LibrarySkill], n: int, seed: int = 0, least: int = 2, most: int = 4) -> list[SkillRequest]:
    """n requests, each loading `least`..`most` skills in random order and asking about one of them."""
    rng, by_name = random.Random(seed), {s.skill.name: s for s in skills}
    out = []
    for _ in range(n):
        names = tuple(rng.sample(sorted(by_name), rng.randint(least, min(most, len(by_name)))))
        target = rng.choice(names)
        out.append(SkillRequest(names, target, rng.choice(by_name[target].facts)))
    return out


SYSTEM = ("You are the operations assistant of a small platform team. Load the skills a task needs and follow "
          "them exactly. Answer in one or two sentences, quoting the skill's own values.")


def messages(request: SkillRequest, skills: list[LibrarySkill], render: str = "tool",
             system: str = SYSTEM) -> list[dict]:
    """The chat: the shared system prompt, the user's task, each skill loaded as the server splices it, the question."""
    by_name = {s.skill.name: s.skill for s in skills}
    out = [{"role": "system", "content": system}, {"role": "user", "content": "Load the skills this task needs."}]
    for name in request.skills:
        out += skill_messages(by_name[name], render)
    return out + [{"role": "user", "content": request.fact.question}]


def write_library(folder, skills: list[LibrarySkill]) -> list[str]:
    """Each skill as `folder/NAME/SKILL.md` (the layout `kvtool serve --skills` reads); returns the paths."""
    from pathlib import Path

    out = []
    for s in skills:
        path = Path(folder) / s.skill.name / "SKILL.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(s.text, encoding="utf-8")
        out.append(str(path))
    return out
