#!/usr/bin/env bash
# The first GPU run, one command: nvidia-smi and the versions first, then each part in a process of
# its own under its own timeout, most important first (CUDA executor tests; Trainers on cuda:0
# against strategy="auto" with the pipeline's engagement read while K=2; the pipeline's time at K=2
# against K=1 on one GPU's streams; bf16-mixed / 16-mixed; PEFT LoRA + gradient checkpointing +
# cache; model.compile() with pipe_len=2; with 2+ GPUs a 2-process run where K shrinks 2 -> 1).
# It ends within 5 minutes (--budget 300 s, nvidia-smi and the probe included; `--list` shows the
# parts and their timeouts), so that a second attempt fits in a 15-minute lease: the table ends with
# the exact command that reruns each part that did not pass (--only PART).
#
# It installs nothing and fetches nothing: it runs on the Python it finds ($PYTHON, else python3),
# with this checkout on PYTHONPATH; a part whose modules that Python cannot import is skipped, and
# says which. The table goes to $OUT/gpu_check.md when OUT is set, else outputs/gpu_check.md.
# Extra arguments go to scripts/gpu_check.py (--accelerator cpu: a dry run of the check, CUDA parts
# skipped; --only PART,... (a rerun: its table goes to gpu_check-PART.md); --timeout PART=SECONDS;
# --budget SECONDS).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: no Python ('$PY'): set PYTHON to one that has torch" >&2
    exit 2
fi
# Offline: nothing may reach a hub or an index from the lent machine.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py "$@"
