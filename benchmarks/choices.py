"""n choices in one request against the same choices as n separate concurrent requests, on `kvtool serve`.

    python benchmarks/choices.py                          # in-process, embedded SmolLM2, n=4, ~1,000-token prompt
    python benchmarks/choices.py --url http://127.0.0.1:8000 --n 4    # any OpenAI-compatible server

One request with n=4 and seed s prefills its prompt once (its choices fork from the first one's
KV); the baseline sends the same four choices as four concurrent streaming requests with seeds
s..s+3, each prefilling the prompt. Both sides run alternately, the prefix cache reset before
each run (POST /v1/cache/reset, where the server has it) so neither reuses the other's KV; the
texts of the two sides must be equal. Reports per side the wall time until every choice is done
and the TTFT of the last choice to start (streaming), median and spread; JSON record last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtool.bench.protocol import repeat_words, summary, versions  # noqa: E402

PARAGRAPH = ("The harbour town wakes before dawn: fishing boats leave one by one, gulls follow them out past the "
             "breakwater, and the market hall fills with crates of ice. ")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=750, help="length of the shared document (~1.3 tokens/word)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--url", default=None, help="a running server; default: start one in-process")
    p.add_argument("--model", default=None, help="in-process model (default: the embedded SmolLM2)")
    p.add_argument("--out", default=None, help="also write the JSON record here")
    return p.parse_args(argv)


def messages(words: int) -> list[dict]:
    text = repeat_words(PARAGRAPH, words)
    return [{"role": "system", "content": "You summarise documents in one sentence."},
            {"role": "user", "content": f"Document:\n{text}\n\nSummarise it."}]


async def stream(client: httpx.AsyncClient, body: dict, t0: float) -> dict:
    """{index: text}, {index: ms to its first content} for one streaming request."""
    text, first = {}, {}
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                content = choice["delta"].get("content")
                if content:
                    first.setdefault(choice["index"], (time.perf_counter() - t0) * 1000.0)
                    text[choice["index"]] = text.get(choice["index"], "") + content
    return {"text": text, "first": first}


async def one_side(client: httpx.AsyncClient, base: dict, n: int, seed: int, together: bool) -> dict:
    await client.post("/v1/cache/reset")  # 404 elsewhere: fine, nothing to reset there
    t0 = time.perf_counter()
    if together:
        outs = [await stream(client, {**base, "n": n, "seed": seed}, t0)]
        texts = [outs[0]["text"].get(i, "") for i in range(n)]
        firsts = list(outs[0]["first"].values())
    else:
        outs = await asyncio.gather(*(stream(client, {**base, "seed": seed + i}, t0) for i in range(n)))
        texts = [o["text"].get(0, "") for o in outs]
        firsts = [o["first"][0] for o in outs if 0 in o["first"]]
    return {"wall_ms": (time.perf_counter() - t0) * 1000.0, "last_ttft_ms": max(firsts), "texts": texts}


async def run(args, base_url: str) -> dict:
    base = {"messages": messages(args.prompt_words), "max_tokens": args.max_tokens, "temperature": 0.8}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        prompt_tokens = (await client.post("/tokenize", json={"messages": base["messages"]})).json().get("count")
        sides = {"n in one request": True, "n separate requests": False}
        runs = {name: [] for name in sides}
        await one_side(client, base, args.n, args.seed, True)  # warm-up
        for r in range(args.repeats):
            print(f"round {r + 1}/{args.repeats}", file=sys.stderr, flush=True)
            for name, together in sides.items():
                runs[name].append(await one_side(client, base, args.n, args.seed, together))
    same = all(a["texts"] == b["texts"] for a, b in zip(*runs.values()))
    result = {name: {"wall_ms": summary([x["wall_ms"] for x in rs]),
                     "last_ttft_ms": summary([x["last_ttft_ms"] for x in rs])} for name, rs in runs.items()}
    one, sep = result["n in one request"], result["n separate requests"]
    return {"benchmark": "choices", "n": args.n, "prompt_tokens": prompt_tokens, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "results": result, "same_texts": same,
            "speedup_wall": round(sep["wall_ms"]["median"] / one["wall_ms"]["median"], 3),
            "speedup_last_ttft": round(sep["last_ttft_ms"]["median"] / one["last_ttft_ms"]["median"], 3)}


def main(argv=None) -> int:
    args = parse_args(argv)
    info: dict = {"url": args.url} if args.url else {}
    if args.url:
        record = asyncio.run(run(args, args.url.rstrip("/").removesuffix("/v1")))
    else:
        import kvtool
        from kvtool.models.embedded import smollm2_path
        from kvtool.serving import create_app
        from kvtool.serving.server import BackgroundServer

        model = kvtool.load(args.model or str(smollm2_path()))
        info = {"model": model.name, "device": model.info.get("device"), "dtype": model.info.get("dtype")}
        with BackgroundServer(create_app(model)) as srv:
            record = asyncio.run(run(args, srv.base_url))
    record = {**record, **info, "versions": versions()}
    for name, row in record["results"].items():
        print(f"{name:<22} wall {row['wall_ms']['median']:8.0f} ms ({row['wall_ms']['min']:.0f}-"
              f"{row['wall_ms']['max']:.0f})   last TTFT {row['last_ttft_ms']['median']:8.0f} ms")
    print(f"one request is {record['speedup_wall']}x faster to the last token, {record['speedup_last_ttft']}x to the "
          f"last first token; same texts: {record['same_texts']}")
    line = json.dumps(record)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(line)
    return 0 if record["same_texts"] else 1


if __name__ == "__main__":
    sys.exit(main())
