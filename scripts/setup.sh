#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with the CPU build of torch 2.13.0,
# DeepSpeed 0.19.8 and this project installed in editable mode. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
# torch first and pinned, so that nothing pulls a multi-GB CUDA build on a CPU machine.
python -c "import torch" >/dev/null 2>&1 || python -m pip install -q "torch==2.13.0"
# Quick when everything is already there.
python -m pip install -q -e ".[dev]"
