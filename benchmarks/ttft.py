"""TTFT per context layout (prefix-cache anti-patterns): a thin wrapper over `kvtool bench ttft`.

    python benchmarks/ttft.py                                   # in-process, default model
    python benchmarks/ttft.py --endpoint http://127.0.0.1:8000  # any OpenAI-compatible server
    python benchmarks/ttft.py --out benchmarks/results/ttft-cpu.json
    python benchmarks/ttft.py prefix --out benchmarks/results/prefix-cpu.json   # `kvtool bench prefix`
"""

from __future__ import annotations

import sys

from kvtool.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    bench = args.pop(0) if args and args[0] in ("ttft", "prefix") else "ttft"
    sys.exit(main(["bench", bench, *args]))
