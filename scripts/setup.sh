#!/usr/bin/env bash
# Create .venv and install the package with its test extras, idempotently.
#
# CPU-only machine (no nvidia-smi): torch is pinned to the CPU build 2.13.0 first,
# so nothing later can pull a multi-GB CUDA build. A machine with an NVIDIA GPU
# gets pip's default (CUDA) torch. Set PIPETRANSFORMER_TORCH to choose yourself
# (e.g. PIPETRANSFORMER_TORCH="torch==2.13.0"), or install into your own
# environment with `pip install -e ".[dev]"` and keep the torch you have.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
if ! "$VPY" -c "import torch" 2>/dev/null; then
    if [ -n "${PIPETRANSFORMER_TORCH:-}" ]; then
        spec="$PIPETRANSFORMER_TORCH"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        spec="torch"
    else
        spec="torch==2.13.0"
    fi
    echo "setup: installing $spec"
    "$VPY" -m pip install -q "$spec"
fi
"$VPY" -m pip install -q -e ".[dev]"
"$VPY" -c "import torch, lightning, transformers; print(f'setup: torch {torch.__version__}, lightning {lightning.__version__}, transformers {transformers.__version__}')"
