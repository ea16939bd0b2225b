#!/usr/bin/env bash
# Run the whole test suite (real-model tests included) after setting everything up from the locks: the suite in
# .venv, then the --engine vllm tests again in .venv-vllm, where vLLM is installed (in .venv they skip).
# The skill/cache-file contract and the plain vLLM server with kvtool's connector run in a pytest process of their own
# there: their Qwen2.5 servers must not share 24 GB with the session-scoped servers and models of the other vLLM tests.
# Arguments go to the first run only; with arguments the vLLM runs are left out. Each run ends with its slowest tests
# (--durations), the figures that keep the whole run within its time.
#   scripts/test.sh --latest [ARGS]   the release canary: the fast tests (no real model, not slow) in
#                                     .venv-latest, set up with the newest releases pyproject.toml allows
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--latest" ]; then
  shift
  bash scripts/setup.sh --latest
  exec .venv-latest/bin/python -m pytest -q -m "not real_model and not slow" "$@"
fi
bash scripts/setup.sh --test
VLLM_TESTS="tests/test_no_shadowing.py tests/test_install.py
  tests/serving/test_engine_contract.py tests/serving/test_engine_parity.py tests/serving/test_vllm_tokens.py
  tests/serving/test_vllm_options.py tests/serving/test_vllm_start_stop.py tests/serving/test_vllm_clients.py
  tests/serving/test_vllm_shutdown.py tests/bench/test_engines_bench.py tests/bench/test_peers_vllm_client.py
  tests/bench/test_peers_kvtool_vllm.py
  tests/bench/test_grammar_engines_bench.py tests/test_jsonschemabench_xgrammar.py"
# the HTTP contract's kvtool-engine cases ran in .venv already: here only the vLLM ones (parity runs both engines)
VLLM_ONLY="not kvtool-smol and not kvtool-qwen and not kvtool-gemma"
VLLM_ALONE="tests/serving/test_skill_cache_contract.py tests/serving/test_vllm_cache_file.py
  tests/serving/test_vllm_standalone.py"
status=0
.venv/bin/python -m pytest -q --durations=15 "$@" || status=$?
if [ $# -eq 0 ]; then
  .venv-vllm/bin/python -m pytest -q --durations=10 $VLLM_TESTS -k "$VLLM_ONLY" || status=$?
  .venv-vllm/bin/python -m pytest -q --durations=5 $VLLM_ALONE || status=$?
fi
exit $status
