"""Where a skill block is compiled: the tokens prefilled before it (the spec is parsed in kvtool.skill_settings).

- conversation: the turn's own conversation head (for the tool rendering, the user's request and the
  assistant's Skill call); the block starts a few dozen positions in.
- none: nothing; the block starts at position 0, so its first token becomes an attention sink.
- deep (tokens, default 2048): a system turn of generic agent instructions (context.md, repeated and cut
  to `tokens` tokens), then the conversation head. In a real context a skill is loaded after a system
  prompt, tools and earlier turns, often thousands of tokens in, and a token's upper-layer KV depends on
  how much context it attended to, not only on what: attention spread over 2,000 earlier tokens mixes
  differently from attention over 50. Compiled at such a depth, the block's KV is closer to what a full
  prefill computes there, whatever the context is. Four skills loaded after a 260-token prefix, KL
  against full prefill over 32 greedy steps (benchmarks/results/skills-cpu-*.json): SmolLM2 0.0207 to
  0.0059 with recompute_first_k:k=48; Qwen2.5 0.0364 to 0.0195 with recompute_attended:ratio=0.1, but
  0.0289 to 0.0399 with recompute_first_k:k=48.
The preamble is fixed per setup key (kvtool.skills.catalog), so blocks of one catalog share it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from kvtool.errors import KvtoolError
from kvtool.skill_settings import parse_preamble

CONTEXT_FILE = Path(__file__).with_name("context.md")
@lru_cache(maxsize=1)
def context_text() -> str:
    return CONTEXT_FILE.read_text(encoding="utf-8")


def _generic_system(model, tokens: int) -> str:
    """context.md repeated to at least `tokens` tokens, then cut back to `tokens`."""
    text = context_text()
    ids = model.encode_rendered(text)
    reps = -(-tokens // max(1, len(ids)))
    return model.decode((model.encode_rendered("\n\n".join([text] * reps)))[:tokens]).strip()


def preamble_ids(model, skill, rendered, spec: str) -> tuple[list[int], int]:
    """The ids to prefill before the skill's turn, and how many of them lead every skill compiled with this
    preamble (their KV can be computed once for a catalog)."""
    from kvtool.skills.render import RENDER_MODES

    name, tokens = parse_preamble(spec)
    if name == "none":
        return [], 0
    tokens = min(tokens, model.runner.spec.max_position - len(rendered.head_ids) - len(rendered.ids) - 16)
    if name == "conversation" or tokens < 1:  # a window too small for depth keeps the conversation head
        return list(rendered.head_ids), 0
    base, turns = RENDER_MODES[rendered.mode](skill)
    system = [{"role": "system", "content": _generic_system(model, tokens)}]
    shared_text = model.render(system, add_generation_prompt=False)
    head = model.render(system + base, add_generation_prompt=False)
    full = model.render(system + base + turns, add_generation_prompt=False)
    shared, ids = model.encode_rendered(shared_text), model.encode_rendered(head)
    if not head.startswith(shared_text) or full != head + rendered.text or ids[:len(shared)] != shared:
        raise KvtoolError(f"the chat template of {model.name} renders the skill {skill.name!r} differently after a "
                          "system turn, so it cannot be compiled deep in a conversation; use the preamble "
                          "'conversation'")
    return ids, len(shared)
