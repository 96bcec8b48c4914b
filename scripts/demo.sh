#!/usr/bin/env bash
# The README's demo: fine-tune a pretrained MiniLM-L6 (BERT, 6 blocks) on Rotten Tomatoes
# sentiment snippets with AutoFreeze, on a subset that finishes in a few minutes on a 2-core CPU.
# Prints the per-epoch timeline (frozen blocks, pipe length, replicas, cache hits, throughput,
# accuracy) and writes it as a PNG. Needs PyPI access on first run (or a pre-filled asset cache,
# see examples/assets.py). Extra arguments go to the LightningCLI, e.g.
#   bash scripts/demo.sh --trainer.max_epochs 5 --data.train_size 3000
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

bash scripts/setup.sh
PY=.venv/bin/python  # setup.sh installs the dev extras: LightningCLI's jsonargparse, matplotlib
"$PY" examples/assets.py fetch minilm-l6 rotten-tomatoes

"$PY" examples/text_classification.py fit --config examples/configs/text_minilm.yaml \
    --data.train_size 1500 --data.val_size 1000 --data.max_length 64 \
    --trainer.max_epochs 3 --trainer.enable_model_summary false "$@"

echo
echo "demo: timeline plot at outputs/text_minilm/timeline.png (rows as JSON: outputs/text_minilm/timeline.json)"
echo "demo: finished in $(( $(date +%s) - start )) s"
