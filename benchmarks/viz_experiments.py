"""The visualizer's experiments on both offline GGUF models, with their plots and one JSON record:
sink shares (and parity with transformers' eager attention), status-bar focus (treatment vs
control), needle depths (lost in the middle) and position buckets.

    python benchmarks/viz_experiments.py --out benchmarks/results/viz_experiments-cpu.json
    python benchmarks/viz_experiments.py --models smollm2 --needle-context 500 --trials 1   # quick
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "examples" / "status_bar"
SPANS = {"status": ["tag:agent_status"], "calls": ["channel:tool_call", "channel:tool_response"]}
SINK_PROMPT = "Tell me about the history of Paris, its bridges and its markets."


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sink_parity(model, plots: Path) -> dict:
    """Sink JSON on a chat prompt, and its max difference from transformers' eager attentions."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvtool.viz.inputs import build_tokens, prompt_ids
    from kvtool.viz.sink import plot_sink, sink_stats

    ids = prompt_ids(model, SINK_PROMPT, chat=True)
    res = sink_stats(model, build_tokens(model, ids))
    plot_sink(res, plots / f"sink-{model.name}.png")
    hf = AutoModelForCausalLM.from_pretrained(str(model.folder), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        att = torch.stack([a[0] for a in hf(torch.tensor([ids]), output_attentions=True).attentions]).float()
    ref = att[:, :, res.skip:, 0].mean(-1).numpy()
    record = res.to_json()
    return {"n_tokens": len(ids), "token0_by_layer": [round(x["token0"], 4) for x in record["layers"]],
            "late_layers": record["late_layers"], "late_token0_min": record["late_token0_min"],
            "late_token0_max": record["late_token0_max"],
            "late_layers_token0_ge_0_5": record["late_layers_token0_ge_0_5"],
            "hf_eager_late_token0": [round(float(ref[i].mean()), 4) for i in record["late_layers"]],
            "max_abs_diff_vs_hf_eager": float(abs(res.token0 - ref).max())}


def focus_runs(model, plots: Path, generate: int) -> dict:
    from kvtool.viz.focus import focus, plot_focus, resolve_spans
    from kvtool.viz.inputs import build_tokens, load_messages_file, prompt_ids
    from kvtool.viz.select import parse_rows

    out = {}
    for rows, gen in (("last:1", 0), ("generated", generate)):
        results = []
        for label in ("treatment", "control"):
            messages, tools = load_messages_file(str(SCENARIO / f"{label}.json"))
            tokens = build_tokens(model, prompt_ids(model, messages=messages, tools=tools), gen)
            results.append(focus(model, tokens, resolve_spans(tokens, SPANS, required=False),
                                 parse_rows(rows, tokens), label=label))
            log(f"  focus {label} rows={rows}: {results[-1].summary()['status']}")
        plot_focus(results, plots / f"focus-{model.name}-{rows.replace(':', '')}.png")
        out[rows] = {r.label: {**{k: {kk: v[kk] for kk in ("tokens", "share", "per_token")}
                                  for k, v in r.summary().items()},
                               "generated": model.decode(r.tokens.ids[r.tokens.n_prompt:]) if gen else None}
                     for r in results}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen25")
    ap.add_argument("--needle-context", type=int, default=1500)
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--generate", type=int, default=24, help="tokens generated for the rows=generated focus run")
    ap.add_argument("--plots", default="artifacts/viz_experiments")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import kvtool
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf
    from kvtool.viz.needle import needle_experiment, plot_needle
    from kvtool.viz.position import plot_position, position_stats
    from kvtool.viz.inputs import load_messages_file, prompt_ids

    plots = Path(args.plots)
    plots.mkdir(parents=True, exist_ok=True)
    paths = {"smollm2": smollm2_gguf, "qwen25": qwen25_gguf}
    record = {"bench": "viz_experiments", "models": {}, "versions": versions()}
    for key in args.models.split(","):
        t0 = time.perf_counter()
        model = kvtool.load(str(paths[key]()), device="cpu", dtype="float32", progress=False)
        log(f"{model.name}:")
        entry = {}
        if model.spec.model_type == "llama":  # the sink acceptance is stated for SmolLM2
            entry["sink"] = sink_parity(model, plots)
            log(f"  sink: {entry['sink']}")
        entry["focus"] = focus_runs(model, plots, args.generate)
        messages, tools = load_messages_file(str(SCENARIO / "treatment.json"))
        ids = prompt_ids(model, messages=messages, tools=tools)
        pos = position_stats(model, ids, list(range(4, len(ids))))
        plot_position(pos, plots / f"position-{model.name}.png")
        entry["position_density_by_bucket"] = [round(x, 6) for x in pos.position_density.mean(0).tolist()]
        needle = needle_experiment(model, args.needle_context, [float(d) for d in args.depths.split(",")],
                                   args.trials)
        plot_needle(needle, plots / f"needle-{model.name}.png")
        entry["needle"] = needle.per_depth()
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        record["models"][model.name] = entry
    record["plots"] = str(plots)
    emit(record, args.out)


if __name__ == "__main__":
    main()
