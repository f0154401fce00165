#!/usr/bin/env bash
# The whole test suite, set-up included, and its 30 slowest tests: bash scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
start=$(date +%s)
status=0
python -m pytest tests --durations=30 "$@" || status=$?
echo "test suite wall time: $(( $(date +%s) - start )) s"
exit $status
