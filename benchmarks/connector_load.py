"""What writing supplied KV costs: kvtool's connector in a plain vLLM server with each `load` setting, `sync` (the
run written into the request's pages before the step's forward), `async` (a loader thread writes it beside the
steps; the request waits in vLLM's WAITING_FOR_REMOTE_KVS) and the default `auto` (sync on an idle server, async
while other requests run). Run it in the vLLM environment:

    .venv-vllm/bin/python benchmarks/connector_load.py --out benchmarks/results/connector-load-cpu-smollm2.json

Per server, composed requests (a shared system prompt, then 2-4 mounted skills in a random order, then a
question; the skill library of benchmarks/skills_vllm.py) are sent one after another: the first half on the idle
server, the second while --streams streaming completions decode --stream-tokens tokens each (ignore_eos).
Measured: the composed requests' TTFT (one-token completions: p50, p90) idle and busy, the streams' inter-token
gaps while the busy half arrives (TPOT: p50, p90, max), and the connector's own load time
(vllm:kvtool_load_ms_total) per composed request. The modes alternate over --rounds servers each
(benchmarks/vllm_standalone.py: vLLM's default multiprocessing, each server a block store of its own); the figures
are medians over rounds, and each mode's are divided by auto's (above 1: auto is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, percentile, versions  # noqa: E402

MODES = ("sync", "async", "auto")
STREAM_TEXT = "Write a long, detailed report on the history of the harbour, its ships and its trade routes. "


def stream(url: str, prompt: str, tokens: int, gaps: list[float], stop: threading.Event) -> None:
    """One streaming completion, its inter-token gaps (ms) appended to `gaps`; again until `stop` is set."""
    import json

    import httpx

    while not stop.is_set():
        body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                "stream": True}
        last = None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not json.loads(line[6:])["choices"][0]["text"] and last is not None:
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now - last) * 1000.0)
                last = now


def metric_total(text: str, name: str) -> float:
    """A counter's value in Prometheus text, summed over its label sets."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))


def load_ms(url: str) -> float:
    import httpx

    return metric_total(httpx.get(url + "/metrics", timeout=60).text, "vllm:kvtool_load_ms_total")


FIGURES = ("idle_ttft_ms_p50", "idle_ttft_ms_p90", "ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90",
           "tpot_ms_max", "idle_load_ms_per_request", "load_ms_per_request", "load_share_of_ttft")


def summarize(runs: list[dict]) -> dict:
    """Each mode's medians over its runs (with the spread of the p90s), and each mode over auto (above 1: auto is
    faster)."""
    out = {}
    for mode in MODES:
        mine = [x for x in runs if x["mode"] == mode]
        out[mode] = {k: round(statistics.median(x[k] for x in mine), 4) for k in FIGURES}
        out[mode]["spread"] = {k: [min(x[k] for x in mine), max(x[k] for x in mine)]
                               for k in ("idle_ttft_ms_p90", "ttft_ms_p90", "tpot_ms_p90")}
    out["ratios_over_auto"] = {mode: {k: round(out[mode][k] / out["auto"][k], 3) for k in FIGURES[:7]}
                               for mode in MODES if mode != "auto"}
    return out


def composed(url: str, prompts) -> tuple[list[float], int, float]:
    """(TTFTs in ms, how many were composed, the connector's load ms) of the prompts sent one after another."""
    from vllm_standalone import account, complete

    ttft, count, loaded0 = [], 0, load_ms(url)
    for ids in prompts:
        ms, out = complete(url, ids)
        ttft.append(ms)
        count += int(bool((account(out) or {}).get("block_tokens")))
    return ttft, count, load_ms(url) - loaded0


def one_server(folder: str, mode: str, blocks: list[str], prompts, warmup, args, tmp: Path, tag: str) -> dict:
    """The first half of the prompts on the idle server, the second while --streams streams decode."""
    from vllm_standalone import complete, start

    extra = {"blocks": blocks, "kv_store": str(tmp / f"kv-store-{tag}"), "skill_min_tokens": args.min_tokens,
             "load": mode}
    server = start(folder, tmp / f"vllm-{tag}.log", True, extra, name=f"vllm load={mode}")
    half = len(prompts) // 2
    try:
        complete(server.url, warmup)
        idle, idle_composed, idle_loaded = composed(server.url, prompts[:half])
        gaps, stop = [], threading.Event()
        threads = [threading.Thread(target=stream, args=(server.url, f"Stream {i}. " + STREAM_TEXT * 8,
                                                          args.stream_tokens, gaps, stop), daemon=True)
                   for i in range(args.streams)]
        for t in threads:
            t.start()
        while len(gaps) < args.streams * 4:  # every stream decoding before the first composed request
            time.sleep(0.05)
        before = len(gaps)
        ttft, busy_composed, loaded = composed(server.url, prompts[half:])
        during = gaps[before:]
        stop.set()
        for t in threads:
            t.join(timeout=1800)
    finally:
        server.stop()
    return {"mode": mode, "idle_ttft_ms_p50": round(percentile(idle, 50), 1),
            "idle_ttft_ms_p90": round(percentile(idle, 90), 1),
            "idle_load_ms_per_request": round(idle_loaded / max(1, half), 1),
            "ttft_ms_p50": round(percentile(ttft, 50), 1), "ttft_ms_p90": round(percentile(ttft, 90), 1),
            "tpot_ms_p50": round(percentile(during, 50), 1), "tpot_ms_p90": round(percentile(during, 90), 1),
            "tpot_ms_max": round(max(during), 1), "stream_tokens": len(during),
            "composed": idle_composed + busy_composed, "load_ms_per_request": round(loaded / max(1, len(ttft)), 1),
            "load_share_of_ttft": round(loaded / sum(ttft), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen25"])
    ap.add_argument("--requests", type=int, default=24, help="composed requests per server (half on the idle server)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="servers per mode, the modes alternating")
    ap.add_argument("--generated", type=int, default=12, help="generated skills beside the 4 examples")
    ap.add_argument("--skill-words", type=int, default=96)
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from skills_vllm import library, requests, warmup_prompt
    from vllm_standalone import describe

    from kvtool.models.loading import load, resolve_folder
    from kvtool.skills.catalog import load_catalog
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    command = " ".join(["python", "benchmarks/connector_load.py", *(sys.argv[1:] if argv is None else argv)])
    record = {"benchmark": "connector_load", "command": command, "loadavg_start": os.getloadavg(),
              "model": args.model, "vllm": describe(), "versions": versions(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = library(tmp, args.generated, args.skill_words, args.seed)
        gguf = smollm2_gguf() if args.model == "smollm2" else qwen25_gguf()
        model = load(str(gguf), device="cpu", dtype="float32", progress=False)
        catalog = load_catalog(folder, model, cache_dir=tmp / "kvb", preamble="none", log=lambda m: None)
        prompts, warmup = requests(model, catalog, args.requests, args.seed), warmup_prompt(model, catalog)
        blocks, hf = [str(catalog.paths[n]) for n in catalog.names()], str(resolve_folder(str(gguf))[0])
        del model
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # alternating: sync async auto auto async sync
                run = one_server(hf, mode, blocks, prompts, warmup, args, tmp, f"{mode}-{r}")
                run["round"], run["loadavg"] = r, os.getloadavg()
                record["runs"].append(run)
                print(run, file=sys.stderr, flush=True)
    record.update(summarize(record["runs"]))
    record["loadavg_end"] = os.getloadavg()
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
