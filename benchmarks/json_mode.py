"""JSON mode: how often the answer parses, and what constraining each token costs, free text beside it.

    python benchmarks/json_mode.py                        # embedded SmolLM2, 8 requests x 3 seeds per mode
    python benchmarks/json_mode.py --model path/to/model.gguf --seeds 5

Every request asks for a JSON object with named fields; each runs as free text, in JSON mode
(response_format json_object) and in JSON schema mode (those fields, all required, no others),
sampled at temperature 0.7 with the same seeds, one request at a time through the engine. Counts,
per mode, the answers that stop by themselves as one JSON object, and those that also fit the
schema (jsonschema); and the milliseconds per generated token (median and spread over the
requests), the modes alternating request by request; JSON record last.
"""

from __future__ import annotations

import argparse
import json
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    import kvtool
    from kvtool.engine import Engine
    from kvtool.models.embedded import smollm2_path

    model = kvtool.load(args.model or str(smollm2_path()))
    engine = Engine(model)
    modes = ("text", "json_object", "json_schema")
    parsed = {m: [] for m in modes}
    fits = {m: [] for m in modes}
    ms = {m: [] for m in modes}
    engine.constraint(kvtool.SamplingParams(response_format="json_object"), {0})  # decodes the vocabulary, untimed
    for i, (question, props) in enumerate(REQUESTS):
        print(f"request {i + 1}/{len(REQUESTS)}", file=sys.stderr, flush=True)
        prompt = model.encode(model.render([{"role": "user", "content": question}]))
        for seed in range(args.seeds):
            for mode in modes:
                schema = schema_of(props) if mode == "json_schema" else None
                params = kvtool.SamplingParams(temperature=0.7, seed=seed, max_tokens=args.max_tokens,
                                               response_format=mode, json_schema=schema)
                t0 = time.perf_counter()
                gen = engine.generate(prompt, params).run()
                decode_s = time.perf_counter() - t0 - gen.timings.ttft_ms / 1000.0
                p, f = check(gen, schema_of(props))
                parsed[mode].append(p)
                fits[mode].append(f)
                if len(gen.token_ids) > 1:
                    ms[mode].append(1000.0 * decode_s / (len(gen.token_ids) - 1))
    results = {m: {"requests": len(parsed[m]), "json_objects": sum(parsed[m]), "fit_schema": sum(fits[m]),
                   "ms_per_token": summary(ms[m])} for m in modes}
    record = {"benchmark": "json_mode", "model": model.name, "device": model.info.get("device"),
              "dtype": model.info.get("dtype"), "temperature": 0.7, "seeds": args.seeds,
              "max_tokens": args.max_tokens, "results": results,
              "token_cost_vs_text": {m: round(results[m]["ms_per_token"]["median"] /
                                              results["text"]["ms_per_token"]["median"], 3) for m in modes[1:]},
              "versions": versions()}
    for m, row in results.items():
        t = row["ms_per_token"]
        print(f"{m:<12} JSON objects {row['json_objects']}/{row['requests']}, fit the schema {row['fit_schema']}   "
              f"{t['median']:.1f} ms/token "
              f"({t['min']:.1f}-{t['max']:.1f})")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
