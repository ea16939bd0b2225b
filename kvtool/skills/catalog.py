"""SkillCatalog: a directory of skills compiled for one model, blocks held on the model's device.

load_catalog() compiles each skill once and keeps its .kvb under
`<cache_dir>/<setup key>/<name>-<text hash>.kvb` (cache_dir defaults to ~/.cache/kvtool/skills,
KVTOOL_CACHE moves it); the setup key hashes the model fingerprint, RoPE, render mode and
preamble, so a block is never reused across models, dtypes or renderings.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvtool.config import EngineConfig
from kvtool.errors import CacheFormatError
from kvtool.skill_settings import canonical_preamble
from kvtool.skills.block import SkillBlock, compile_ids, load_block, save_block, setup_of
from kvtool.skills.match import BlockIndex, Match
from kvtool.skills.preamble import preamble_ids
from kvtool.skills.render import render_skill, skill_messages
from kvtool.skills.skillfile import Skill, read_skill, read_skills
from kvtool.version import __version__

DEFAULT_PREAMBLE = EngineConfig.skill_preamble  # kvtool.skills.preamble: what a block is compiled after


def preamble_sha256(pre: list[int]) -> str:
    return hashlib.sha256(json.dumps(pre).encode()).hexdigest()


def compile_skill(model, skill: Skill | str | Path, render: str = "tool", preamble: str = DEFAULT_PREAMBLE,
                  rendered=None, shared_kv: dict | None = None, pre: tuple[list[int], int] | None = None) -> SkillBlock:
    """Render the skill as a chat turn and prefill it once after its canonical preamble. `shared_kv` (a dict,
    filled here) keeps the KV of the preamble's part that every skill shares, for the next skill; `pre`:
    preamble_ids() already computed for this skill."""
    preamble = canonical_preamble(preamble)
    skill = skill if isinstance(skill, Skill) else read_skill(skill)
    rendered = rendered or render_skill(model, skill, render)
    pre, n_shared = pre or preamble_ids(model, skill, rendered, preamble)
    warm = None
    if n_shared and shared_kv is not None:
        key = tuple(pre[:n_shared])
        if key not in shared_kv:
            shared_kv.clear()
            shared_kv[key] = model.runner.new_cache(n_shared + 1)
            model.runner.prefill(list(key), shared_kv[key], logits="none")
        warm = shared_kv[key]
    meta = {"description": skill.description, "text": rendered.text, "text_sha256": rendered.text_sha256,
            "render": render, "preamble": preamble,
            "preamble_sha256": preamble_sha256(pre),
            "boundary_safe": str(rendered.boundary_safe).lower(), "source_sha256": skill.source_sha256,
            "source": skill.path, "kvtool_version": __version__}
    return compile_ids(model.runner, rendered.ids, setup_of(model), skill.name, pre, meta, warm=warm)


def setup_key(setup: dict, render: str, preamble: str) -> str:
    blob = json.dumps({"setup": setup, "render": render, "preamble": preamble}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    from kvtool.paths import cache_root

    return cache_root() / "skills"


@dataclass
class SkillCatalog:
    setup: dict[str, str]
    render: str = "tool"
    skills: dict[str, Skill] = field(default_factory=dict)
    blocks: dict[str, SkillBlock] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)
    index: BlockIndex = field(default_factory=BlockIndex)
    sizes: dict[str, int] = field(default_factory=dict)  # each block's KV bytes, kept when without_kv drops the KV

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, name: str) -> bool:
        return name in self.blocks

    def names(self) -> list[str]:
        return sorted(self.blocks)

    def add(self, skill: Skill, block: SkillBlock, path: Path | None = None) -> None:
        self.skills[skill.name], self.blocks[skill.name] = skill, block
        if path is not None:
            self.paths[skill.name] = path
        self.index.add(skill.name, block.token_ids)

    def find(self, prompt_ids, start: int = 0) -> list[tuple[Match, SkillBlock]]:
        """Blocks whose exact ids occur in the prompt at or after `start`, left to right."""
        return [(m, self.blocks[m.name]) for m in self.index.find(prompt_ids, start)]

    def block(self, name: str) -> SkillBlock:
        if name not in self.blocks:
            raise KeyError(f"no skill {name!r} in the catalog; known: {', '.join(self.names()) or 'none'}")
        return self.blocks[name]

    def messages(self, name: str) -> list[dict]:
        """Chat messages that load skill `name` explicitly (Skill call + result); their rendering is the block."""
        self.block(name)
        return skill_messages(self.skills[name], self.render)

    def listing(self) -> str:
        """Names and descriptions for the system prompt (progressive disclosure: bodies load on demand)."""
        return "\n".join(f"- {s.name}: {s.description}" for s in sorted(self.skills.values(), key=lambda s: s.name))

    def summary(self) -> list[dict]:
        return [{"name": n, "tokens": len(self.blocks[n]), "description": self.skills[n].description,
                 "bytes": self.sizes.get(n, self.blocks[n].nbytes), "file": str(self.paths.get(n, ""))}
                for n in self.names()]

    def without_kv(self) -> "SkillCatalog":
        """This catalog with its blocks' KV released (another engine reads the .kvb files); names, token ids and
        sizes stay for listing and matching."""
        for name, block in self.blocks.items():
            self.sizes[name] = block.nbytes
            empty = (*block.keys.shape[:2], 0, block.keys.shape[3])
            block.keys, block.values = block.keys.new_empty(empty), block.values.new_empty(empty)
        return self


def load_catalog(folder: str | Path, model, cache_dir: str | Path | None = None, render: str = "tool",
                 preamble: str = DEFAULT_PREAMBLE, log: Callable[[str], None] | None = None) -> SkillCatalog:
    """Every skill in `folder`, compiled for `model` (or loaded from the cache dir when up to date)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    preamble, shared_kv = canonical_preamble(preamble), {}
    setup = setup_of(model)
    where = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    where = where / setup_key(setup, render, preamble)
    catalog = SkillCatalog(setup, render)
    for skill in read_skills(folder):
        rendered = render_skill(model, skill, render)
        pre = preamble_ids(model, skill, rendered, preamble)
        path = where / f"{skill.name}-{rendered.text_sha256[:12]}.kvb"
        block = None
        if path.is_file():
            try:
                block = load_block(path, model.runner.device, expected_setup=setup)
                if (block.token_ids != rendered.ids or block.meta.get("preamble") != preamble
                        or block.meta.get("preamble_sha256") != preamble_sha256(pre[0])):
                    block = None
            except CacheFormatError as exc:
                log(f"kvtool: recompiling skill {skill.name!r}: {exc}")
        if block is None:
            if not rendered.boundary_safe:
                log(f"kvtool: warning: skill {skill.name!r} tokenizes differently inside a conversation; "
                    "prompts will not contain its block's exact ids, so it will be prefilled, not spliced")
            block = compile_skill(model, skill, render, preamble, rendered=rendered, shared_kv=shared_kv, pre=pre)
            save_block(block, path)
            log(f"kvtool: compiled skill {skill.name!r} ({len(block)} tokens) -> {path}")
        catalog.add(skill, block, path)
    return catalog
