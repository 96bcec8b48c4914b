#!/usr/bin/env bash
# Start (or resume) a run on the 12-layer setting in the background, on ONE core (taskset -c ${CORE:-1}, one torch
# thread): ISSUE=34 (default: MPNet-base, 3 seeds x 6 rows, ~6 hours) or ISSUE=41 (5 seeds x 8 rows: full
# fine-tuning, the peers EarlyStopping / LoRA / BaseFinetuning-6, and ours: BaseFinetuning-6 and -8 + cache,
# AutoFreeze's plasticity rule + cache, LoRA on the upper blocks + cache; `--dry-run` says how long). Records go to
# docs/time_to_accuracy_$ISSUE.json after every run and are committed there (--commit); the report
# docs/benchmarks_$ISSUE.md and its PNGs are written at the end. Run it again after an interruption: it resumes from
# the records (runs already recorded are kept, not rerun).
#
#   bash benchmarks/time_to_accuracy/launch_12layer.sh            # issue 34's run, from the repository root
#   ISSUE=41 bash benchmarks/time_to_accuracy/launch_12layer.sh   # issue 41's (launch_41.sh does this)
#   tail -f outputs/benchmarks/run_$ISSUE.log                     # progress, one line per run
#
# PYTHON (default .venv/bin/python) and CORE (default 1) can be set in the environment, and RECORDS_ROOT: another
# checkout whose docs/ receives the records and the report, committed there (run the code of a fixed commit from a
# worktree while main moves on: RECORDS_ROOT=/path/to/main, from the worktree).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
CORE=${CORE:-1}
ISSUE=${ISSUE:-34}
case "$ISSUE" in
    34) SELECT=(--model mpnet-base)
        NOTE="The 12-layer setting's choices (sizes, rows, statistics) and why: docs/benchmarks_12layer.md." ;;
    41) SELECT=(--issue 41)
        NOTE="Issue 41's rows on the 12-layer setting (docs/benchmarks_12layer.md); the plasticity rule and its pilots: docs/autofreeze.md and docs/benchmarks_41_pilots.md." ;;
    *) echo "ISSUE must be 34 or 41, got $ISSUE" >&2; exit 2 ;;
esac
RECORDS_ROOT=${RECORDS_ROOT:-$PWD}
RECORDS=$RECORDS_ROOT/docs/time_to_accuracy_$ISSUE.json
SELECT+=(--json "$RECORDS" --docs "$RECORDS_ROOT/docs/benchmarks_$ISSUE.md")
LOG=outputs/benchmarks/run_$ISSUE.log
mkdir -p outputs/benchmarks
"$PYTHON" examples/assets.py fetch mpnet-base rotten-tomatoes >/dev/null
resume=()
if [ -f "$RECORDS" ]; then resume=(--resume "$RECORDS"); fi
NOTE="$NOTE One core (taskset -c $CORE, 1 torch thread)."
OMP_NUM_THREADS=1 PYTHONPATH=$PWD nohup taskset -c "$CORE" "$PYTHON" -m benchmarks.time_to_accuracy \
    "${SELECT[@]}" --write --commit ${resume[@]+"${resume[@]}"} --note "$NOTE" >>"$LOG" 2>&1 &
echo "started: pid $! on core $CORE; log $LOG; records $RECORDS${resume:+ (resumed)}"
