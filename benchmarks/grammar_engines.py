"""llguidance beside xgrammar on the JSONSchemaBench sample: which compiles more schemas, how long a compile takes,
and what one token mask costs, for the real tokenizers of SmolLM2 and Qwen2.5.

    .venv-vllm/bin/python benchmarks/grammar_engines.py                 # both models, every schema
    .venv-vllm/bin/python benchmarks/grammar_engines.py --models smollm2 --limit 40 --out /tmp/g.json

It runs where both libraries are installed: .venv-vllm, where vLLM brings xgrammar beside llguidance. kvtool's
side is what kvtool serves with strict: kvtool.structured.grammar.json_grammar (llguidance, compact JSON, unknown
formats dropped; without strict kvtool compiles every schema of the sample, tests/test_jsonschemabench_xgrammar.py);
xgrammar's is vLLM's default backend with the same compact JSON (any_whitespace=False). For every schema of
tests/data/jsonschemabench each library compiles it (timed; the order of the two alternates schema by schema).
On the schemas both compile, each then walks up to --steps tokens, drawn at random (seeded) among the tokens its
mask allows, never the end of the turn, and every mask fill is timed. Reports per model and library: schemas
compiled, compile ms and mask µs (median, p90, max), and the keywords kvtool refuses in the schemas only xgrammar
compiles. JSON record last.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtool.bench.protocol import percentile, summary, versions  # noqa: E402

DATA = ROOT / "tests" / "data" / "jsonschemabench"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,qwen25", help="comma-separated: smollm2, qwen25")
    p.add_argument("--limit", type=int, default=0, help="only the first N schemas (0: all)")
    p.add_argument("--steps", type=int, default=32, help="tokens walked per schema")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON record here")
    return p.parse_args(argv)


class Llg:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import llguidance.hf

        self.vocab, self.eos = vocab, eos
        self.tok = llguidance.hf.from_tokenizer(tokenizer, vocab, eos_token=eos[0])
        self.bits = np.empty((vocab + 31) // 32, dtype=np.int32)
        self.refusal = ""  # why the last schema was refused

    def compile(self, schema):
        from kvtool.errors import InvalidParameterError
        from kvtool.structured.grammar import json_grammar

        try:
            return json_grammar(schema, strict=True)
        except InvalidParameterError as exc:
            self.refusal = why(str(exc))
            return None

    def walk(self, compiled, rng, steps: int) -> list[float]:
        from llguidance import LLMatcher

        m = LLMatcher(self.tok, compiled, log_level=0)
        times = []
        for _ in range(steps):
            if m.is_stopped():
                break
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
            times.append(time.perf_counter() - t0)
            token = draw(self.bits, self.vocab, self.eos, rng)
            if token is None or not m.consume_token(token):
                break
        return times


class Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import xgrammar as xgr

        self.vocab, self.eos = vocab, eos
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.bits = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        try:
            return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except Exception:  # xgrammar raises RuntimeError / ValueError with its reason
            return None

    def walk(self, compiled, rng, steps: int) -> list[float]:
        import xgrammar as xgr

        m = xgr.GrammarMatcher(compiled)
        times = []
        for _ in range(steps):
            if m.is_terminated():
                break
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(self.bits)
            times.append(time.perf_counter() - t0)
            token = draw(self.bits[0].numpy(), self.vocab, self.eos, rng)
            if token is None or not m.accept_token(token):
                break
        return times


def why(message: str) -> str:
    """The keyword a refusal names (`... uses not, which ...` -> `not`), else its reason's first words."""
    m = re.search(r" uses (\S+), which", message)
    return m.group(1) if m else message.split("cannot be enforced: ")[-1][:60]


def draw(bits: np.ndarray, vocab: int, eos: list[int], rng) -> int | None:
    """A random allowed token that does not end the turn; None when only the end is allowed."""
    ok = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
    ok[eos] = False
    ids = np.flatnonzero(ok)
    return int(rng.choice(ids)) if len(ids) else None


def bench_model(name: str, args) -> dict:
    from kvtool.models.loading import load_text
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    text = load_text(str({"smollm2": smollm2_gguf, "qwen25": qwen25_gguf}[name]()))
    tokenizer, vocab = text.tokenizer, text.spec.vocab_size
    eos = sorted({tokenizer.eos_token_id, *[tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>",)
                                            if t in tokenizer.get_vocab()]})
    libs = [Llg(tokenizer, vocab, eos), Xgr(tokenizer, vocab, eos)]
    paths = sorted(DATA.rglob("*.json"))[: args.limit or None]
    out = {lib.name: {"compiled": 0, "compile_ms": [], "mask_us": []} for lib in libs}
    both, xgrammar_only = 0, Counter()  # what kvtool refuses of the schemas xgrammar compiles
    for i, path in enumerate(paths):
        schema = json.loads(path.read_text())
        done = {}
        for lib in libs if i % 2 == 0 else libs[::-1]:
            t0 = time.perf_counter()
            compiled = lib.compile(schema)
            ms = 1000.0 * (time.perf_counter() - t0)
            if compiled is not None:
                out[lib.name]["compiled"] += 1
                out[lib.name]["compile_ms"].append(ms)
                done[lib.name] = compiled
        if "xgrammar" in done and "llguidance" not in done:
            xgrammar_only[libs[0].refusal] += 1
        if len(done) == len(libs):
            both += 1
            for lib in libs:
                rng = np.random.default_rng(args.seed + i)
                out[lib.name]["mask_us"] += [1e6 * t for t in lib.walk(done[lib.name], rng, args.steps)]
        if (i + 1) % 25 == 0 or i + 1 == len(paths):
            print(f"{name}: {i + 1}/{len(paths)} schemas, compiled " +
                  ", ".join(f"{k} {v['compiled']}" for k, v in out.items()), file=sys.stderr, flush=True)
    rows = {"schemas": len(paths), "both_compiled": both, "kvtool_refuses_xgrammar_compiles": dict(xgrammar_only)}
    for lib, r in out.items():
        rows[lib] = {"compiled": r["compiled"], "compile_ms": brief(r["compile_ms"]), "mask_us": brief(r["mask_us"])}
        c, m = rows[lib]["compile_ms"], rows[lib]["mask_us"]
        print(f"{name:<8} {lib:<11} compiled {r['compiled']}/{len(paths)}  compile {c['median']:.1f} ms "
              f"(p90 {c['p90']:.1f})  mask {m['median']:.0f} µs (p90 {m['p90']:.0f}, max {m['max']:.0f}, "
              f"{m['n']} masks)")
    print(f"{name:<8} refused by kvtool, compiled by xgrammar: {dict(xgrammar_only)}")
    return {"model": text.name, "vocab_size": vocab, **rows}


def brief(values: list[float]) -> dict:
    if not values:
        return {"median": float("nan"), "p90": float("nan"), "max": float("nan"), "n": 0}
    s = summary(values)
    return {"median": round(s["median"], 3), "p90": round(percentile(values, 90), 3), "max": round(s["max"], 3),
            "n": s["n"]}


def main(argv=None) -> dict:
    import os

    import llguidance
    import xgrammar

    args = parse_args(argv)
    load0 = os.getloadavg()
    record = {"benchmark": "grammar_engines", "steps": args.steps, "seed": args.seed,
              "models": {m: bench_model(m, args) for m in args.models.split(",")},
              "loadavg": {"before": list(load0), "after": list(os.getloadavg())},
              "versions": {**versions(), "llguidance": getattr(llguidance, "__version__", None) or _dist("llguidance"),
                           "xgrammar": getattr(xgrammar, "__version__", None) or _dist("xgrammar")}}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return record


def _dist(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
