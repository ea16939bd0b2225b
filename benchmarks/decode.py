"""bs=1 decode tokens/s and cold TTFT, kvtool vs transformers `generate`: a thin wrapper over `kvtool bench decode`.

    python benchmarks/decode.py                      # default model (embedded SmolLM2 GGUF offline)
    python benchmarks/decode.py --shape qwen3-0.6b   # random weights in the Qwen3-0.6B shape (GPU timing)
    python benchmarks/decode.py --model PATH_OR_ID --out benchmarks/results/decode-cpu.json
"""

from __future__ import annotations

import sys

from kvtool.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
