#!/usr/bin/env bash
# The first GPU run, one command: CUDA executor tests, real Trainers on cuda:0 against
# strategy="auto" (BERT and a Llama-style decoder, pipe_len=2 on one GPU's streams, chunks 1 and 2,
# cache=True, AutoFreeze over 3 short epochs, 32-true / bf16-mixed / 16-mixed), and with 2+ GPUs a
# 2-process run where K shrinks 2 -> 1. Prints a pass/fail table with timings and writes it to
# outputs/gpu_check.md. About 3-5 minutes on one GPU.
#
# A Python that already has a CUDA torch, lightning and transformers is used as it is (the
# package is taken from this checkout through PYTHONPATH, nothing is installed); otherwise a
# .venv-gpu is made and they are installed from PyPI (the default torch wheels are CUDA builds).
# Extra arguments go to scripts/gpu_check.py (e.g. --accelerator cpu for a dry run without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
ready='import torch, lightning, transformers, torchmetrics, safetensors, pytest, pytest_timeout, hypothesis; assert torch.cuda.is_available()'
if [[ " $* " == *" --accelerator cpu "* ]]; then
    ready='import torch, lightning, transformers, torchmetrics, safetensors, pytest'
fi
if ! "$PY" -c "$ready" 2>/dev/null; then
    echo "gpu_check: installing torch, lightning, transformers and the test tools into .venv-gpu"
    "$PY" -m venv .venv-gpu
    .venv-gpu/bin/python -m pip install -q --upgrade pip
    .venv-gpu/bin/python -m pip install -q torch "lightning>=2.6,<2.7" "transformers>=5,<6" torchmetrics safetensors \
        typing_extensions pytest pytest-timeout hypothesis
    PY=.venv-gpu/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py "$@"
