"""Cold prefill (TTFT) of kvtool beside vLLM, and beside kvtool as an earlier checkout built it, in one run.

The rows of `kvtool bench engines` (kvtool.bench.engines) without the concurrent streams: decode at batch 1,
cold TTFT at 512 and 2048 tokens, a 2048-token prefix hit. Every engine runs behind `kvtool serve` on the
same model with the same thread count (OMP_NUM_THREADS, which vLLM also takes), runs alternating. With
--baseline, a third server runs the kvtool code found at that path (e.g. a checkout of main), so the
change and its baseline meet the same neighbours. Ratios are run by run (>1: the first engine ahead).
Run it from the vLLM environment; JSON record as the last line.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/venv-vllm/bin/python benchmarks/prefill_engines.py \
        --model smollm2 --baseline /work/main --out benchmarks/results/prefill-engines-cpu-smollm2-1thread.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from kvtool.bench.engines import Client, EnginesBenchConfig, engine_versions, rows
from kvtool.bench.protocol import device_name, emit, paired_speedup
from kvtool.testing.models import qwen25_gguf, smollm2_gguf
from kvtool.testing.server_process import ServerProcess

MODELS = {"smollm2": smollm2_gguf, "qwen25": qwen25_gguf}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, qwen25, or a path kvtool serve takes")
    p.add_argument("--baseline", default=None, help="a checkout whose kvtool runs as the third engine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens of the batch-1 decode row")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = str(MODELS[args.model]()) if args.model in MODELS else args.model
    cfg = EnginesBenchConfig(repeats=args.repeats, decode_tokens=args.decode_tokens, streams=(), out=args.out)
    common = ["--model", model, "--max-active", "8", "--max-queue", "8", "--log-level", "warning"]
    workdir = Path(tempfile.mkdtemp(prefix="kvtool-prefill-engines-"))
    servers = {"kvtool": ServerProcess(common, workdir / "kvtool.log"),
               "vllm": ServerProcess([*common, "--engine", "vllm",
                                      *[a for item in cfg.engine_args for a in ("--engine-arg", item)]],
                                     workdir / "vllm.log")}
    if args.baseline:
        servers["kvtool_baseline"] = ServerProcess(common, workdir / "baseline.log", env={"PYTHONPATH": args.baseline})
    load_before = round(os.getloadavg()[0], 2)
    try:
        for name, srv in servers.items():
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            srv.start()
        results = rows({name: Client(srv.base_url) for name, srv in servers.items()}, cfg)
    finally:
        for srv in servers.values():
            srv.stop()
    pairs = [("kvtool", "vllm")] + ([("kvtool", "kvtool_baseline"), ("kvtool_baseline", "vllm")] if args.baseline
                                    else [])
    ratios = {f"{a}_over_{b}": {name: paired_speedup(row[a], row[b], rate="tok_s" in name)
                                for name, row in results.items() if isinstance(row.get(a), dict)}
              for a, b in pairs}
    record = {"benchmark": "prefill_engines", "model": Path(model).name.removesuffix(".gguf"), "model_path": model,
              "device": device_name(torch.device("cpu")),
              "baseline": args.baseline, "threads": os.environ.get("OMP_NUM_THREADS"),
              "load_avg": {"start": load_before, "end": round(os.getloadavg()[0], 2)},
              "config": asdict(cfg), "results": results, "ratios": ratios, "versions": engine_versions()}
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
