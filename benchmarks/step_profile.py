"""Where one batched step spends its time, kvtool's engine beside vLLM's: torch.profiler (CPU) over single engine
steps of --rows decoding requests, decode-only and while --arrivals new prompts of --prompt tokens are prefilled in
the same step, the ops' self time grouped into categories (projections, attention, norms and elementwise, sampling,
other ops) and the step's host time (wall minus the ops' self time). JSON record as the last line.

Each engine runs in a process of its own, one after the other (one model loaded at a time): kvtool with fp32 (dense),
bf16 and int4 weights (kvtool.load(weights=...)), and vLLM's engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
so the profiler sees its model) at dtype bfloat16, run by the vLLM python (--vllm-python, $KVTOOL_VLLM_PYTHON);
all on --threads threads.
Every engine gets the same requests: --rows prompts of --prompt random tokens (seeded) decode with ignore_eos,
sampled (--temperature, --top-p); after each step that admitted arrivals the oldest rows are aborted, so each
profiled step has exactly --rows decoding rows.

    python benchmarks/step_profile.py --model smollm2 --threads 2 --steps 6 --vllm-python .venv-vllm/bin/python \\
        --out benchmarks/results/step-profile-cpu-smollm2.json
    python benchmarks/step_profile.py --sides kvtool-bf16 --rows 4 --prompt 64 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import wraps

import torch

SAMPLING_RANGE = "step_profile::sampling"  # the profiler range around each engine's batched sampling
# category -> pieces of op names (first match wins, in this order); ops inside SAMPLING_RANGE are "sampling"
CATEGORIES = {
    "whole_layers": ("kvtool_cpu::layers",),  # every layer in one op (a few rows): not split further
    "projections": ("_linear_pointwise", "kvtool_cpu::gemv", "aten::linear", "aten::addmm", "aten::mm",
                    "aten::matmul", "aten::bmm", "onednn_mm", "_C::mla", "gemm"),
    "attention": ("kvtool_cpu::attend", "prefill_attention", "rope_qkv", "scaled_dot_product", "flash_attention",
                  "attn", "attention", "rotary_embedding", "reshape_and_cache", "kv_cache"),
    "norms_elementwise": ("rms_norm", "silu", "aten::add", "aten::mul", "aten::sub", "aten::div", "copy_",
                          "_to_copy", "aten::to", "aten::neg", "aten::pow", "aten::rsqrt", "aten::mean",
                          "aten::embedding", "aten::cat"),
}
SIDES = ("kvtool-fp32", "kvtool-bf16", "kvtool-int4", "vllm-bf16")
WEIGHTS = {"kvtool-fp32": "dense", "kvtool-bf16": "bf16", "kvtool-int4": "int4"}  # kvtool.load(weights=...)


def category(name: str, in_sampling: bool) -> str:
    if in_sampling:
        return "sampling"
    return next((cat for cat, pieces in CATEGORIES.items() if any(p in name for p in pieces)), "other_ops")


@contextmanager
def labelled(label: str):
    with torch.profiler.record_function(label):
        yield


def in_range(fn, label: str = SAMPLING_RANGE):
    """fn run inside a profiler range named label (the ops it dispatches are attributed to it)."""
    @wraps(fn)
    def run(*args, **kwargs):
        with labelled(label):
            return fn(*args, **kwargs)

    return run


def profiled_step(step) -> dict:
    """One step() under torch.profiler: wall ms, the tokens it ran, ms per category, self ms and calls per op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        tokens = step()
        wall = (time.perf_counter() - t0) * 1000.0
    cats: dict[str, float] = {}
    ops: dict[str, list] = {}
    for e in prof.events():
        if e.is_user_annotation or e.name.startswith("##"):
            continue  # a range's own time is the Python around its ops: host time
        parent, sampling = e.cpu_parent, False
        while parent is not None and not sampling:
            sampling, parent = parent.name == SAMPLING_RANGE, parent.cpu_parent
        ms = e.self_cpu_time_total / 1000.0
        cat = category(e.name, sampling)
        cats[cat] = cats.get(cat, 0.0) + ms
        row = ops.setdefault(f"{e.name}|{cat}", [0.0, 0])
        row[0] += ms
        row[1] += 1
    cats["host"] = wall - sum(cats.values())
    return {"wall_ms": wall, "tokens": tokens, "categories": cats, "ops": ops}


