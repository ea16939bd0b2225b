"""JSON mode: what constraining each token costs, free text beside it, at batch 1 and with 8 streams.

    python benchmarks/json_mode.py                          # SmolLM2 and Qwen2.5, batch 1 and 8 streams
    python benchmarks/json_mode.py --models smollm2 --repeats 5 --out benchmarks/results/json_mode-cpu.json
    python benchmarks/json_mode.py --sampler-only             # the sampling step alone, no decode in the figure

Every request asks for a JSON object with named fields; each runs as free text and in JSON schema mode
(those fields, all required, no others), greedy, the same prompts side by side. Batch 1 runs the requests one
at a time through Engine.generate, the modes alternating request by request; 8 streams runs all eight
requests together through the engine's BatchScheduler, the modes alternating repeat by repeat.
Reports, per model, path and mode, milliseconds per generated token, median and spread: at batch 1 decode time
over tokens after the first; with 8 streams the time of each step in which all 8 decode, over 8 (and, as
run_ms_per_token, decode time over tokens of the whole run, which also counts the later steps that fewer
streams share once some answers have ended); the answers that stopped by themselves as one JSON object and those
that fit the schema (jsonschema), and the constrained/free-text cost ratio: at batch 1 of the medians, with 8
streams the median over the repeats of each repeat's ratio, its two modes having run back to back (the ratio of
the pooled medians is kept as overhead_pooled). --sampler-only times just the
sampling step, free vs constrained, for one stream and for 8 (batched where the code allows), on the logits of
one teacher-forced pass over a schema-valid answer, and sets the difference against one decode forward. JSON
record last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtool.bench.protocol import summary, versions  # noqa: E402

S, I = {"type": "string"}, {"type": "integer"}
REQUESTS = [
    ("Describe a cat as JSON with fields name, age and colour.", {"name": S, "age": I, "colour": S}),
    ("Give a book as JSON with title, author and year.", {"title": S, "author": S, "year": I}),
    ("Return JSON for a city: name, country, population.", {"name": S, "country": S, "population": I}),
    ("Make a JSON todo item with task, done (boolean) and priority.",
     {"task": S, "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}}),
    ("Output a JSON user profile with username and a list of hobbies.",
     {"username": S, "hobbies": {"type": "array", "items": S}}),
    ("Give the weather as JSON: city, temperature in C, conditions.", {"city": S, "temperature": I, "conditions": S}),
    ("A JSON recipe with name, minutes and ingredients (a list).",
     {"name": S, "minutes": I, "ingredients": {"type": "array", "items": S}}),
    ("Write a JSON product with name, price and in_stock.",
     {"name": S, "price": {"type": "number"}, "in_stock": {"type": "boolean"}}),
]
MODES = ("text", "json_schema")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,qwen25", help="comma-separated: smollm2, qwen25, or GGUF paths")
    p.add_argument("--repeats", type=int, default=3, help="runs of the 8 requests per mode and path")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--sampler-only", action="store_true",
                   help="time only the sampling step (free vs constrained) on logits from one forward pass")
    p.add_argument("--label", default="", help="a name for this code version in the record (e.g. the commit)")
    p.add_argument("--out", default=None, help="also write the JSON record here")
    return p.parse_args(argv)


def schema_of(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def check(gen, schema: dict) -> tuple[bool, bool]:
    """(the answer stopped by itself and is one JSON object, that object also fits the schema)."""
    import jsonschema

    try:
        obj = json.loads(gen.text) if gen.finish_reason == "stop" else None
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        return False, False
    return True, jsonschema.Draft202012Validator(schema).is_valid(obj)


def model_path(name: str) -> str:
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    return str({"smollm2": smollm2_gguf, "qwen25": qwen25_gguf}[name]()) if name in ("smollm2", "qwen25") else name


def params_for(mode: str, props: dict, max_tokens: int):
    import kvtool

    schema = schema_of(props) if mode == "json_schema" else None
    return kvtool.SamplingParams(temperature=0.0, max_tokens=max_tokens, response_format=mode, json_schema=schema)


def bench_model(name: str, args) -> dict:
    import kvtool
    from kvtool.engine import Engine

    model = kvtool.load(model_path(name))
    engine = Engine(model)
    prompts = [model.encode_chat([{"role": "user", "content": q}]) for q, _ in REQUESTS]
    engine.generate(prompts[0], params_for("json_schema", REQUESTS[0][1], 4)).run()  # warm-up, untimed
    engine.generate_batch(prompts, [params_for(m, p, 4) for m, (_, p) in zip(MODES * 4, REQUESTS)])
    out = {}
    for path in ("batch1", "streams8"):
        ms = {m: [] for m in MODES}
        run_ms = {m: [] for m in MODES}  # 8 streams: decode time over tokens of the whole run, as streams thin out
        per_repeat = {m: [] for m in MODES}  # 8 streams: each repeat's median full-batch step, per token
        ok = {m: [0, 0, 0] for m in MODES}  # requests, JSON objects, fit the schema
        for rep in range(args.repeats):
            print(f"{name} {path} repeat {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                if path == "batch1":
                    for prompt, (_, props) in zip(prompts, REQUESTS):
                        t0 = time.perf_counter()
                        gen = engine.generate(prompt, params_for(mode, props, args.max_tokens)).run()
                        decode_s = time.perf_counter() - t0 - gen.timings.ttft_ms / 1000.0
                        if len(gen.token_ids) > 1:
                            ms[mode].append(1000.0 * decode_s / (len(gen.token_ids) - 1))
                        tally(ok[mode], gen, props)
                else:
                    t0 = time.perf_counter()
                    params = [params_for(mode, p, args.max_tokens) for _, p in REQUESTS]
                    gens, steps = full_steps(engine, prompts, params)
                    wall = time.perf_counter() - t0
                    ms[mode] += [1000.0 * t / len(prompts) for t in steps]
                    per_repeat[mode].append(statistics.median(steps) * 1000.0 / len(prompts) if steps else None)
                    first = max(g.timings.ttft_ms for g in gens) / 1000.0  # every stream has started by then
                    after = sum(max(len(g.token_ids) - 1, 0) for g in gens)
                    run_ms[mode].append(1000.0 * (wall - first) / after if after else float("nan"))
                    for g, (_, props) in zip(gens, REQUESTS):
                        tally(ok[mode], g, props)
        rows = {m: {"requests": ok[m][0], "json_objects": ok[m][1], "fit_schema": ok[m][2],
                    "ms_per_token": summary(ms[m])} for m in MODES}
        if path == "streams8":
            for m in MODES:
                rows[m]["run_ms_per_token"] = summary(run_ms[m])
        rows["overhead"] = round(rows["json_schema"]["ms_per_token"]["median"] /
                                 rows["text"]["ms_per_token"]["median"] - 1.0, 3)
        if path == "streams8":  # the two modes of one repeat ran back to back: their ratio, over the repeats
            rows["overhead_pooled"] = rows["overhead"]
            rows["overhead_per_repeat"] = [round(j / t - 1.0, 3) for j, t in zip(per_repeat["json_schema"],
                                                                                   per_repeat["text"]) if j and t]
            if rows["overhead_per_repeat"]:
                rows["overhead"] = statistics.median(rows["overhead_per_repeat"])
        out[path] = rows
        for m in MODES:
            t = rows[m]["ms_per_token"]
            print(f"{name:<8} {path:<9} {m:<12} {t['median']:.2f} ms/token ({t['min']:.2f}-{t['max']:.2f})  "
                  f"JSON objects {rows[m]['json_objects']}/{rows[m]['requests']}, fit {rows[m]['fit_schema']}")
        print(f"{name:<8} {path:<9} overhead {100 * rows['overhead']:+.1f}%")
    return {"model": model.name, "device": model.info.get("device"), "dtype": model.info.get("dtype"), **out}


def sampler_cost(name: str, args) -> dict:
    """ms per token of the sampling step alone, free text vs JSON schema mode, on the logits a teacher-forced
    forward pass gives for a schema-valid answer (no decode time in the figure), and one decode forward's ms."""
    import torch

    import kvtool
    from kvtool.engine import Engine
    from kvtool.engine.sampling import Sampler

    model = kvtool.load(model_path(name))
    engine = Engine(model)
    props = REQUESTS[0][1]
    answer = json.dumps({"name": "Whiskers the very fluffy cat", "age": 7, "colour": "orange and white"})
    prompt = model.encode_chat([{"role": "user", "content": REQUESTS[0][0]}])
    ids = prompt + model.tokenizer.encode(answer, add_special_tokens=False)
    cache = engine.runner.new_cache(len(ids) + 8)
    with torch.inference_mode():
        rows = [engine.runner.forward(torch.tensor(ids[:len(prompt)]), cache).reshape(-1)]
        t0 = time.perf_counter()
        for t in ids[len(prompt):]:
            rows.append(engine.runner.forward(torch.tensor([t]), cache).reshape(-1))
        forward_ms = 1000.0 * (time.perf_counter() - t0) / (len(ids) - len(prompt))
    ms = {m: [] for m in MODES}
    for rep in range(args.repeats * 3):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            params = params_for(mode, props, 256).validate()
            sampler = Sampler(params, engine.runner.spec.vocab_size, prompt, engine.runner.device)
            sampler.constraint = engine.constraint(params, engine.stop_ids(params))
            for row in rows:
                t0 = time.perf_counter()
                token = sampler(row).token
                sampler.observe(token)
                ms[mode].append(1000.0 * (time.perf_counter() - t0))
                if token in engine.end_of_turn:
                    break
    from kvtool.engine.batch_sampling import batchable, sample_rows

    steps = {m: [] for m in MODES}  # 8 streams: one sampling step for all of them (batched where allowed)
    for rep in range(args.repeats * 3):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            params = params_for(mode, props, 256).validate()
            samplers = [Sampler(params, engine.runner.spec.vocab_size, prompt, engine.runner.device) for _ in range(8)]
            for sampler in samplers:
                sampler.constraint = engine.constraint(params, engine.stop_ids(params))
            for row in rows[:-1]:
                stacked = row.reshape(1, -1).expand(8, -1)
                t0 = time.perf_counter()
                if all(batchable(x) for x in samplers):
                    tokens = [x.token for x in sample_rows(samplers, stacked)]
                else:  # a request that cannot join the batched draw samples alone
                    tokens = [x(r).token for x, r in zip(samplers, stacked)]
                for x, t in zip(samplers, tokens):
                    x.observe(t)
                steps[mode].append(1000.0 * (time.perf_counter() - t0))
                if any(t in engine.end_of_turn for t in tokens):
                    break
    out = {m: summary(v) for m, v in ms.items()}
    out["streams8_step"] = {m: summary(v) for m, v in steps.items()}
    out["forward_ms"] = round(forward_ms, 3)
    out["overhead_vs_decode"] = round((out["json_schema"]["median"] - out["text"]["median"]) / forward_ms, 4)
    print(f"{name:<8} sampler text {out['text']['median']:.3f} ms, json_schema {out['json_schema']['median']:.3f} ms, "
          f"decode forward {forward_ms:.1f} ms: overhead {100 * out['overhead_vs_decode']:+.2f}% of a token")
    return {"model": model.name, **out}


