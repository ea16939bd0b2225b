#!/usr/bin/env bash
# Run the whole test suite (real-model tests included) after setting everything up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q "$@"
