"""`kvtool bench peers`: the same workloads against kvtool serve and the engines users would pick instead
(llama.cpp's llama-server on the GGUF itself, vLLM on the HF folder kvtool made of it), plus transformers
in this process, on one model and machine in one run. Each server is started on a free loopback port, waited
for, measured alone (nothing else of this run uses the CPU meanwhile) and stopped before the next one.

Every engine runs once per round, the rounds in alternating order (rounds.alternating_order); each figure of
the record is the median over the rounds with their min and max, and the machine's load is sampled throughout
(the record is quiet only when it never passed the core count).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

from kvtool.bench.peers.config import WORKLOAD_NAMES, PeersConfig
from kvtool.bench.peers.engines import PEERS, ModelFiles, PeerOptions, gguf_type
from kvtool.bench.peers.rounds import LoadMonitor, alternating_order, combine, load_summary, set_phase, settle
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
    results, errors = {}, {k: v for k, v in (unsupported or {}).items() if k in cfg.workloads}
    for name in sorted(cfg.workloads, key=WORKLOAD_NAMES.index):  # memory first: after one request
        if name in errors or name not in functions:
            errors.setdefault(name, "not measured for this engine")
            continue
        set_phase(name)
        t0 = time.perf_counter()
        try:
            # the same prompts for every engine and round: each workload draws from its own seeded source
            seed = cfg.seed * 100 + WORKLOAD_NAMES.index(name)
            results.update(functions[name](target, cfg, TokenSource(seed), log))
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"  {name} failed: {errors[name]}\n{traceback.format_exc(limit=2)}")
        log(f"  {name}: {time.perf_counter() - t0:.0f} s")
    return {"results": results, "unsupported": errors}


def run_server_peer(name: str, files: ModelFiles, cfg: PeersConfig, out_dir: Path, log, label: str = "") -> dict:
    """One server peer through cfg's workloads, its scratch folder (the files it keeps) removed once it stops."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"kvtool-peer-{name}-") as scratch:
        return _serve_peer(name, files, cfg, out_dir, log, label or name, scratch)


def _serve_peer(name: str, files: ModelFiles, cfg: PeersConfig, out_dir: Path, log, label: str, scratch: str) -> dict:
    from kvtool.bench.backends import first_model, open_client

    peer = PEERS[name]
    opts = PeerOptions(threads=cfg.pass_threads(), context=cfg.context(), streams=cfg.concurrency(),
                       vllm_python=cfg.vllm_python, vllm_dtype=cfg.vllm_dtype, kv_mib=cfg.kv_mib,
                       prefix_cache_mib=cfg.prefix_cache_mib, scratch=scratch)
    row = {"engine": peer.engine, "weights": peer.weights(files, opts), "precision": peer.precision(files, opts),
           "budgets": peer.budgets(opts), **({"alone": peer.alone} if peer.alone else {})}
    port = free_port()
    try:
        argv, env = peer.command(files, port, opts)
    except PeerError as exc:
        log(f"{name}: {exc}")
        return {**row, "status": "missing" if exc.missing else "failed", "reason": str(exc)}
    row["command"] = " ".join(argv)
    server = ServerProcess(name, argv, port, out_dir / "logs" / f"{label}.log", env, peer.startup_s, log_fn=log)
    try:
        with server as url:
            base, client = open_client(url, connections=cfg.concurrency() + 4)
            with client:
                ep = Endpoint(client, base, first_model(client, base), pid=server.proc.pid, folder=str(files.folder),
                              out_dir=str(out_dir), label=label)
                row.update(_run_workloads(WORKLOADS, ep, cfg, log))
    except PeerError as exc:
        return {**row, "status": "failed", "reason": str(exc)}
    row.update(status="ok", startup_s=round(server.startup_ms / 1000.0, 1), log=str(server.log))
    return row


def run_transformers(files: ModelFiles, cfg: PeersConfig, log) -> dict:
    from kvtool.bench.peers import inprocess

    row = {"engine": "transformers (in process)", "weights": "fp32 dense (HF folder from the GGUF)",
           "precision": "fp32"}
    hf = inprocess.load_hf(files.folder, cfg.pass_threads())
    try:
        row.update(_run_workloads(inprocess.WORKLOADS, hf, cfg, log, inprocess.UNSUPPORTED))
    finally:
        del hf
    return {**row, "status": "ok"}


def engine_row(runs: list[dict]) -> dict:
    """One engine's entry of the record from its runs (one per round): the median of the runs that worked, the
    spread of every figure, the load while it ran, and each run as it was."""
    ok = [r for r in runs if r["status"] == "ok"]
    last = ok[-1] if ok else runs[-1]
    row = {k: last[k] for k in ("engine", "weights", "precision", "budgets", "command", "reason", "alone")
           if k in last}
    row["status"] = "ok" if ok else last["status"]
    row["results"], row["spread"] = combine([r.get("results") or {} for r in ok])
    row["unsupported"] = {k: v for r in ok for k, v in (r.get("unsupported") or {}).items()
                          if k not in row["results"]}
    startups = [r["startup_s"] for r in ok if r.get("startup_s") is not None]
    if startups:
        row["startup_s"] = statistics.median(startups)
    loads = [x for r in runs for x in (r["load"]["min"], r["load"]["max"]) if x is not None]
    row["load_avg"] = [min(loads), max(loads)] if loads else []  # the lowest and highest sample over its runs
    row["rounds"] = len(ok)
    row["runs"] = [{k: r.get(k) for k in ("round", "status", "reason", "startup_s", "seconds", "settle", "load",
                                          "results")
                    if r.get(k) is not None} for r in runs]
    return row


