"""The server reuses KV across requests through the prefix cache, and exposes it."""

import pytest

pytestmark = pytest.mark.real_model

SYSTEM = ("You are a careful assistant for a travel agency. Answer in one short sentence. "
          "Never invent prices. Prefer trains over planes for trips under 500 km.")


def ask(client, question, **extra):
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 6, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_second_request_with_the_same_prefix_hits(smol):
    smol.post("/v1/cache/reset")
    first = ask(smol, "Is Lyon far from Paris?")
    again = ask(smol, "Is Lyon far from Paris?")
    other = ask(smol, "What should I pack for Oslo?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n = first["usage"]["prompt_tokens"]
    covered = (n + first["usage"]["completion_tokens"] - 1) // 16 * 16  # full blocks of prompt + reply (cached)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == min(n - 1, covered)  # to the token
    assert again["timings"]["prefill_tokens"] == n - again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    shared = other["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= shared < n  # the system turn is shared, the question is not

    summary = smol.get("/v1/cache").json()
    assert summary["queries"] >= 3 and summary["hit_tokens"] > 0 and summary["bytes_in_use"] > 0
    metrics = smol.get("/metrics").text
    assert "kvtool_prefix_cache" in metrics

    assert smol.post("/v1/cache/reset").status_code == 200
    after = ask(smol, "Is Lyon far from Paris?")
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_pin_keeps_a_system_prompt(smol):
    smol.post("/v1/cache/reset")
    before = smol.get("/v1/cache").json()
    pin = smol.post("/v1/cache/pin", json={"messages": [{"role": "system", "content": SYSTEM}]})
    assert pin.status_code == 200, pin.text
    after = pin.json()["cache"]
    # its KV was computed as a request of the batch (one more query), then pinned
    assert after["queries"] == before["queries"] + 1 and after["pinned_blocks"] == pin.json()["pinned_tokens"] // 16
    hit = ask(smol, "Is Lyon far from Paris?")
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= pin.json()["pinned_tokens"]
    bad = smol.post("/v1/cache/pin", json={"nonsense": 1})
    assert bad.status_code == 400 and "error" in bad.json()


def test_a_cache_file_keeps_the_prefixes_across_a_restart(smollm2, smol, tmp_path):
    from fastapi.testclient import TestClient

    from kvtool.config import EngineConfig
    from kvtool.errors import CacheFormatError
    from kvtool.serving import ServerConfig, create_app

    path = tmp_path / "serve.kvc"
    config = EngineConfig(cache_file=str(path))
    with TestClient(create_app(smollm2, config, ServerConfig(default_max_tokens=6))) as client:
        first = ask(client, "Is Lyon far from Paris?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        saved = client.post("/v1/cache/save")
        assert saved.status_code == 200, saved.text
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name.startswith(path.name))  # + its data
        assert saved.json()["tokens"] > 0 and saved.json()["bytes"] == on_disk
        pin = client.post("/v1/cache/pin", json={"messages": [{"role": "system", "content": SYSTEM}]})
        assert pin.status_code == 200, pin.text
    # shutdown saved it again, with the pin; a restarted server starts from it
    with TestClient(create_app(smollm2, config, ServerConfig(default_max_tokens=6))) as client:
        assert client.get("/v1/cache").json()["pinned_blocks"] == pin.json()["pinned_tokens"] // 16 > 0
        again = ask(client, "Is Lyon far from Paris?")
        n = again["usage"]["prompt_tokens"]
        covered = (n + first["usage"]["completion_tokens"] - 1) // 16 * 16  # the file holds prompt + reply
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == min(n - 1, covered)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]

    r = smol.post("/v1/cache/save")  # a server started without --cache-file
    assert r.status_code == 404 and "--cache-file" in r.json()["error"]["message"]
    path.write_bytes(b"not a cache")
    with pytest.raises(CacheFormatError, match="not a readable prefix cache"):
        create_app(smollm2, config)


def test_cache_save_every_writes_the_cache_while_serving_and_only_when_it_changed(smollm2, tmp_path, caplog):
    import logging
    import time

    from fastapi.testclient import TestClient

    from kvtool.cache.manager import PrefixCache
    from kvtool.config import EngineConfig
    from kvtool.errors import InvalidParameterError
    from kvtool.serving import ServerConfig, create_app

    def wait_for(check, seconds=20.0):
        end = time.monotonic() + seconds
        while not check():
            assert time.monotonic() < end, "the autosave did not happen in time"
            time.sleep(0.1)

    path = tmp_path / "auto.kvc"
    config, every = EngineConfig(cache_file=str(path)), ServerConfig(default_max_tokens=6, cache_save_every=1)
    caplog.set_level(logging.INFO, logger="kvtool")
    with TestClient(create_app(smollm2, config, every)) as client:
        time.sleep(1.5)
        assert not path.exists()  # nothing cached yet: nothing to save
        first = ask(client, "Is Lyon far from Paris?")
        wait_for(lambda: "autosaved the prefix cache" in caplog.text)
        time.sleep(1.5)  # the request's commit may land after its response: one more tick saves it
        stamp = path.stat().st_mtime_ns
        time.sleep(2.5)
        assert path.stat().st_mtime_ns == stamp  # no request since: not written again
        # the file holds what was served, while the server still runs (a crash would keep it)
        spare = PrefixCache.for_runner(smollm2.runner, budget_bytes=1 << 26)
        assert spare.load(str(path), smollm2)["tokens"] == (first["usage"]["prompt_tokens"] + 6) // 16 * 16
        path.unlink()
        path.mkdir()  # the next save fails: it is logged and serving goes on
        ask(client, "What should I pack for Oslo?")
        wait_for(lambda: "could not autosave the prefix cache" in caplog.text)
        assert ask(client, "Is Lyon far from Paris?")["choices"][0]["message"]["content"] == \
            first["choices"][0]["message"]["content"]
        path.rmdir()
    with pytest.raises(InvalidParameterError, match="--cache-save-every saves the prefix cache to --cache-file"):
        create_app(smollm2, EngineConfig(), every)
    with pytest.raises(InvalidParameterError, match="--cache-save-every must be a number of seconds >= 1, got 0.5"):
        create_app(smollm2, config, ServerConfig(cache_save_every=0.5))


def test_the_cache_tree_shows_the_shared_system_prompt_and_where_questions_diverge(smol):
    smol.post("/v1/cache/reset")
    for question in ("Is Lyon far from Paris?", "What should I pack for Oslo?", "Is Lyon far from Paris?"):
        ask(smol, question)
    r = smol.get("/v1/cache/tree")
    assert r.status_code == 200, r.text
    body = r.json()
    root = body["tree"][0]
    assert len(body["tree"]) == 1 and body["segments"] >= 3
    assert root["start"] == 0 and root["text"].startswith("<|im_start|>system\nYou are a careful assistant")
    assert len(root["children"]) == 2 and all(c["start"] == root["tokens"] for c in root["children"])
    lyon = root["children"][0]  # walked most: asked twice
    assert "Lyon" in lyon["text"] and lyon["hits"] > root["children"][1]["hits"]
    assert "token_ids" not in root and len(smol.get("/v1/cache/tree?token_ids=true").json()["tree"][0]["token_ids"]) \
        == root["tokens"]
    assert "text" not in smol.get("/v1/cache/tree?max_chars=0").json()["tree"][0]
    short = smol.get("/v1/cache/tree?max_chars=20").json()["tree"][0]["text"]
    assert len(short) == 23 and " … " in short
    bad = smol.get("/v1/cache/tree?max_chars=-1")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_chars"
