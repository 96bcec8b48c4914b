#!/usr/bin/env bash
# Start (or resume) issue 41's run in the background: MPNet-base, 5 seeds x 8 rows (full fine-tuning, the peers
# EarlyStopping / LoRA / BaseFinetuning-6, and ours: BaseFinetuning-6 and -8 + cache, AutoFreeze's plasticity rule
# + cache, LoRA on the upper blocks + cache), ONE core (taskset -c ${CORE:-1}, one torch thread); `--dry-run` says
# how long. Records go to docs/time_to_accuracy_41.json after every run and are committed there (--commit); the
# report docs/benchmarks_41.md and its PNGs are written at the end. Run it again after an interruption: it resumes
# from the records (runs already recorded are kept, not rerun).
#
#   bash benchmarks/time_to_accuracy/launch_41.sh          # from the repository root
#   tail -f outputs/benchmarks/run_41.log                  # progress, one line per run
#
# PYTHON (default .venv/bin/python) and CORE (default 1) can be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
CORE=${CORE:-1}
RECORDS=docs/time_to_accuracy_41.json
LOG=outputs/benchmarks/run_41.log
mkdir -p outputs/benchmarks
"$PYTHON" examples/assets.py fetch mpnet-base rotten-tomatoes >/dev/null
resume=()
if [ -f "$RECORDS" ]; then resume=(--resume "$RECORDS"); fi
NOTE="Issue 41's rows on the 12-layer setting (docs/benchmarks_12layer.md); the plasticity rule and its pilots: docs/autofreeze.md and docs/benchmarks_41_pilots.md. One core (taskset -c $CORE, 1 torch thread)."
OMP_NUM_THREADS=1 PYTHONPATH=$PWD nohup taskset -c "$CORE" "$PYTHON" -m benchmarks.time_to_accuracy \
    --issue 41 --write --commit ${resume[@]+"${resume[@]}"} --note "$NOTE" >>"$LOG" 2>&1 &
echo "started: pid $! on core $CORE; log $LOG; records $RECORDS${resume:+ (resumed)}"
