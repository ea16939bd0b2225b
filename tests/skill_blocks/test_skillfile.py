"""SKILL.md parsing and skill directories: bad input names the file and what is wrong."""

import pytest

from kvtool.skills import SkillFileError, parse_skill, read_skill, read_skills
from kvtool.skills.skillfile import skill_files

GOOD = "---\nname: pdf\ndescription: Work with PDF\n  files.\n---\n# PDF\n\nDo things.\n"


def test_parse_good_skill():
    s = parse_skill(GOOD, "x/SKILL.md")
    assert (s.name, s.description, s.body) == ("pdf", "Work with PDF files.", "# PDF\n\nDo things.")
    assert s.content.startswith('<skill name="pdf">\n# PDF') and s.content.endswith("</skill>")


@pytest.mark.parametrize("text,why", [
    ("# no frontmatter\n", "missing YAML frontmatter"),
    ("---\nname: a\ndescription: b\n# never closed\n", "not closed"),
    ("---\nname: [a\n---\nbody\n", "not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 9$"),
    ("---\nname: a\ndescription: b: c\n---\nbody\n", "not valid YAML: mapping values are not allowed here at line 3, "
                                                    "column 15$"),
    ("---\n- a\n- b\n---\nbody\n", "YAML mapping"),
    ("---\ndescription: b\n---\nbody\n", "lacks name"),
    ("---\nname: a\n---\nbody\n", "lacks description"),
    ("---\nname: ''\ndescription: ''\n---\nbody\n", "lacks name and description"),
    ("---\nname: a b/c\ndescription: d\n---\nbody\n", "must be 1-64"),
    ("---\nname: a\ndescription: d\n---\n\n", "no instructions"),
])
def test_bad_skill_names_file_and_problem(text, why):
    with pytest.raises(SkillFileError, match=why) as err:
        parse_skill(text, "skills/broken/SKILL.md")
    assert "skills/broken/SKILL.md" in str(err.value) and "\n" not in str(err.value)  # one line, no caret


def test_directory_catalog(tmp_path):
    (tmp_path / "pdf").mkdir()
    (tmp_path / "pdf" / "SKILL.md").write_text(GOOD)
    (tmp_path / "git.md").write_text(GOOD.replace("pdf", "git"))
    (tmp_path / "README.md").write_text("not a skill")
    assert [p.name for p in skill_files(tmp_path)] == ["SKILL.md", "git.md"]
    assert [s.name for s in read_skills(tmp_path)] == ["pdf", "git"]
    assert read_skill(tmp_path / "pdf").name == "pdf"


def test_directory_errors(tmp_path):
    with pytest.raises(SkillFileError, match="no such file or folder"):
        read_skills(tmp_path / "nope")
    with pytest.raises(SkillFileError, match="no skills found"):
        read_skills(tmp_path)
    (tmp_path / "a.md").write_text(GOOD)
    (tmp_path / "b.md").write_text(GOOD)
    with pytest.raises(SkillFileError, match="already used by"):
        read_skills(tmp_path)
    (tmp_path / "c.md").write_text("no frontmatter")
    with pytest.raises(SkillFileError, match="c.md: missing YAML frontmatter"):
        read_skill(tmp_path / "c.md")
    with pytest.raises(SkillFileError, match="cannot read"):
        read_skill(tmp_path / "missing.md")


def test_example_skills_parse():
    from pathlib import Path

    skills = read_skills(Path(__file__).resolve().parents[2] / "examples" / "skills")
    assert {s.name for s in skills} >= {"pdf", "xlsx", "git-commit", "code-review"}


def test_a_missing_path_is_said_to_be_missing(tmp_path):
    with pytest.raises(SkillFileError, match="nope: no such file or folder"):
        skill_files(tmp_path / "nope")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SkillFileError, match="file.txt: not a directory of skills"):
        skill_files(tmp_path / "file.txt")
