"""The Skill tool: progressive disclosure of a skills folder, shaped so kvtool serve splices it.

The system prompt lists each skill's name and description; the model calls `Skill` with a
name to load the instructions. The result is the skill's exact `<skill name=...>` text, not
fenced as external content (skill instructions are the operator's, not outside data), so the
tool turn renders to the same tokens as the skill's compiled block and `kvtool serve --skills`
with the same folder serves it from the block instead of prefilling it.
"""

from __future__ import annotations

from pathlib import Path

from kvtool.agent.output import Rendered
from kvtool.agent.retry import ToolInputError
from kvtool.agent.tools import Tier, Tool
from kvtool.skills.skillfile import Skill, read_skills

SKILL_TOOL = "Skill"


def skills_prompt(skills: list[Skill]) -> str:
    """The system-prompt paragraph that tells the model which skills exist."""
    listing = "\n".join(f"- {s.name}: {s.description}" for s in sorted(skills, key=lambda s: s.name))
    return (f"Skills hold detailed instructions for specific tasks. Before doing such a task, call the "
            f"{SKILL_TOOL} tool with the skill's name to load them.\nAvailable skills:\n{listing}")


def skill_tool(folder: str | Path) -> tuple[Tool, str]:
    """(the Skill tool over every skill in `folder`, the system-prompt paragraph listing them)."""
    skills = {s.name: s for s in read_skills(folder)}

    def load_skill(name: str) -> Rendered:
        if name not in skills:
            raise ToolInputError(f"no skill named {name!r}; available: {', '.join(sorted(skills))}")
        return Rendered(skills[name].content)

    tool = Tool(SKILL_TOOL, "Load the instructions of a skill by name (see the list of skills).",
                {"type": "object", "properties": {"name": {"type": "string", "enum": sorted(skills)}},
                 "required": ["name"]},
                load_skill, tier=Tier.READ_ONLY)
    return tool, skills_prompt(list(skills.values()))
