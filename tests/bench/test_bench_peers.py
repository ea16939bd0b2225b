"""`kvtool bench peers`: the peer servers' lifecycle, finding llama-server and vLLM, the ratios and targets,
and a quick run against real servers: kvtool serve and llama.cpp's llama-server on SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtool.bench.peers import PeersConfig, run_peers
from kvtool.bench.peers.engines import cpu_key, find_llama_server, vllm_python
from kvtool.bench.peers.judge import best, ratios, targets
from kvtool.bench.peers.servers import PeerError, ServerProcess, free_port
from kvtool.errors import InvalidParameterError

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def test_bad_settings_are_named():
    with pytest.raises(InvalidParameterError, match="--engines.*ollama"):
        PeersConfig(engines=["kvtool", "ollama"]).validate()
    with pytest.raises(InvalidParameterError, match="decode_tokens"):
        PeersConfig(decode_tokens=1).validate()
    with pytest.raises(InvalidParameterError, match="--vllm-dtype"):
        PeersConfig(vllm_dtype="int8").validate()
    with pytest.raises(InvalidParameterError, match="--settle-max-s >= 0.*'settle_max_s': -1"):
        PeersConfig(settle_max_s=-1).validate()
    quick = PeersConfig(quick=True).sized()
    assert quick.streams == [4] and quick.repeats == 1 and PeersConfig().sized().streams == [8, 64]
    assert quick.settle_max_s == 0 and PeersConfig().sized().settle_max_s == 180  # a smoke run does not wait


def test_the_command_line_sets_the_wait_for_the_load_to_settle(monkeypatch, tmp_path):
    import kvtool.bench.peers
    from kvtool.cli import main

    seen = []
    monkeypatch.setattr(kvtool.bench.peers, "run_peers", lambda cfg, log, command: seen.append(cfg) or [])
    assert main(["bench", "peers", "--settle-max-s", "30", "--out-dir", str(tmp_path / "p")]) == 0
    assert main(["bench", "peers", "--out-dir", str(tmp_path / "q")]) == 0
    assert [c.settle_max_s for c in seen] == [30.0, PeersConfig().settle_max_s]
    assert main(["bench", "peers", "--settle-max-s", "-1", "--out-dir", str(tmp_path / "r")]) == 2 and len(seen) == 2


def test_cpu_key_is_the_one_the_build_script_files_its_binary_under():
    # scripts/llama_server.sh names its cache folder with this pipeline; a binary for another CPU is never found
    shell = subprocess.run(["bash", "-c", "(grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo; "
                            "uname -m) | sha256sum | cut -c1-16"], capture_output=True, text=True, check=True)
    assert cpu_key() == shell.stdout.strip()
    assert f"CPU_KEY=$( (grep -m1 '^model name' /proc/cpuinfo" in (ROOT / "scripts" / "llama_server.sh").read_text()


def test_missing_engines_say_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(PeerError, match="KVTOOL_LLAMA_SERVER=.*not an executable") as err:
        find_llama_server()
    assert err.value.missing
    with pytest.raises(PeerError, match="vLLM is not installed for .*--vllm-python") as err:
        vllm_python(sys.executable)  # kvtool's own environment has no vLLM
    assert err.value.missing


def test_server_process_waits_for_health_and_stops_its_whole_group(tmp_path):
    port = free_port()
    marker = tmp_path / "child.pid"
    script = (f"import http.server, os, subprocess\n"
              f"child = subprocess.Popen(['sleep', '300'])\n"
              f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
              f"http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()\n")
    server = ServerProcess("toy", [sys.executable, "-c", script], port, tmp_path / "toy.log", startup_s=30,
                           health="/", log_fn=lambda s: None)
    with server as url:
        assert url == f"http://127.0.0.1:{port}" and server.startup_ms > 0
        child = int(marker.read_text())
        os.kill(child, 0)  # running
    assert server.proc.poll() is not None
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server's child outlived it")


def test_a_server_dies_with_the_process_that_started_it(tmp_path):
    port, pid_file = free_port(), tmp_path / "server.pid"
    parent = (f"import os, sys\n"
              f"from kvtool.bench.peers.servers import ServerProcess\n"
              f"s = ServerProcess('toy', [sys.executable, '-m', 'http.server', '{port}', '--bind', '127.0.0.1'], "
              f"{port}, {str(tmp_path / 'toy.log')!r}, health='/', log_fn=lambda m: None)\n"
              f"s.start()\n"
              f"open({str(pid_file)!r}, 'w').write(str(s.proc.pid))\n"
              f"os._exit(0)\n")  # no stop(): killed, as by a time limit
    subprocess.run([sys.executable, "-c", parent], check=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    server = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(server, 9)
    pytest.fail("the server outlived the process that started it")


def test_a_server_that_exits_early_fails_with_its_log(tmp_path):
    server = ServerProcess("broken", [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                           free_port(), tmp_path / "broken.log", startup_s=30, log_fn=lambda s: None)
    with pytest.raises(PeerError, match="(?s)broken exited with status 3.*no model here"):
        server.start()


def _summary(x):
    return {"median": x, "min": x, "max": x, "stdev": 0.0, "n": 1, "runs": [x]}


def test_ratios_and_targets_from_one_run():
    layouts = lambda hit: {"shared-prefix": {"ttft_ms_p50": 100.0, "hit_rate_after_first": hit}}  # noqa: E731
    engines = {
        "kvtool": {"status": "ok", "results": {"decode_tok_s": _summary(40.0), "ttft_ms_2048": _summary(4000.0),
                                               "layouts": layouts(0.9)}},
        "kvtool-int4": {"status": "ok", "results": {"decode_tok_s": _summary(90.0), "ttft_ms_2048": _summary(3900.0)}},
        "llama.cpp": {"status": "ok", "results": {"decode_tok_s": _summary(100.0), "ttft_ms_2048": _summary(2000.0),
                                                  "layouts": layouts(0.95)}},
        "vllm": {"status": "missing", "reason": "not installed"}}
    record = {"engines": engines, "config": {"ttft_lengths": [512, 2048]}}
    record["ratios"], record["best"] = ratios(engines), best(engines)
    assert record["ratios"]["kvtool"]["llama.cpp"]["decode_tok_s"] == 0.4
    assert record["ratios"]["kvtool"]["llama.cpp"]["ttft_ms_2048"] == 0.5  # a time: theirs / ours
    assert "kvtool-int4" not in record["ratios"]["kvtool"] and "vllm" not in record["ratios"]["kvtool"]
    rows = {t["target"].split(" ")[0]: t for t in targets(record)}
    assert rows["best"]["status"] == "not measured"  # no vLLM
    assert rows["cold"]["status"] == "missed"
    assert rows["cold"]["ratio"] == pytest.approx(2000 / 3900, abs=1e-3)  # the better kvtool variant
    assert rows["cached-token"]["ratio"] == pytest.approx(0.9 / 0.95, abs=1e-3)
    assert rows["cached-token"]["status"] == "missed" and "shared-prefix (90.0% vs llama.cpp 95.0%)" in \
        rows["cached-token"]["detail"]


@pytest.mark.real_model
@pytest.mark.slow
def test_quick_run_against_llama_server_and_kvtool_serve(tmp_path, capsys):
    try:
        find_llama_server()
    except PeerError as exc:
        pytest.skip(str(exc))
    # every workload but vllm-bench (vLLM's client lives in its own environment: tests/bench/test_peers_vllm_client.py)
    cfg = PeersConfig(model="smollm2", engines=["kvtool", "llama.cpp"], quick=True, out_dir=str(tmp_path),
                      workloads=["memory", "decode", "ttft", "prefix", "streams", "layouts"], threads=[2])
    [record] = run_peers(cfg, log=lambda s: None)  # one record per thread count
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["benchmark"] == "peers" and last["engines"].keys() == record["engines"].keys()
    assert record["gguf_type"] == "Q4_1"
    assert record["threads"] == 2 and record["thread_counts"] == [2] and record["config"]["threads"] == [2]
    assert {n: e["precision"] for n, e in record["engines"].items()} == {"kvtool": "fp32", "llama.cpp": "int4"}
    assert record["order"] == ["kvtool #1", "llama.cpp #1", "llama.cpp #2", "kvtool #2"]
    assert isinstance(record["quiet"], bool) and record["load"]["samples"] >= 4
    assert record["load"]["others_cpu_max"] >= 0  # the CPU that processes outside the run took, beside the load
    c = record["config"]
    for name, e in record["engines"].items():
        assert e["status"] == "ok", (name, e.get("reason"))
        assert e["unsupported"] == {}, (name, e["unsupported"])
        assert e["rounds"] == 2 and [r["round"] for r in e["runs"]] == [1, 2]
        assert [r["settle"]["waited_s"] for r in e["runs"]] == [0, 0]  # quick: no wait for the load to decay
        assert e["results"]["memory"]["rss_mib"] > 0 and e["budgets"]["kv"]
        mem = e["results"]["memory"]
        assert 0 < mem["pss_mib"] <= mem["rss_mib"] and sum(mem["by_name"].values()) == pytest.approx(mem["rss_mib"],
                                                                                                     abs=0.5)
        r = e["results"]
        assert r["decode_tok_s"]["median"] > 0 and r["ttft_ms_128"]["median"] > 0
        assert r["prefix_prompt_tokens"] == c["prefix_tokens"] + c["suffix_tokens"]
        # both engines report the prefix they reused
        assert 0 < r["prefix_cached_tokens"] <= c["prefix_tokens"]
        s = r["streams_4"]
        assert s["streams"] == 4 and s["tokens"] == 4 * c["stream_tokens"] and s["itl_ms_p50"] > 0
        hits = {name: row["hit_rate_after_first"] for name, row in r["layouts"].items()}
        assert hits.keys() == {"shared-prefix", "timestamp"} and all(0 <= h <= 1 for h in hits.values())
        assert r["layouts_isolation"] == "nonce"  # every engine gets the same prompt bytes, nonce included
        assert hits["shared-prefix"] > hits["timestamp"]  # the layout that keeps its prefix reuses more
    assert record["engines"]["llama.cpp"]["weights"] == "GGUF Q4_1"
    assert set(record["ratios"]["kvtool"]["llama.cpp"]) >= {"decode_tok_s", "ttft_ms_128", "prefix_hit_ms",
                                                             "streams_4_tok_s", "layout_shared-prefix_hit_after_first"}
    vllm = [t for t in record["targets"] if "vllm" in t["target"].lower()]
    assert vllm and {t["status"] for t in vllm} == {"not measured"}  # no vLLM in this run
    roof = record["roofline"]  # the machine, measured before the engines ran, and every row against its limit
    assert roof["machine"]["threads"] == 2 and roof["machine"]["bandwidth_gb_s"] > 0
    assert len(roof["machine"]["probes"]) == 2  # before the first engine and after the last
    assert {(r["engine"], r["row"]) for r in roof["rows"]} == {
        (n, row) for n in ("kvtool", "llama.cpp") for row in ("decode bs=1", "4 streams", "cold TTFT @128")}
    assert all(r["fraction"] > 0 for r in roof["rows"])
    md = (tmp_path / "report.md").read_text()
    for section in ("## Roofline", "## Engines", "## Targets", "## Equal precision",
                    "## Decode, cold TTFT and prefix hit", "## Concurrent streams",
                    "## Context layouts", "## Ratios", "GGUF Q4_1"):
        assert section in md
    for plot in record["files"]["plots"].values():
        assert Path(plot).read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "report.json").read_text())["ratios"] == record["ratios"]
