"""SKILL.md files: YAML frontmatter (`name`, `description`) and a Markdown body. Pure Python.

A skills directory holds `NAME/SKILL.md` folders (the Anthropic layout) and/or `*.md` files.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvtool.errors import KvtoolError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class SkillFileError(KvtoolError):
    """A SKILL.md file is missing, unreadable or lacks valid frontmatter."""


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    body: str  # Markdown after the frontmatter, stripped
    path: str = ""

    @property
    def content(self) -> str:
        """What the Skill tool returns: this text is what a block's KV encodes."""
        return f'<skill name="{self.name}">\n{self.body}\n</skill>'

    @property
    def source_sha256(self) -> str:
        return hashlib.sha256(f"{self.name}\n{self.description}\n{self.body}".encode()).hexdigest()


def parse_skill(text: str, path: str = "<string>") -> Skill:
    """Parse SKILL.md text; SkillFileError names `path` and what is wrong."""
    if not text.startswith("---"):
        raise SkillFileError(f"{path}: missing YAML frontmatter; a SKILL.md starts with '---', then "
                             f"'name: ...' and 'description: ...', then '---'")
    parts = text.split("\n")
    try:
        end = next(i for i in range(1, len(parts)) if parts[i].strip() == "---")
    except StopIteration:
        raise SkillFileError(f"{path}: the frontmatter is not closed by a '---' line") from None
    try:
        meta = yaml.safe_load("\n".join(parts[1:end])) or {}
    except yaml.YAMLError as exc:  # one line: YAML's own message spans several, with a caret under the spot
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 2}, column {mark.column + 1}" if mark is not None else ""
        why = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise SkillFileError(f"{path}: the frontmatter is not valid YAML: {why}{where}") from None
    if not isinstance(meta, dict):
        raise SkillFileError(f"{path}: the frontmatter must be a YAML mapping with name and description")
    missing = [k for k in ("name", "description") if not str(meta.get(k) or "").strip()]
    if missing:
        raise SkillFileError(f"{path}: the frontmatter lacks {' and '.join(missing)}")
    name = str(meta["name"]).strip()
    if not NAME_RE.match(name):
        raise SkillFileError(f"{path}: skill name {name!r} must be 1-64 letters, digits, '_', '-' or '.'")
    body = "\n".join(parts[end + 1:]).strip()
    if not body:
        raise SkillFileError(f"{path}: the skill {name!r} has no instructions after the frontmatter")
    return Skill(name=name, description=" ".join(str(meta["description"]).split()), body=body, path=path)


def read_skill(path: str | Path) -> Skill:
    path = Path(path)
    if path.is_dir():
        path = path / "SKILL.md"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SkillFileError(f"{path}: cannot read the skill file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SkillFileError(f"{path}: not UTF-8 text") from None
    return parse_skill(text, str(path))


def skill_files(folder: str | Path) -> list[Path]:
    """SKILL.md files of a skills directory, sorted: NAME/SKILL.md folders, then loose *.md files."""
    folder = Path(folder)
    if not folder.exists():
        raise SkillFileError(f"{folder}: no such file or folder")
    if not folder.is_dir():
        raise SkillFileError(f"{folder}: not a directory of skills (expected NAME/SKILL.md folders or *.md files)")
    files = sorted(folder.glob("*/SKILL.md")) + sorted(p for p in folder.glob("*.md")
                                                      if p.name.upper() not in ("README.MD",))
    if not files:
        raise SkillFileError(f"{folder}: no skills found (expected NAME/SKILL.md folders or *.md files)")
    return files


def read_skills(folder: str | Path) -> list[Skill]:
    skills = [read_skill(p) for p in skill_files(folder)]
    seen: dict[str, str] = {}
    for s in skills:
        if s.name in seen:
            raise SkillFileError(f"{s.path}: skill name {s.name!r} is already used by {seen[s.name]}")
        seen[s.name] = s.path
    return skills
