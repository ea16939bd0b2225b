"""Render a skill exactly as it appears in context: whole chat turns, cut out of the chat template.

The "tool" mode's block is the assistant's Skill call and the tool turn that answers it, so skills loaded one
after another are adjacent blocks with no text between them (an engine that only supplies a prompt's prefix,
as vLLM's KV connector does, can place them all). A turn starts with a special token (`<|im_start|>`) and is
followed by one, so BPE merges cannot cross its edges and the prompt's tokenization contains the block's ids
verbatim. `boundary_safe` records whether that held for this model's tokenizer (checked, not assumed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

from kvtool.errors import KvtoolError
from kvtool.skills.skillfile import Skill


@dataclass(frozen=True)
class RenderedSkill:
    name: str
    mode: str
    text: str  # the turn, verbatim
    ids: list[int]
    head_ids: list[int]  # the conversation before the turn: the canonical preamble
    boundary_safe: bool

    @property
    def text_sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def _tool_turn(skill: Skill) -> tuple[list[dict], list[dict]]:
    """The assistant's Skill tool call, then the tool message with the instructions."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "Skill", "arguments": {"name": skill.name}}}]}
    return [{"role": "user", "content": f"Use the {skill.name} skill."}], [call, {"role": "tool",
                                                                                   "content": skill.content}]


def _user_turn(skill: Skill) -> tuple[list[dict], list[dict]]:
    base = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello! How can I help?"}]
    return base, [{"role": "user", "content": skill.content}]


# mode -> (conversation before the block, the block's turns). Feeds the CLI's --render choices.
RENDER_MODES: dict[str, Callable[[Skill], tuple[list[dict], list[dict]]]] = {"tool": _tool_turn, "user": _user_turn}


def skill_messages(skill: Skill, mode: str = "tool") -> list[dict]:
    """Messages to add to a conversation so that it contains this skill's block (for explicit requests): for
    "tool" the assistant's Skill call plus its result, for "user" the user turn."""
    return _render_fn(mode)(skill)[1]


def _render_fn(mode: str):
    if mode not in RENDER_MODES:
        raise KvtoolError(f"unknown skill render mode {mode!r}; use one of {', '.join(RENDER_MODES)}")
    return RENDER_MODES[mode]


def render_skill(model, skill: Skill, mode: str = "tool") -> RenderedSkill:
    """Cut the skill's block (its turns) out of the model's chat template; tokenize it and its preamble."""
    base, turns = _render_fn(mode)(skill)
    if not model.chat_template:
        raise KvtoolError(f"model {model.name} has no chat template; skills are rendered as chat turns")
    head = model.render(base, add_generation_prompt=False)
    full = model.render(base + turns, add_generation_prompt=False)
    if not full.startswith(head):
        raise KvtoolError(f"the chat template of {model.name} re-renders earlier turns when a {mode!r} turn is "
                          f"added, so the skill {skill.name!r} has no fixed text; try --render user")
    text = full[len(head):]
    ids, head_ids = model.encode_rendered(text), model.encode_rendered(head)
    after = model.render(base + turns, add_generation_prompt=True)[len(full):]
    safe = model.encode_rendered(head + text + after) == head_ids + ids + model.encode_rendered(after)
    return RenderedSkill(skill.name, mode, text, ids, head_ids, safe)
