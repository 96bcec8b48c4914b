#!/usr/bin/env bash
# The README's demo: fine-tune a pretrained MiniLM-L6 (BERT, 6 blocks) on Rotten Tomatoes sentiment
# snippets with AutoFreeze under strategy "pipetransformer" with AutoCache, on one process, on a
# subset that finishes in a few minutes on a 2-core CPU (examples/configs/text_minilm_pipetransformer.yaml).
#
# 1. Sets up .venv with what the demo needs only (.[examples,cli,plot]; not the test tools), and
#    skips pip entirely when .venv is already set up for this pyproject.toml (scripts/setup.sh).
# 2. Fetches the pinned weights and data (once; see examples/assets.py).
#    Picks torch's threads: one per core that other work leaves free now, at least one
#    (examples/machine.py; OMP_NUM_THREADS set by you wins). On a busy machine torch's default, one
#    thread per core, waits on the busy cores at every operation and trains many times slower.
#    Hides known third-party notices it cannot fix (examples/quiet.py; PIPETRANSFORMER_HIDE_NOISE=0
#    shows them).
# 3. Measures plain fine-tuning (strategy auto, no AutoFreeze) for at most 24 steps of the same batches:
#    the reference the demo's speed is compared with (PIPETRANSFORMER_DEMO_BASELINE=0 skips it).
# 4. Runs the demo; PipeTransformerTimeline prints the per-epoch table (frozen blocks, pipe length,
#    replicas, cache hits, samples/s, speed vs epoch 0, accuracy) and a summary, and writes
#    timeline.json and timeline.png.
# 5. Prints what the speed column compares, against the reference and the committed benchmark, and
#    this machine's speed next to the README's run (so a slow machine is not taken for a broken run).
#
# Extra arguments go to the demo's LightningCLI (and the --data.* / --model.* ones to the reference too), e.g.
#   bash scripts/demo.sh --trainer.max_epochs 5 --data.train_size 3000
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

export PIPETRANSFORMER_HIDE_NOISE="${PIPETRANSFORMER_HIDE_NOISE:-1}"  # read by setup.sh and examples/quiet.py
bash scripts/setup.sh examples,cli,plot
PY=.venv/bin/python
"$PY" examples/assets.py fetch minilm-l6 rotten-tomatoes >/dev/null  # its paths are long; errors go to stderr
echo "demo: weights and data in ${PIPETRANSFORMER_ASSETS:-~/.cache/lightning-pipetransformer/assets}"
if [ "$PIPETRANSFORMER_HIDE_NOISE" = 1 ]; then
    echo "demo: hiding known third-party notices (Lightning's litlogger tip and LeafSpec"
    echo "      warning, transformers' report on the new head, setuptools' banner);"
    echo "      PIPETRANSFORMER_HIDE_NOISE=0 shows them"
fi
# One torch thread per free core (unless OMP_NUM_THREADS is set): line 1 "THREADS CPUS BUSY", 2-3 why.
{ read -r threads cpus busy; read -r chosen; read -r why; } \
    < <("$PY" examples/machine.py ${OMP_NUM_THREADS:+--threads "$OMP_NUM_THREADS"})
export OMP_NUM_THREADS="$threads"
echo "demo: $chosen"
echo "      $why"

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1  # the examples read local files only (they set these too)
OUT=outputs/text_minilm_pipetransformer
BASE=outputs/text_minilm_baseline

same_setting=()  # the --data.* and --model.* arguments: the reference must train on the same batches
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --data.*=* | --model.*=*) same_setting+=("${args[i]}") ;;
        --data.* | --model.*) same_setting+=("${args[i]}" "${args[i + 1]:-}"); i=$((i + 1)) ;;
    esac
done
rm -f "$BASE/timeline.json"
if [ "${PIPETRANSFORMER_DEMO_BASELINE:-1}" != 0 ]; then
    echo "demo: first, plain fine-tuning as the speed reference (strategy auto,"
    echo "      no AutoFreeze, at most 24 steps of the same batches) ..."
    echo "      its log: $BASE/run.log"
    mkdir -p "$BASE"
    "$PY" examples/text_classification.py fit --config examples/configs/text_minilm_baseline.yaml \
        ${same_setting[@]+"${same_setting[@]}"} >"$BASE/run.log" 2>&1 \
        || { echo "demo: the plain fine-tuning reference failed (see $BASE/run.log);"
             echo "      the demo goes on without it"; }
fi

"$PY" examples/text_classification.py fit --config examples/configs/text_minilm_pipetransformer.yaml "$@"

echo
"$PY" examples/reference.py "$OUT/timeline.json" "$BASE/timeline.json" --machine "$threads" "$cpus" "$busy"
echo "demo: finished in $(( $(date +%s) - start )) s"