def summarize(steps: list[dict], unprofiled: list[float], top: int) -> dict:
    """Per step kind: wall ms (profiled and not), tokens, ms per category (median over steps) and share of the
    summed wall time, the top ops by self time (ms per step, calls per step), and the fastest step's categories."""
    walls = [s["wall_ms"] for s in steps]
    total = sum(walls)
    names = sorted({c for s in steps for c in s["categories"]}, key=lambda c: (c == "host", c))
    cats = {c: {"ms": round(statistics.median(s["categories"].get(c, 0.0) for s in steps), 2),
                "share": round(sum(s["categories"].get(c, 0.0) for s in steps) / total, 4)} for c in names}
    ops: dict[str, list] = {}
    for s in steps:
        for key, (ms, calls) in s["ops"].items():
            row = ops.setdefault(key, [0.0, 0])
            row[0] += ms
            row[1] += calls
    n = len(steps)
    table = [{"op": key.split("|")[0], "category": key.split("|")[1], "calls": round(calls / n, 1),
              "self_ms": round(ms / n, 2), "share": round(ms / total, 4)}
             for key, (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]]
    fastest = min(steps, key=lambda s: s["wall_ms"])  # a neighbour's load only ever adds time
    return {"steps": n, "tokens": [s["tokens"] for s in steps], "wall_ms": _spread(walls),
            "wall_ms_unprofiled": _spread(unprofiled), "categories": cats, "top_ops": table,
            "fastest": {"wall_ms": round(fastest["wall_ms"], 2),
                        "categories": {c: round(fastest["categories"].get(c, 0.0), 2) for c in names}}}


def _spread(values: list[float]) -> dict:
    if not values:
        return {}
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "n": len(values)}


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, min(vocab, 32000), (length,), generator=gen).tolist() for _ in range(count)]


def run_workload(engine, args) -> dict:
    """The same steps on either engine (KvtoolSide / VllmSide: add(ids), step() -> tokens, drop_oldest()):
    prefill --rows prompts until a step decodes them all, then decode-only and mixed steps (--arrivals prompts
    submitted before each), each kind: one warm-up, --steps profiled, --steps timed without the profiler."""
    fresh = iter(prompts(args.rows + args.arrivals * (2 * args.steps + 1), args.prompt, engine.vocab, args.seed))
    for _ in range(args.rows):
        engine.add(next(fresh))
    t0, prefill_steps = time.perf_counter(), 0
    while engine.step() != args.rows:
        prefill_steps += 1
        if prefill_steps > 4 * args.rows:
            raise RuntimeError(f"the {args.rows} requests did not all decode after {prefill_steps} steps")
    out = {"prefill": {"steps": prefill_steps, "s": round(time.perf_counter() - t0, 2)}}

    def decode():
        return engine.step()

    def mixed():
        for _ in range(args.arrivals):
            engine.add(next(fresh))
        return engine.step()

    for kind, step in (("decode", decode), ("mixed", mixed)):
        step() if kind == "decode" else (step(), engine.drop_oldest(args.arrivals))  # warm-up
        profiled, timed = [], []
        for _ in range(args.steps):
            profiled.append(profiled_step(step))
            if kind == "mixed":
                engine.drop_oldest(args.arrivals)
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            timed.append((time.perf_counter() - t) * 1000.0)
            if kind == "mixed":
                engine.drop_oldest(args.arrivals)
        out[kind] = summarize(profiled, timed, args.top)
    return out


