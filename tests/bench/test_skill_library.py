"""The long-skill library: deterministic, SKILL.md-shaped, 1,000-3,000 tokens a skill, and requests whose question
names one loaded skill and whose answer is in that skill's text."""

from __future__ import annotations

import pytest

from kvtool.bench.skill_library import library, messages, requests, write_library
from kvtool.skills.skillfile import parse_skill


def test_same_seed_same_library_and_requests():
    a, b = library(3), library(3)
    assert [s.text for s in a] == [s.text for s in b]
    assert requests(a, 20, seed=5) == requests(b, 20, seed=5)
    assert [s.text for s in library(4)] != [s.text for s in a]


def test_skills_read_back_as_skill_files():
    for s in library(0):
        again = parse_skill(s.text)
        assert (again.name, again.description, again.body) == (s.skill.name, s.skill.description, s.skill.body)
        for heading in ("## Procedure", "## Error codes", "## Limits", "```python"):
            assert heading in s.skill.body


def test_requests_load_two_to_four_and_ask_about_one():
    lib = library(0)
    text = {s.skill.name: s.skill.body for s in lib}
    reqs = requests(lib, 200, seed=1)
    assert {len(r.skills) for r in reqs} == {2, 3, 4}
    assert len({r.skills for r in reqs}) > 150  # orders vary
    for r in reqs:
        assert len(set(r.skills)) == len(r.skills) and r.target in r.skills
        assert r.target in r.fact.question and r.fact.answer in text[r.target]
    with pytest.raises(ValueError, match="count"):
        library(0, count=17)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2", "qwen25"])
def test_sizes_in_tokens_and_prompts_hold_each_skill_verbatim(name, request):
    model = request.getfixturevalue(name)
    lib = library(0)
    sizes = [len(model.tokenizer.encode(s.skill.content, add_special_tokens=False)) for s in lib]
    assert len(lib) == 16 and min(sizes) >= 1000 and max(sizes) <= 3000, sizes
    for r in requests(lib, 8, seed=2):
        prompt = model.render(messages(r, lib))
        where = [prompt.index(next(s.skill.content for s in lib if s.skill.name == n)) for n in r.skills]
        assert where == sorted(where) and prompt.rstrip().endswith(model.render(
            [{"role": "user", "content": r.fact.question}])[-40:].rstrip())


def test_written_library_reads_back(tmp_path):
    from kvtool.skills.skillfile import read_skills

    lib = library(0, count=5)
    write_library(tmp_path, lib)
    assert [s.body for s in read_skills(tmp_path)] == [s.skill.body for s in sorted(lib, key=lambda s: s.skill.name)]
