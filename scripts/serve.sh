#!/usr/bin/env bash
# The main job: set up, then serve the default model on 127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvtool serve "$@"
