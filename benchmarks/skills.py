"""Composable skill blocks: fidelity and TTFT of composed caches vs full prefill of the same tokens.
A thin wrapper over `kvtool bench skills` whose --model defaults to the offline SmolLM2.

Real models (CPU): 4 example skills (~512 tokens each) after a ~256-token prefix, then a ~64-token query.
    python benchmarks/skills.py --model smollm2 --out benchmarks/results/skills-cpu-smollm2.json \\
        --plot benchmarks/results/skills-cpu-smollm2.png
    python benchmarks/skills.py --model qwen25 ...
GPU timing in the Qwen3-0.6B shape (random weights, synthetic blocks; fidelity numbers are not meaningful):
    python benchmarks/skills.py --shape qwen3-0.6b --blocks 8 --block-tokens 1024 --prefix-tokens 0
Targets checked in the record: composed TTFT >= 5x (CPU) / 10x (--shape) faster than full prefill; with a
repair recomputing <= 10% of block tokens, top-1 agreement >= 0.95 and mean logit cosine >= 0.99.
"""

from __future__ import annotations

import sys

from kvtool.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    default = [] if "--shape" in args or any(a == "--model" or a.startswith("--model=") for a in args) else \
        ["--model", "smollm2"]
    sys.exit(main(["bench", "skills", *default, *args]))
