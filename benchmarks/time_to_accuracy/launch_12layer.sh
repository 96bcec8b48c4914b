#!/usr/bin/env bash
# Start (or resume) the 12-layer run of issue 34 in the background: MPNet-base, 3 seeds x 6 rows, ONE
# core (taskset -c ${CORE:-1}, one torch thread), ~6 hours on a quiet machine. Records go to
# docs/time_to_accuracy_34.json after every run and are committed there (--commit); the report
# docs/benchmarks_34.md and its PNGs are written at the end. Run it again after an interruption: it
# resumes from the records (runs already recorded are kept, not rerun).
#
#   bash benchmarks/time_to_accuracy/launch_12layer.sh          # from the repository root
#   tail -f outputs/benchmarks/run_34.log                       # progress, one line per run
#
# PYTHON (default .venv/bin/python) and CORE (default 1) can be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
CORE=${CORE:-1}
RECORDS=docs/time_to_accuracy_34.json
LOG=outputs/benchmarks/run_34.log
mkdir -p outputs/benchmarks
"$PYTHON" examples/assets.py fetch mpnet-base rotten-tomatoes >/dev/null
resume=()
if [ -f "$RECORDS" ]; then resume=(--resume "$RECORDS"); fi
NOTE="The 12-layer setting's choices (sizes, rows, statistics) and why: docs/benchmarks_12layer.md. One core (taskset -c $CORE, 1 torch thread)."
OMP_NUM_THREADS=1 PYTHONPATH=$PWD nohup taskset -c "$CORE" "$PYTHON" -m benchmarks.time_to_accuracy \
    --model mpnet-base --write --commit ${resume[@]+"${resume[@]}"} --note "$NOTE" >>"$LOG" 2>&1 &
echo "started: pid $! on core $CORE; log $LOG; records $RECORDS${resume:+ (resumed)}"
