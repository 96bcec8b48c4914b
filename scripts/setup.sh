#!/usr/bin/env bash
# Create .venv and install the package with its test extras, idempotently.
#
# CPU-only machine (no nvidia-smi): torch is pinned to the CPU build 2.13.0 first,
# so nothing later can pull a multi-GB CUDA build. PyPI's Linux torch wheels depend
# on the CUDA libraries, so when PyTorch's CPU index is reachable it is added (its
# 2.13.0+cpu wins); where it is not (a mirror or a local wheel directory provides
# torch, as on our CI machines) pip's own configuration decides. A machine with an NVIDIA GPU
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
CPU_INDEX=https://download.pytorch.org/whl/cpu
"$VPY" -m pip install -q --upgrade pip
if ! "$VPY" -c "import torch" 2>/dev/null; then
    if [ -n "${PIPETRANSFORMER_TORCH:-}" ]; then
        spec="$PIPETRANSFORMER_TORCH"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        spec="torch"
    else
        spec="torch==2.13.0"
        if "$VPY" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
            index_args="--extra-index-url $CPU_INDEX"
        fi
    fi
    echo "setup: installing $spec ${index_args:-}"
    # shellcheck disable=SC2086  # index_args is empty or two words
    "$VPY" -m pip install -q ${index_args:-} "$spec"
fi
"$VPY" -m pip install -q -e ".[dev]"
"$VPY" -c "import torch, lightning, transformers; print(f'setup: torch {torch.__version__}, lightning {lightning.__version__}, transformers {transformers.__version__}')"
