"""One contract for skills and the prefix-cache file on both engines (kvtool serve, real SmolLM2 and Qwen2.5):
the `skills` field splices the compiled blocks (usage counts them as skill_block_tokens, apart from cached
tokens), a block shorter than --skill-min-tokens is prefilled instead and the timings say which path each
request took, GET /v1/skills lists them, POST /v1/cache/save writes a .kvc file that `kvtool cache info` reads, a
file saved by one engine answers a repeated long prompt after a restart on the other, and killing a server while it
saves leaves the last good file. On vLLM the skill KV and the file's KV come through kvtool's KV connector; the first
token matches the kvtool engine's composed one. It runs where vLLM is installed (.venv-vllm): kvtool's own save,
load and kill during a save are also held by test_serve_cache_kill.py and tests/cache.

One chain of three servers per model: kvtool (skills, save) -> vLLM (loads kvtool's file; skills, save, killed
during a second save) -> kvtool (loads what vLLM saved last)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvtool.integrations.vllm import available

pytestmark = pytest.mark.real_model

SKILLS = {
    "haiku": ("Write haiku poems.", "# Haiku\nWrite exactly three lines of 5, 7 and 5 syllables. Use one seasonal word. "
              "No title, no rhyme, no punctuation at the end of a line. Prefer concrete images to abstract ones."),
    "limerick": ("Write limericks.", "# Limerick\nFive lines, rhyme scheme AABBA. Lines 1, 2 and 5 have three stressed "
                 "beats; lines 3 and 4 have two. End with a twist. Keep it kind; never mock a real person."),
    "tip": ("A tip.", "Be brief."),
}
MIN_TOKENS = 60  # tip is shorter (prefilled), haiku and limerick longer (composed) on both models
QUESTION = [{"role": "user", "content": "Write a short poem about autumn."}]
LONG = " ".join(f"Fact {i}: the river town of Alder keeps ledger {i * 7} in the north archive." for i in range(40))
LATER = " ".join(f"Entry {i}: the lighthouse at cape {i} logs {i * 3} ships a night." for i in range(50))


def skills_dir(tmp_path):
    folder = tmp_path / "skills"
    folder.mkdir()
    for name, (description, body) in SKILLS.items():
        (folder / f"{name}.md").write_text(f"---\nname: {name}\ndescription: {description}\n---\n{body}\n")
    return folder


def start(engine: str, gguf, tmp_path, cache_file, skills=None, tag: str = ""):
    from kvtool.testing.server_process import ServerProcess

    args = ["--engine", engine, "--model", str(gguf), "--cache-file", str(cache_file), "--log-level", "warning",
            "--skill-repair", "none", "--skill-preamble", "none", "--skill-min-tokens", str(MIN_TOKENS)]
    if skills is not None:
        args += ["--skills", str(skills)]
    if engine == "vllm":
        args += ["--engine-arg", "max_model_len=4096"]
    return ServerProcess(args, tmp_path / f"{engine}{tag}.log").start()


def first_token(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"temperature": 0, "max_tokens": 1, "logprobs": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def completion(client: httpx.Client, prompt: str) -> dict:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def from_the_file(client: httpx.Client, prompt: str) -> None:
    """The restarted server answers `prompt` from the file it loaded: all but its last block cached."""
    usage = completion(client, prompt)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 32, usage


def skills_contract(client: httpx.Client) -> dict:
    """GET /v1/skills, a short block prefilled, two long ones composed; the composed answer."""
    listed = client.get("/v1/skills").json()
    assert listed["enabled"] and {row["name"] for row in listed["data"]} == set(SKILLS)
    tokens = {row["name"]: row["tokens"] for row in listed["data"]}
    assert tokens["tip"] < MIN_TOKENS <= min(tokens["haiku"], tokens["limerick"]), tokens
    short = first_token(client, messages=QUESTION, skills=["tip"])["timings"]
    assert short["skill_path"] == "prefilled" and short["skill_block_tokens"] == 0, short
    assert f"tip ({tokens['tip']} tokens) shorter than skill_min_tokens={MIN_TOKENS}" in short["skill_path_reason"]
    out = first_token(client, messages=QUESTION, skills=["haiku", "limerick"])
    details = out["usage"]["prompt_tokens_details"]
    assert details["skill_block_tokens"] == tokens["haiku"] + tokens["limerick"], details
    assert out["timings"]["skill_block_tokens"] == details["skill_block_tokens"]
    assert out["timings"]["skill_path"] == "composed", out["timings"]
    assert "haiku" in out["timings"]["skill_path_reason"] and "limerick" in out["timings"]["skill_path_reason"]
    assert details["cached_tokens"] + details["skill_block_tokens"] <= out["usage"]["prompt_tokens"]
    return out


def save(client: httpx.Client) -> dict:
    saved = client.post("/v1/cache/save")
    assert saved.status_code == 200, saved.text
    assert saved.json()["tokens"] > 0, saved.json()
    return saved.json()


def killed_during_a_save(srv, client: httpx.Client) -> None:
    """More prefixes, so the next save writes a bigger file; the server is killed while it writes it."""
    for i in range(3):
        completion(client, f"Variant {i}. " + LATER)

    def saving():
        try:
            client.post("/v1/cache/save")
        except httpx.HTTPError:
            pass  # the server died mid-save, as intended

    saver = threading.Thread(target=saving)
    saver.start()
    time.sleep(0.05)
    srv.stop(signal.SIGKILL)
    saver.join(timeout=60)


@pytest.mark.skipif(not available(), reason="the chain crosses both engines: it runs in .venv-vllm")
@pytest.mark.parametrize("model", ["smollm2", "qwen25"])
def test_skills_and_the_cache_file_on_both_engines(model, tmp_path):
    from kvtool.cache.persist import describe_file
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    gguf = smollm2_gguf() if model == "smollm2" else qwen25_gguf()
    skills, cache_file = skills_dir(tmp_path), tmp_path / "prefix.kvc"

    srv = start("kvtool", gguf, tmp_path, cache_file, skills, "-first")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=600) as client:
            on_kvtool = skills_contract(client)
            reset = client.post("/v1/cache/reset")  # else the file would hold the composed prompt's prefix, and
            assert reset.status_code == 200, reset.text  # the other engine would find its first skill cached
            assert completion(client, LONG)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            save(client)
    finally:
        srv.stop()
    info = subprocess.run([sys.executable, "-m", "kvtool.cli", "cache", "info", str(cache_file)],
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr

    srv = start("vllm", gguf, tmp_path, cache_file, skills)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=600) as client:
            from_the_file(client, LONG)  # saved by kvtool's engine
            on_vllm = skills_contract(client)
            top = lambda out: out["choices"][0]["logprobs"]["content"][0]["token"]  # noqa: E731
            assert top(on_vllm) == top(on_kvtool), (on_vllm["choices"][0], on_kvtool["choices"][0])
            assert (on_vllm["usage"]["prompt_tokens_details"]["skill_block_tokens"]
                    == on_kvtool["usage"]["prompt_tokens_details"]["skill_block_tokens"])
            assert completion(client, LATER)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            saved = save(client)
            killed_during_a_save(srv, client)
    finally:
        srv.stop(signal.SIGKILL)
    kept = describe_file(cache_file)  # verified: checksum, setup, index
    assert kept["tokens"] >= saved["tokens"], (kept, saved)

    srv = start("kvtool", gguf, tmp_path, cache_file, tag="-last")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=600) as client:
            from_the_file(client, LATER)  # saved by vLLM before it was killed
    finally:
        srv.stop()
