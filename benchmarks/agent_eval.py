"""The agent end to end through `kvtool serve` on a real model: tool-call success rate over
the fixed evaluation prompts, and the prefix-cache hit rate of each status-bar placement.

    python benchmarks/agent_eval.py                       # Qwen2.5-Coder GGUF (offline test model)
    python benchmarks/agent_eval.py --model PATH --out benchmarks/results/agent-eval-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, versions  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the Qwen2.5-Coder-0.5B GGUF test model")
    p.add_argument("--cases", type=int, default=None, help="run only the first N evaluation prompts")
    p.add_argument("--turns", type=int, default=None, help="run only the first N turns of the status-bar session")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import kvtool
    from kvtool.agent.config import AgentConfig
    from kvtool.agent.demos.eval_cases import EVAL_CASES
    from kvtool.agent.demos.evaluate import STATUS_BAR_TURNS, run_status_bar_cache_eval, run_tool_eval
    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer
    from kvtool.testing.models import qwen25_gguf

    model = kvtool.load(args.model or str(qwen25_gguf()))
    server = BackgroundServer(create_app(model, server_config=ServerConfig())).start()
    url = server.base_url + "/v1"
    sampling = {"temperature": 0, "max_tokens": args.max_tokens}
    cases = EVAL_CASES[: args.cases] if args.cases else EVAL_CASES
    try:
        t0 = time.perf_counter()
        report = run_tool_eval(url, cases=cases, config=AgentConfig(
            max_iterations=3, wait_for_background=False, tool_timeout_s=10, sampling=sampling))
        eval_s = time.perf_counter() - t0
        for case in report.cases:
            mark = "ok " if case.passed else "MISS"
            print(f"  {mark} {case.expected:<40} made {[c['name'] for c in case.calls]}", file=sys.stderr)
        print(f"tool-call success: {sum(c.passed for c in report.cases)}/{len(report.cases)} "
              f"({report.success_rate:.0%}) in {eval_s:.0f} s", file=sys.stderr)
        rates = run_status_bar_cache_eval(url, turns=STATUS_BAR_TURNS[: args.turns], config=AgentConfig(
            max_iterations=4, wait_for_background=False, tool_timeout_s=10, sampling=sampling))
        for placement, row in rates.items():
            print(f"status bar {placement:<8} hit rate {row['hit_rate']:.1%} over {row['model_calls']} model calls",
                  file=sys.stderr)
    finally:
        server.stop()
    emit({"benchmark": "agent_eval", "model": model.name, "device": model.info["device"],
          "tool_call_success_rate": report.success_rate, "cases": len(report.cases),
          "passed": sum(c.passed for c in report.cases),
          "per_case": [{"expected": c.expected, "passed": c.passed, "calls": c.calls, "error": c.error}
                       for c in report.cases],
          "status_bar_cache": rates, "status_bar_turns": len(STATUS_BAR_TURNS[: args.turns]), "eval_seconds": round(eval_s, 1), "versions": versions()}, args.out)


if __name__ == "__main__":
    main()
