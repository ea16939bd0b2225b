#!/usr/bin/env bash
# The one prepared run for a CUDA machine (an H200 lease is ~15 minutes in all): the GPU tests, then
# every benchmark with its baseline in the Qwen3-0.6B shape (bf16, random weights), results under $OUT.
#
#   bash scripts/gpu_prep.sh                        # here first: .gpu/tokenizer (Qwen vocabulary, chat template)
#   OUT=/tmp/gpu bash benchmarks/gpu_run.sh        # there (device tool: carry [".gpu"]); then copy $OUT/*.json
#                                                  # into benchmarks/results/
#
# Needs torch with CUDA, transformers, triton and kvtool importable (pip install -e . or PYTHONPATH=.); the
# H200 image has all but kvtool. Without .gpu/tokenizer the TTFT scenarios use the embedded SmolLM2's
# tokenizer, which a bare GPU machine lacks, and fail (the other benchmarks still run).
# Every step runs even when an earlier one fails; the exit status is the number of failed steps.
# Each step has a time limit (seconds: GPU_TESTS_S, ROPE_S, BENCH_S; ~9 minutes in all, so one device
# call of timeout_s=600 holds it): a benchmark run stopped at its limit leaves the benchmarks that
# finished in report/partial.json.
set -u -o pipefail
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
export KVTOOL_CPU_DECODE=${KVTOOL_CPU_DECODE:-0}  # no C++ build on the lease: only CPU models would use it
failed=0
step() {  # step NAME SECONDS COMMAND...: run it (SIGINT at the limit), keep its log, count a failure
  local name=$1 seconds=$2; shift 2
  echo "== $name (limit ${seconds}s): $*"
  timeout -s INT -k 20 "$seconds" "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "   FAILED or stopped ($name), see $OUT/$name.log"; failed=$((failed + 1)); }
  tail -n 3 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
# the files holding GPU tests, by name: collecting every test module would import the server's packages
# (fastapi, pydantic), which the GPU image lacks
step gpu-tests "${GPU_TESTS_S:-150}" python -m pytest -q -p no:cacheprovider -m gpu $(grep -rlE "mark\.gpu|needs CUDA" tests --include="test_*.py")
step rope-kernel "${ROPE_S:-60}" python benchmarks/rope_kernel.py --out "$OUT/rope_kernel.json"
tokenizer=(); [ -f .gpu/tokenizer/tokenizer.json ] && tokenizer=(--tokenizer .gpu/tokenizer)
step bench-all "${BENCH_S:-330}" python -m kvtool.cli bench all --shape qwen3-0.6b ${tokenizer[@]+"${tokenizer[@]}"} --out-dir "$OUT/report"
tar -czf "$OUT/report.tgz" -C "$OUT" report 2>/dev/null && rm -rf "$OUT/report"
exit $failed
