"""The kvtool-vllm peer of `kvtool bench peers`: `kvtool serve --engine vllm` with kvtool's KV connector mounted,
started as the vllm peer starts vLLM, its memory row read against vLLM's own server. The command-line and report
tests run anywhere (no model); the SmolLM2 test runs both servers in the vLLM environment (.venv-vllm) and skips
elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvtool.bench.peers import PeersConfig
from kvtool.bench.peers import engines as peer_engines
from kvtool.bench.peers.judge import best, family, pairs, ratios, targets
from kvtool.bench.peers.report import markdown
from kvtool.bench.peers.servers import PeerError
from kvtool.cli import build_parser

FILES = peer_engines.ModelFiles("m", None, Path("/models/m"), max_position=8192)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def vllm_python(monkeypatch):
    monkeypatch.setattr(peer_engines, "vllm_python", lambda option: "/venv-vllm/bin/python")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kvtool_vllm_starts_vllms_engine_as_the_vllm_peer_does_with_the_connector_on_its_store(vllm_python, tmp_path,
                                                                                              dtype):
    opts = peer_engines.PeerOptions(threads=2, context=4096, streams=16, vllm_dtype=dtype, prefix_cache_mib=512,
                                    scratch=str(tmp_path))
    argv, env = peer_engines.PEERS["kvtool-vllm"].command(FILES, 8000, opts)
    plain, plain_env = peer_engines.PEERS["vllm"].command(FILES, 8000, opts)
    assert argv[:3] == ["/venv-vllm/bin/python", "-m", "kvtool.cli"]
    args = build_parser().parse_args(argv[3:])  # every flag is one kvtool serve takes
    assert args.command == "serve" and args.engine == "vllm" and args.model == "/models/m"
    assert (args.host, args.port, args.dtype, args.served_model_name) == ("127.0.0.1", 8000, dtype, "m")
    assert args.dtype == _flag(plain, "--dtype") and args.max_active == args.max_queue == 16
    # the connector mounts on a block store in the server's own scratch folder (removed after it stops)
    assert args.kv_store == str(tmp_path / "kv-store") and args.kv_store_bytes == 512 << 20
    engine = dict(a.split("=", 1) for a in args.engine_arg)
    assert engine == {"enforce_eager": "true", "max_model_len": _flag(plain, "--max-model-len"),
                      "max_num_seqs": _flag(plain, "--max-num-seqs")}
    # the same environment as vLLM's own server: one engine process, the same KV pool and threads
    assert env == plain_env and env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == "2"
    peer = peer_engines.PEERS["kvtool-vllm"]
    assert peer.precision(FILES, opts) == peer_engines.PEERS["vllm"].precision(FILES, opts)
    assert peer.budgets(opts)["kv"] == peer_engines.PEERS["vllm"].budgets(opts)["kv"] and peer.alone == "vllm"


def test_kvtool_vllm_without_a_scratch_folder_is_refused(vllm_python):
    opts = peer_engines.PeerOptions(threads=1, context=4096, streams=4)
    with pytest.raises(PeerError, match="scratch folder") as err:
        peer_engines.PEERS["kvtool-vllm"].command(FILES, 8000, opts)
    assert not err.value.missing


def _engine(precision: str, rss: float, decode: float, **extra) -> dict:
    stat = lambda x: {"median": x, "min": x, "max": x, "stdev": 0.0, "n": 1, "runs": [x]}  # noqa: E731
    return {"status": "ok", "precision": precision, "weights": precision, "budgets": {"kv": "2 GiB"},
            "results": {"memory": {"rss_mib": rss, "processes": 1}, "decode_tok_s": stat(decode)},
            "spread": {"memory.rss_mib": {"min": rss - 10, "max": rss + 10}}, **extra}


def test_the_memory_row_reads_kvtool_vllm_against_vllm_and_no_target_takes_it_for_vllm():
    engines = {"kvtool": _engine("fp32", 900.0, 30.0), "kvtool-vllm": _engine("fp32", 1050.0, 40.0, alone="vllm"),
               "vllm": _engine("fp32", 1000.0, 20.0)}
    record = {"engines": engines, "threads": 1, "config": {"workloads": ["memory", "decode"], "ttft_lengths": [512]}}
    record.update(ratios=ratios(engines), pairs=pairs(engines), best=best(engines))
    record["targets"] = targets(record)
    assert family("kvtool-vllm") == "kvtool-vllm" and family("vllm-bf16") == "vllm"
    # kvtool's fp32 target is judged against vLLM's own server, never against vLLM behind kvtool's server
    assert [(p["kvtool"], p["peer"]) for p in record["pairs"]] == [("kvtool", "kvtool-vllm"), ("kvtool", "vllm")]
    assert record["best"]["vllm"]["decode_tok_s"] == {"ratio": 1.5, "kvtool": "kvtool", "peer": "vllm"}
    from kvtool.bench.peers.report import _memory_md

    rows = {line.split(" | ")[0].strip("| "): line for line in _memory_md(record) if line.startswith("| ")}
    assert "| 1.050x vllm |" in rows["kvtool-vllm"] and "1,050 (1,040-1,060)" in rows["kvtool-vllm"]
    assert "| - |" in rows["vllm"] and "| - |" in rows["kvtool"]
    del engines["vllm"]  # the engine alone did not run: nothing to read against
    assert "| - |" in [line for line in _memory_md(record) if line.startswith("| kvtool-vllm")][0]


@pytest.mark.real_model
@pytest.mark.slow
def test_kvtool_vllm_holds_one_copy_of_the_weights_beside_vllm_on_smollm2(tmp_path):
    pytest.importorskip("vllm", reason="vLLM's server lives in the vLLM environment (.venv-vllm)")
    from kvtool.bench.peers.harness import model_files, run_server_peer

    cfg = PeersConfig(model="smollm2", engines=["vllm", "kvtool-vllm"], workloads=["memory"], quick=True,
                      threads=[1], vllm_python=sys.executable).validate().sized()
    files = model_files(cfg.model, lambda s: None)
    rows = {name: run_server_peer(name, files, cfg, tmp_path, lambda s: None, label=f"{name}-round1")
            for name in ("vllm", "kvtool-vllm")}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row.get("reason"))
    log = Path(rows["kvtool-vllm"]["log"]).read_text()
    assert "KvtoolConnector" in log  # vLLM created kvtool's connector (kv_transfer_config), on the scratch store
    assert "--kv-store" in rows["kvtool-vllm"]["command"] and "--engine vllm" in rows["kvtool-vllm"]["command"]
    ours, theirs = (rows[n]["results"]["memory"] for n in ("kvtool-vllm", "vllm"))
    weights_mib = 135e6 * 4 / 2**20  # SmolLM2's fp32 weights: a second copy would add about this much
    assert theirs["rss_mib"] > weights_mib and ours["processes"] >= 1
    assert ours["rss_mib"] <= 1.10 * theirs["rss_mib"], (ours, theirs)
    # vLLM's API server runs its engine core (the weights, the KV pool) in a process of its own, whose RSS alone is
    # the sharper bound: kvtool's server, connector and store around the same engine add less than half the weights
    engine_core = max(theirs["by_name"].values())
    assert theirs["processes"] >= 2 and ours["rss_mib"] - engine_core < weights_mib / 2, (ours, theirs)


def test_the_memory_row_counts_every_process_the_server_started():
    import os
    import signal
    import subprocess
    import time

    from kvtool.bench.peers.memory import tree_rss

    # a server whose worker is its child's child, each holding 64 MiB of its own
    hold = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(60)"
    spawn = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {hold!r}]); {hold}"
    top = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                                                  f"{spawn!r}]); {hold}"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while (row := tree_rss(top.pid))["processes"] < 3 or row["rss_mib"] < 3 * 64:
            assert time.monotonic() < deadline, row
            time.sleep(0.2)
        assert row["processes"] == 3 and len(row["by_name"]) == 1  # one interpreter's name: the three summed
        assert sum(row["by_name"].values()) == pytest.approx(row["rss_mib"], abs=0.3)
        # each holds its own 64 MiB: the tree's PSS has all three, below its RSS (the interpreter's shared pages)
        assert 3 * 64 < row["pss_mib"] <= row["rss_mib"]
    finally:
        os.killpg(top.pid, signal.SIGKILL)
        top.wait()
    assert tree_rss(2**22 + 1) == {"rss_mib": 0.0, "pss_mib": 0.0, "processes": 0, "by_name": {}}  # no such pid