class KvtoolSide:
    """kvtool's Engine: every step is BatchScheduler.step (a Plan, one runner.run for decode rows and prefill chunks
    in the StepExecutor, its batched draw)."""

    def __init__(self, args, weights: str):
        import kvtool
        from kvtool.bench.loading import model_path
        from kvtool.config import EngineConfig, SamplingParams
        from kvtool.engine.engine import Engine
        from kvtool.engine import step

        step.sample = in_range(step.sample)  # StepExecutor.run's draw, looked up at each call
        self.model = kvtool.load(str(model_path(args.model, lambda s: print(s, file=sys.stderr))), weights=weights,
                                 progress=False)
        self.config = EngineConfig(max_running=args.rows + args.arrivals)
        self.engine = Engine(self.model, self.config)
        self.vocab = self.model.runner.spec.vocab_size
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                     top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                                     frequency_penalty=0.0, ignore_eos=True)
        self.gens: list = []

    def add(self, ids: list[int]) -> None:
        self.gens.append(self.engine.scheduler.submit(ids, self.params))

    def step(self) -> int:
        return self.engine.scheduler.step()

    def drop_oldest(self, count: int) -> None:
        for gen in self.gens[:count]:
            self.engine.scheduler.cancel(gen)
        del self.gens[:count]

    def describe(self) -> dict:
        r = self.model.runner
        return {"engine": "kvtool", "weights": r.weights, "activations": str(r.dtype).removeprefix("torch."),
                "forward": r.forward_path, "prefill_budget": self.config.prefill_chunk,
                "max_running": self.config.max_running}


class VllmSide:
    """vLLM's LLMEngine in this process (its engine core too: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""

    def __init__(self, args, folder: str):
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.v1.sample.sampler import Sampler

        Sampler.forward = in_range(Sampler.forward)
        self.budget = args.prefill_budget + args.rows + args.arrivals  # kvtool's prefill room, plus the decode rows
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=folder, dtype="bfloat16", enforce_eager=True, max_model_len=args.prompt + args.max_tokens + 16,
            max_num_seqs=args.rows + args.arrivals, max_num_batched_tokens=self.budget, enable_prefix_caching=False,
            seed=args.seed))
        core = self.engine.engine_core.engine_core  # InprocClient -> EngineCore
        self.scheduled = [0]
        schedule = core.scheduler.schedule

        def counted(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.scheduled[0] = out.total_num_scheduled_tokens
            return out

        core.scheduler.schedule = counted
        self.vocab = self.engine.model_config.get_vocab_size()
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                     top_k=0, min_p=0.0, ignore_eos=True)
        self.ids: list[str] = []
        self.count = 0

    def add(self, ids: list[int]) -> None:
        rid = str(self.count)
        self.count += 1
        self.engine.add_request(rid, {"prompt_token_ids": ids}, self.params)
        self.ids.append(rid)

    def step(self) -> int:
        self.scheduled[0] = 0
        self.engine.step()
        return self.scheduled[0]

    def drop_oldest(self, count: int) -> None:
        self.engine.abort_request(self.ids[:count])
        del self.ids[:count]

    def describe(self) -> dict:
        import vllm

        return {"engine": "vllm", "version": vllm.__version__, "dtype": "bfloat16", "enforce_eager": True,
                "max_num_batched_tokens": self.budget, "max_num_seqs": self.engine.vllm_config.scheduler_config
                .max_num_seqs, "in_process": True}


def run_side(args) -> dict:
    torch.set_num_threads(args.threads)
    if args.side == "vllm-bf16":
        engine = VllmSide(args, args.folder)
    else:
        engine = KvtoolSide(args, WEIGHTS[args.side])
    out = run_workload(engine, args)
    return {"side": args.side, **engine.describe(), "torch_threads": torch.get_num_threads(), **out}


def side_env(args) -> dict:
    """The child's environment: this checkout importable, every engine on --threads OpenMP threads; vLLM's engine
    core in this process (as kvtool.bench.peers.engines starts vLLM), its KV in 1 GiB."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(args.threads)}
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    return env


