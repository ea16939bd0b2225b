"""The server's own cost per token: one greedy request's TPOT through `kvtool serve` and through Engine.generate
in this process, the same weights, threads and prompt, at each context length.

    python benchmarks/server_cost.py --model smollm2 --threads 1 --contexts 32 512 --tokens 128 --repeats 5
    python benchmarks/server_cost.py --model qwen25 --out benchmarks/results/server-cost-cpu-qwen25.json

Each repeat draws a fresh random prompt of each context length and sends it to both sides back to back (which
goes first alternates repeat by repeat), ignore_eos, so both decode the same number of tokens from the same
context. Three TPOT figures per request, all over the tokens after the first:
  - in process: the times Engine.generate hands out each token (what a Python caller sees);
  - server engine: the server's own `timings` (decode_ms over decode_tokens - 1: its scheduler and forward);
  - server client: the times this client reads each SSE chunk (what an OpenAI client sees).
server client / in process is the server's cost per token; server engine / in process splits it into the engine
running inside the server (threads, the worker, the scheduler's batch path) and the path from engine to client
(detokenizing, JSON, SSE, HTTP). Reports median and spread of each and of the per-repeat ratios, the load
average before and after; JSON record last.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtool.bench.protocol import emit, summary, versions  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2, qwen25, a GGUF file or an HF folder")
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side (default: %(default)s)")
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 512], help="prompt tokens")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON record here")
    args = p.parse_args(argv)
    if args.threads < 1 or args.tokens < 3 or args.repeats < 1 or min(args.contexts) < 1:
        p.error("--threads, --repeats and every --contexts value must be at least 1, --tokens at least 3")
    return args


def tpot(times_ms: list[float]) -> float:
    """Milliseconds per token between the first token's time and the last one's."""
    if len(times_ms) < 2:
        raise RuntimeError(f"{len(times_ms)} token times: a TPOT needs at least two")
    return (times_ms[-1] - times_ms[0]) / (len(times_ms) - 1)


def in_process(engine, prompt: list[int], tokens: int) -> dict:
    from kvtool.config import SamplingParams

    gen = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    t0, times = time.perf_counter(), []
    for _ in gen:
        times.append((time.perf_counter() - t0) * 1000.0)
    if len(times) != tokens:
        raise RuntimeError(f"in process: {len(times)} tokens for max_tokens={tokens} with ignore_eos")
    return {"client": tpot(times), "tokens": len(times)}


def served(ep, prompt: list[int], tokens: int) -> dict:
    from kvtool.bench.peers.workloads import complete, decode_rate

    res = complete(ep, prompt, tokens)
    timings = res.get("timings") or {}
    if res["tokens"] != tokens:
        raise RuntimeError(f"the server generated {res['tokens']} tokens for max_tokens={tokens} with ignore_eos")
    # a token whose text ends inside a character streams with the next one: fewer chunks than tokens, and
    # decode_rate counts the chunks' share of the tokens (one chunk per token: tpot() of the chunk times)
    out = {"client": 1000.0 / decode_rate(res), "tokens": res["tokens"]}
    if timings.get("decode_tokens", 0) > 1 and timings.get("decode_ms"):
        out["engine"] = timings["decode_ms"] / (timings["decode_tokens"] - 1)
    return out


def run(args) -> dict:
    import torch

    from kvtool.bench.backends import first_model, open_client
    from kvtool.bench.peers.engines import PEERS, PeerOptions
    from kvtool.bench.peers.harness import model_files
    from kvtool.bench.peers.servers import ServerProcess, free_port
    from kvtool.bench.peers.workloads import Endpoint, TokenSource
    from kvtool.config import EngineConfig
    from kvtool.engine.engine import Engine
    from kvtool.models.loading import load

    def log(s):
        print(s, file=sys.stderr, flush=True)

    torch.set_num_threads(args.threads)
    files = model_files(args.model, log)
    context = max(args.contexts) + args.tokens + 64
    opts = PeerOptions(threads=args.threads, context=context, streams=1)
    port = free_port()
    argv, env = PEERS["kvtool"].command(files, port, opts)
    log(f"in process: loading {files.folder}")
    engine = Engine(load(str(files.folder), device="cpu", dtype="float32", weights="dense"), EngineConfig())
    load_before = os.getloadavg()[0]
    rows = {n: {"in_process": [], "server_engine": [], "server_client": []} for n in args.contexts}
    with ServerProcess("kvtool serve", argv, port, Path(tempfile.gettempdir()) / f"server-cost-{port}.log", env,
                       log_fn=log) as url:
        base, client = open_client(url, connections=2)
        with client:
            ep = Endpoint(client, base, first_model(client, base))
            prompts = TokenSource(args.seed)
            for i in range(args.warmup + args.repeats):
                for n in args.contexts:
                    prompt = prompts(n)
                    sides = [("in", lambda: in_process(engine, prompt, args.tokens)),
                             ("server", lambda: served(ep, prompt, args.tokens))]
                    got = dict((name, fn()) for name, fn in (sides if i % 2 == 0 else sides[::-1]))
                    warm = i < args.warmup
                    log(f"  {n} tokens, run {i + 1}/{args.warmup + args.repeats}{' (warm-up)' if warm else ''}: "
                        f"in process {got['in']['client']:.2f} ms, server engine "
                        f"{got['server'].get('engine', float('nan')):.2f} ms, client {got['server']['client']:.2f} ms")
                    if not warm:
                        rows[n]["in_process"].append(got["in"]["client"])
                        rows[n]["server_client"].append(got["server"]["client"])
                        if "engine" in got["server"]:
                            rows[n]["server_engine"].append(got["server"]["engine"])
    load_after = os.getloadavg()[0]
    results = {}
    for n, r in rows.items():
        res = {k: summary(v) for k, v in r.items() if v}
        pairs = zip(r["server_client"], r["in_process"])
        res["server_over_in_process"] = summary([s / p for s, p in pairs])
        if r["server_engine"]:
            res["server_engine_over_in_process"] = summary([s / p for s, p in zip(r["server_engine"],
                                                                                  r["in_process"])])
            res["server_client_over_engine"] = summary([c / s for c, s in zip(r["server_client"],
                                                                              r["server_engine"])])
        results[str(n)] = res
    return {"benchmark": "server_cost", "model": files.name, "threads": args.threads, "tokens": args.tokens,
            "contexts": args.contexts, "repeats": args.repeats, "device": "cpu", "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": "python benchmarks/server_cost.py " + " ".join(sys.argv[1:]),
            "load": {"before": round(load_before, 2), "after": round(load_after, 2)}, "server": " ".join(argv),
            "versions": versions(), "results": results}


def main(argv=None) -> int:
    args = parse_args(argv)
    record = run(args)
    for n, res in record["results"].items():
        ratio = res["server_over_in_process"]
        print(f"{record['model']} @{n} tokens: TPOT in process {res['in_process']['median']:.2f} ms, server "
              f"{res['server_client']['median']:.2f} ms; server/in process {ratio['median']:.3f} "
              f"({ratio['min']:.3f}-{ratio['max']:.3f})", file=sys.stderr)
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
