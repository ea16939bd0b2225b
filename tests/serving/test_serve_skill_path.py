"""kvtool serve --skills --skill-min-tokens on kvtool's engine (real SmolLM2): a request whose skill block is
shorter than the threshold is prefilled, one whose block is longer is composed, and the response's timings say
which path it took and why."""

import httpx
import pytest

from kvtool.config import EngineConfig

pytestmark = pytest.mark.real_model

SHORT = "---\nname: tip\ndescription: A tip.\n---\nBe brief.\n"
LONG = ("---\nname: style\ndescription: A style guide.\n---\n# Style\n"
        + " ".join(f"Rule {i}: write plain sentences, name every file you touch and keep each line short." for i in range(8))
        + "\n")
MIN_TOKENS = 64
QUESTION = [{"role": "user", "content": "Rename the config module."}]


@pytest.fixture(scope="module")
def served(smollm2, skill_catalog):
    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer

    catalog = skill_catalog(smollm2, {"tip.md": SHORT, "style.md": LONG})
    assert len(catalog.block("tip")) < MIN_TOKENS <= len(catalog.block("style"))
    app = create_app(smollm2, EngineConfig(skill_repair="none", skill_min_tokens=MIN_TOKENS),
                     ServerConfig(default_max_tokens=1), skills=catalog)
    srv = BackgroundServer(app).start()
    with httpx.Client(base_url=srv.base_url, timeout=300) as client:
        yield client, catalog
    srv.stop()


def timings(client, skills):
    client.post("/v1/cache/reset")
    r = client.post("/v1/chat/completions", json={"messages": QUESTION, "skills": skills, "max_tokens": 1,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["timings"]


def test_a_short_skill_is_prefilled_and_a_long_one_composed(served):
    client, catalog = served
    short = timings(client, ["tip"])
    assert short["skill_path"] == "prefilled" and short["skill_block_tokens"] == 0, short
    assert "tip" in short["skill_path_reason"] and f"skill_min_tokens={MIN_TOKENS}" in short["skill_path_reason"]
    long = timings(client, ["style"])
    assert long["skill_path"] == "composed" and long["skill_block_tokens"] == len(catalog.block("style")), long
    assert "style" in long["skill_path_reason"]
    both = timings(client, ["tip", "style"])
    assert both["skill_path"] == "composed" and both["skill_block_tokens"] == len(catalog.block("style")), both
    assert "tip" in both["skill_path_reason"] and "prefilled" in both["skill_path_reason"]


def test_a_prompt_without_skills_says_so(served):
    client, _ = served
    plain = timings(client, [])
    assert plain["skill_path"] == "prefilled" and plain["skill_path_reason"] == "no skill block in the prompt", plain