def full_steps(engine, prompts, params) -> tuple[list, list[float]]:
    """The requests run together through the engine's scheduler: (their Generations, seconds of every step in which
    all of them decoded one token each). Those steps compare the modes at a full batch of 8; once the answers
    of one mode end earlier, fewer rows share each later step and its cost per token rises for that reason alone."""
    sched, gens = engine.scheduler, []
    for ids, p in zip(prompts, params):
        gen, max_tokens = engine.new_generation(ids, p)
        sched.add(gen, max_tokens)
        gens.append(gen)
    steps = []
    while any(g.finish_reason is None for g in gens):
        everyone = all(g.finish_reason is None for g in gens)
        t0 = time.perf_counter()
        ran = sched.step()  # tokens run this step: one per stream when all decode
        if everyone and ran == len(gens) and all(g.token_ids for g in gens):
            steps.append(time.perf_counter() - t0)
    return gens, steps


def tally(counts: list, gen, props: dict) -> None:
    p, f = check(gen, schema_of(props))
    counts[0] += 1
    counts[1] += p
    counts[2] += f


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    record = {"benchmark": "json_mode", "label": args.label, "temperature": 0.0, "repeats": args.repeats,
              "max_tokens": args.max_tokens, "streams": 8, "models": {}}
    for name in args.models.split(","):
        record["models"][name] = sampler_cost(name, args) if args.sampler_only else bench_model(name, args)
        record.update(loadavg={"before": load_before, "after": os.getloadavg()}, versions=versions())
        if args.out:  # after each model, so a long run keeps what it measured
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
