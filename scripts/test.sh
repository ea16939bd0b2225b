#!/usr/bin/env bash
# Run the whole test suite (real-model tests included) after setting everything up: the suite in .venv, then
# the --engine vllm tests again in .venv-vllm, where vLLM is installed (in .venv they skip).
# Arguments go to the first run only; with arguments the vLLM run is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
VLLM_TESTS="tests/serving/test_engine_contract.py tests/serving/test_engine_parity.py
  tests/serving/test_vllm_options.py tests/serving/test_vllm_start_stop.py tests/serving/test_vllm_clients.py
  tests/bench/test_engines_bench.py tests/serving/test_skill_cache_contract.py tests/serving/test_vllm_cache_file.py"
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
if [ $# -eq 0 ]; then
  .venv-vllm/bin/python -m pytest -q $VLLM_TESTS || status=$?
fi
exit $status
