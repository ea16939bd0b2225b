"""N concurrent streaming clients against `kvtool serve` for S seconds: TTFT p50/p99, no corruption.

    python benchmarks/serve_load.py --clients 16 --seconds 60            # in-process, embedded SmolLM2
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 16 --seconds 60

Protocol: solo runs of each prompt first (warm-up and baseline TTFT, and the reference text
every concurrent greedy answer must equal), then the concurrent phase. Prints a table and,
as its last line, one JSON record; --save also writes it to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtool.serving.config import ServerConfig  # noqa: E402
from kvtool.serving.loadtest import run_load  # noqa: E402

SERVER = ServerConfig()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--url", default=None, help="a running server; default: start one in-process")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="in-process model (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-active", type=int, default=SERVER.max_active)
    p.add_argument("--max-queue", type=int, default=SERVER.max_queue)
    p.add_argument("--solo-runs", type=int, default=3, help="repetitions of the solo baseline")
    p.add_argument("--save", action="store_true", help="write the JSON record to benchmarks/results/")
    return p.parse_args(argv)


def run(args, base_url: str, server_info: dict) -> dict:
    rep = asyncio.run(run_load(base_url, args.clients, args.seconds, args.max_tokens, solo_runs=args.solo_runs,
                               api_key=args.api_key))
    record = {"benchmark": "serve_load", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **server_info, **rep.to_dict()}
    rows = [("clients", rep.clients), ("seconds", rep.seconds), ("max_tokens", rep.max_tokens),
            ("requests", rep.requests), ("completed", rep.completed), ("rejected 429/503", rep.rejected),
            ("5xx errors", rep.server_errors), ("other errors", rep.other_errors), ("corrupted", rep.corrupted),
            ("TTFT solo median ms", rep.solo_ttft_ms), ("TTFT p50 ms", rep.ttft_p50_ms),
            ("TTFT p99 ms", rep.ttft_p99_ms), ("TTFT max ms", rep.ttft_max_ms),
            ("request p50 ms", rep.total_p50_ms), ("completion tok/s (all clients)", rep.tokens_per_s)]
    for name, value in rows:
        print(f"{name:<32} {value}")
    for problem in rep.problems:
        print(f"  problem: {problem}")
    if args.save:
        out = ROOT / "benchmarks" / "results" / f"serve_load-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"saved {out}")
    print(json.dumps(record))
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.url:
        run(args, args.url.rstrip("/").removesuffix("/v1"), {"url": args.url})
        return 0
    import kvtool
    from kvtool.models.embedded import smollm2_path
    from kvtool.serving import create_app
    from kvtool.serving.server import BackgroundServer

    model = kvtool.load(args.model or str(smollm2_path()), device=args.device)
    cfg = ServerConfig(max_active=args.max_active, max_queue=args.max_queue)
    info = {"model": model.name, "device": model.info.get("device"), "dtype": model.info.get("dtype"),
            "max_active": cfg.max_active, "max_queue": cfg.max_queue}
    with BackgroundServer(create_app(model, server_config=cfg)) as srv:
        run(args, srv.base_url, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
