#!/usr/bin/env bash
# Before a CUDA lease: put what benchmarks/gpu_run.sh needs and a bare GPU machine lacks under .gpu/
# (git-ignored; the device tool carries it). Today that is a Qwen tokenizer (Qwen2.5-Coder's, from the
# offline test GGUF: the Qwen vocabulary and a tool-calling chat template), so the random-weight
# Qwen3-0.6B-shaped run renders the TTFT scenarios' chat prompts as Qwen would.
#
#   bash scripts/gpu_prep.sh       # then run benchmarks/gpu_run.sh there with carry [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
mkdir -p .gpu/tokenizer
folder=$("$PY" - <<'PYEOF'
from kvtool.models import gguf
from kvtool.testing.models import qwen25_gguf

print(gguf.converted_folder(qwen25_gguf()))
PYEOF
)
cp "$folder"/tokenizer.json "$folder"/tokenizer_config.json "$folder"/chat_template.jinja .gpu/tokenizer/
du -sh .gpu