def run_peers(cfg: PeersConfig | None = None, log=lambda s: print(s, file=sys.stderr, flush=True),
              command: str | None = None) -> list[dict]:
    """Run every engine in cfg.engines through cfg.workloads, once per thread count in cfg.threads (a pass: every
    engine given that count), each pass cfg.rounds times in alternating order. Each pass writes its own report
    (report.md, report.json, PNGs) in the out folder, or in <out folder>-<N>threads when there are several counts,
    and prints its record as a stdout line. Returns the records, one per thread count."""
    cfg = (cfg or PeersConfig()).validate()
    files = model_files(cfg.model, log)
    slug = "".join(c if c.isalnum() else "-" for c in files.name.lower()).strip("-")
    base = cfg.out_dir or f"benchmarks/results/peers-{slug}{'-quick' if cfg.quick else ''}"
    return [run_pass(replace(cfg, threads=[n]), files, Path(base if len(cfg.threads) == 1 else f"{base}-{n}threads"),
                     log, command, thread_counts=cfg.threads) for n in cfg.threads]


def run_pass(cfg: PeersConfig, files: ModelFiles, out_dir: Path, log, command: str | None,
             thread_counts: list[int]) -> dict:
    """Every engine at cfg's one thread count, cfg.rounds times in alternating order; the pass's record."""
    from kvtool.bench.peers.report import write_report
    from kvtool.bench.protocol import versions

    sized = cfg.sized()
    order = alternating_order(cfg.engines, sized.rounds)
    engines, seconds, runs, samples, phases, others = {}, {}, {name: [] for name in cfg.engines}, [], [], []
    record = {"benchmark": "peers", "model": files.name, "gguf": str(files.gguf) if files.gguf else None,
              "gguf_type": files.gguf_type, "folder": str(files.folder), "device": _cpu_name(),
              "threads": sized.pass_threads(), "thread_counts": thread_counts,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": command or f"run_peers({cfg!r})", "config": asdict(sized),
              "order": [f"{name} #{r}" for r, name in order], "engines": engines, "seconds": seconds,
              "versions": versions(), "roofline": _roofline(files, sized, log)}
    for i, (rnd, name) in enumerate(order, start=1):
        if any(r["status"] == "missing" for r in runs[name]):
            continue  # not installed: once is enough to say so
        log(f"\n[{i}/{len(order)}] {name}, round {rnd}")
        calm = settle(os.cpu_count() or 1, max_wait_s=sized.settle_max_s, log=log)  # the load left behind decays first
        t0 = time.perf_counter()
        set_phase("start-up")
        with LoadMonitor() as load:
            try:
                run = run_transformers(files, sized, log) if name == "transformers" else \
                    run_server_peer(name, files, sized, out_dir, log, label=f"{name}-round{rnd}")
            except Exception as exc:  # recorded; the other engines still run
                run = {"engine": name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
                log(f"{name} failed: {run['reason']}\n{traceback.format_exc(limit=3)}")
            set_phase("stop")
        run.update(round=rnd, seconds=round(time.perf_counter() - t0, 1), settle=calm,
                   load=load_summary(load.samples, phases=load.phases, others=load.others))
        samples += load.samples
        phases += load.phases
        others += load.others
        runs[name].append(run)
        engines[name] = engine_row(runs[name])
        seconds[name] = round(sum(r["seconds"] for r in runs[name]), 1)
        record["load"] = load_summary(samples, phases=phases, others=others)
        record["quiet"] = record["load"]["quiet"]  # no sample of the 1-minute load above the core count
        if i < len(order):  # the engines so far, in case the run is stopped before the last one
            record["unfinished"] = [f"{n} #{r}" for r, n in order[i:]]
            write_report(record, out_dir, log, quiet=True)
    record.pop("unfinished", None)
    record["roofline"] = _roofline(files, sized, log, record["roofline"])
    write_report(record, out_dir, log)
    return record


def _roofline(files: ModelFiles, cfg: PeersConfig, log, first: dict | None = None) -> dict:
    """The machine at the pass's thread count and each engine's reads (roofline.measure), before any engine runs;
    given the first measurement, the machine probed again after the last engine (roofline.probe_again). A first probe
    that fails is recorded with why, a second one leaves the first as it was; the engines run either way."""
    from kvtool.bench.peers import roofline

    try:
        roof = roofline.measure(files, cfg) if first is None else roofline.probe_again(first, cfg.pass_threads())
    except Exception as exc:
        log(f"roofline not measured: {type(exc).__name__}: {exc}")
        return first or {"error": f"{type(exc).__name__}: {exc}"}
    log(f"the machine: {json.dumps((roof.get('machine') or {}).get('probes', [None])[-1])}")
    return roof


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            name = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), None)
    except OSError:
        name = None
    return f"{name or platform.processor() or platform.machine()} CPU x{os.cpu_count()} cores"
