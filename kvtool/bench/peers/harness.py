"""`kvtool bench peers`: the same workloads against kvtool serve and the engines users would pick instead
(llama.cpp's llama-server on the GGUF itself, vLLM on the HF folder kvtool made of it), plus transformers
in this process, on one model and machine in one run. Each server is started on a free loopback port, waited
for, measured alone (nothing else of this run uses the CPU meanwhile) and stopped before the next one.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from kvtool.bench.peers.config import PeersConfig
from kvtool.bench.peers.engines import PEERS, ModelFiles, PeerOptions, gguf_type
from kvtool.bench.peers.servers import PeerError, ServerProcess, free_port
from kvtool.bench.peers.workloads import WORKLOADS, Endpoint, TokenSource


def model_files(model: str, log) -> ModelFiles:
    """The GGUF (when the model is one) and the HF folder kvtool converts it to, once."""
    from kvtool.bench.loading import model_path
    from kvtool.models.gguf import is_gguf
    from kvtool.models.loading import resolve_folder

    path = Path(model_path(model, log))
    folder, name = resolve_folder(str(path))
    gguf = path if path.is_file() and is_gguf(path) else None
    config = json.loads((Path(folder) / "config.json").read_text())
    return ModelFiles(name=name, gguf=gguf, folder=Path(folder), gguf_type=gguf_type(gguf) if gguf else None,
                      max_position=config.get("max_position_embeddings"))


def _run_workloads(functions: dict, target, cfg: PeersConfig, log, unsupported: dict | None = None) -> dict:
    """Every workload in cfg.workloads on one engine; one that fails is recorded with why, the rest still run."""
    results, errors = {}, dict(unsupported or {})
    for i, name in enumerate(cfg.workloads):
        if name in errors or name not in functions:
            errors.setdefault(name, "not measured for this engine")
            continue
        t0 = time.perf_counter()
        try:
            # the same prompts for every engine: each workload draws from its own seeded source
            results.update(functions[name](target, cfg, TokenSource(cfg.seed * 100 + i), log))
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"  {name} failed: {errors[name]}\n{traceback.format_exc(limit=2)}")
        log(f"  {name}: {time.perf_counter() - t0:.0f} s")
    return {"results": results, "unsupported": errors}


def run_server_peer(name: str, files: ModelFiles, cfg: PeersConfig, logs: Path, log) -> dict:
    from kvtool.bench.backends import first_model, open_client

    peer = PEERS[name]
    opts = PeerOptions(threads=cfg.threads, context=cfg.context(), streams=max(cfg.streams),
                       vllm_python=cfg.vllm_python, vllm_dtype=cfg.vllm_dtype)
    row = {"engine": peer.engine, "weights": peer.weights(files, opts)}
    port = free_port()
    try:
        argv, env = peer.command(files, port, opts)
    except PeerError as exc:
        log(f"{name}: {exc}")
        return {**row, "status": "missing" if exc.missing else "failed", "reason": str(exc)}
    row["command"] = " ".join(argv)
    server = ServerProcess(name, argv, port, logs / f"{name}.log", env, peer.startup_s, log_fn=log)
    try:
        with server as url:
            base, client = open_client(url, connections=max(cfg.streams) + 4)
            with client:
                ep = Endpoint(client, base, first_model(client, base))
                row.update(_run_workloads(WORKLOADS, ep, cfg, log))
    except PeerError as exc:
        return {**row, "status": "failed", "reason": str(exc)}
    row.update(status="ok", startup_s=round(server.startup_ms / 1000.0, 1), log=str(server.log))
    return row


def run_transformers(files: ModelFiles, cfg: PeersConfig, log) -> dict:
    from kvtool.bench.peers import inprocess

    row = {"engine": "transformers (in process)", "weights": "fp32 dense (HF folder from the GGUF)"}
    hf = inprocess.load_hf(files.folder, cfg.threads)
    try:
        row.update(_run_workloads(inprocess.WORKLOADS, hf, cfg, log, inprocess.UNSUPPORTED))
    finally:
        del hf
    return {**row, "status": "ok"}


def run_peers(cfg: PeersConfig | None = None, log=lambda s: print(s, file=sys.stderr, flush=True),
              command: str | None = None) -> dict:
    """Run every engine in cfg.engines through cfg.workloads; write the report (report.md, report.json, PNGs)
    and return its record (also printed as the last stdout line)."""
    from kvtool.bench.peers.report import write_report
    from kvtool.bench.protocol import versions

    cfg = (cfg or PeersConfig()).validate()
    sized = cfg.sized()
    files = model_files(cfg.model, log)
    slug = "".join(c if c.isalnum() else "-" for c in files.name.lower()).strip("-")
    out_dir = Path(cfg.out_dir or f"benchmarks/results/peers-{slug}{'-quick' if cfg.quick else ''}")
    engines, seconds = {}, {}
    record = {"benchmark": "peers", "model": files.name, "gguf": str(files.gguf) if files.gguf else None,
              "gguf_type": files.gguf_type, "folder": str(files.folder), "device": _cpu_name(),
              "threads": sized.threads, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": command or f"run_peers({cfg!r})", "config": asdict(sized), "engines": engines,
              "seconds": seconds, "versions": versions()}
    for i, name in enumerate(cfg.engines, start=1):
        log(f"\n[{i}/{len(cfg.engines)}] {name}")
        t0, load0 = time.perf_counter(), os.getloadavg()
        try:
            engines[name] = run_transformers(files, sized, log) if name == "transformers" else \
                run_server_peer(name, files, sized, out_dir / "logs", log)
        except Exception as exc:  # recorded; the other engines still run
            engines[name] = {"engine": name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            log(f"{name} failed: {engines[name]['reason']}\n{traceback.format_exc(limit=3)}")
        seconds[name] = round(time.perf_counter() - t0, 1)
        # what else ran on the machine meanwhile: the 1-minute load average when this engine started and ended
        engines[name]["load_avg"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
        if i < len(cfg.engines):  # the engines so far, in case the run is stopped before the last one
            record["unfinished"] = cfg.engines[i:]
            write_report(record, out_dir, log, quiet=True)
    record.pop("unfinished", None)
    write_report(record, out_dir, log)
    return record


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            name = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), None)
    except OSError:
        name = None
    return f"{name or platform.processor() or platform.machine()} CPU x{os.cpu_count()} cores"