def spawn(side: str, args, argv: list[str], folder: str | None) -> dict:
    """One side in its own process (the vLLM python for vLLM): its record, and the load average around it."""
    if side == "vllm-bf16":
        from kvtool.bench.peers.engines import vllm_python

        python = vllm_python(args.vllm_python)
        argv = [*argv, "--folder", folder]
    else:
        python = sys.executable
    from kvtool.bench.peers.rounds import settle

    waited = settle(os.cpu_count() or 1, args.settle_s, log=lambda s: print(s, file=sys.stderr))
    before = os.getloadavg()[0]
    print(f"{side}: {python}", file=sys.stderr, flush=True)
    run = subprocess.run([python, os.path.abspath(__file__), *argv, "--side", side], env=side_env(args),
                         stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    if run.returncode != 0:
        raise RuntimeError(f"the {side} side exited with {run.returncode}")
    record = json.loads(run.stdout.strip().splitlines()[-1])
    record["load_avg"] = {"before": round(before, 2), "after": round(os.getloadavg()[0], 2),
                          "settle_wait_s": waited["waited_s"]}
    return record


def report(side: dict) -> None:
    print(f"\n{side['side']}:", file=sys.stderr)
    for kind in ("decode", "mixed"):
        s = side[kind]
        cats = ", ".join(f"{c} {v['ms']:.1f} ms ({100 * v['share']:.0f}%)" for c, v in s["categories"].items())
        print(f"  {kind} ({s['tokens'][0]} tokens): {s['wall_ms']['median']:.1f} ms; {cats}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=16, help="decoding requests in every profiled step")
    p.add_argument("--prompt", type=int, default=512, help="tokens of every prompt")
    p.add_argument("--arrivals", type=int, default=1, help="prompts submitted before each mixed step")
    p.add_argument("--steps", type=int, default=4, help="steps of each kind profiled (and as many timed)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the sides (the order alternates)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top", type=int, default=12, help="ops listed per step kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--settle-s", type=float, default=180.0, help="most seconds to wait, before each side, for "
                   "the 1-minute load to fall to half the cores")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one side may take")
    p.add_argument("--out", default=None)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # run one side here (a child process)
    p.add_argument("--folder", help=argparse.SUPPRESS)  # the HF folder vLLM loads
    args = p.parse_args(argv)
    if min(args.threads, args.rows, args.prompt, args.arrivals, args.steps, args.rounds, args.top) < 1:
        p.error("--threads, --rows, --prompt, --arrivals, --steps, --rounds and --top must be at least 1")
    from kvtool.config import EngineConfig

    args.prefill_budget = EngineConfig().prefill_chunk
    if args.side:
        print(json.dumps(run_side(args)), flush=True)
        return 0
    from kvtool.bench.protocol import emit, versions

    folder = None
    if "vllm-bf16" in args.sides:
        from kvtool.bench.peers.harness import model_files

        folder = str(model_files(args.model, lambda s: print(s, file=sys.stderr)).folder)
    child = list(argv if argv is not None else sys.argv[1:])
    child = [a for i, a in enumerate(child) if a != "--out" and (i == 0 or child[i - 1] != "--out")]
    runs = []
    for r in range(args.rounds):
        for side in (args.sides if r % 2 == 0 else args.sides[::-1]):
            runs.append({"round": r, **spawn(side, args, child, folder)})
            report(runs[-1])
    record = {"benchmark": "step_profile", "model": args.model, "device": f"{cpu_model()}, {args.threads} threads",
              "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "threads": args.threads,
              "rows": args.rows, "prompt_tokens": args.prompt, "arrivals": args.arrivals,
              "sampling": {"temperature": args.temperature, "top_p": args.top_p},
              "categories": {**{c: list(v) for c, v in CATEGORIES.items()},
                             "sampling": f"every op inside the {SAMPLING_RANGE} range",
                             "other_ops": "the other ops", "host": "wall time minus every op's self time"},
              "runs": runs, "versions": versions()}
    emit(record, args.out)
    return 0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            name = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    extras = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(extras) or 'no AVX-512'}), {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
