#!/usr/bin/env bash
# The README's demo: fine-tune a pretrained MiniLM-L6 (BERT, 6 blocks) on Rotten Tomatoes sentiment
# snippets with AutoFreeze under strategy "pipetransformer" with AutoCache, on one CPU process, on a
# subset that finishes in a few minutes on a 2-core CPU (examples/configs/text_minilm_pipetransformer.yaml).
# Prints the per-epoch timeline (frozen blocks, pipe length, replicas, cache hits, throughput and its
# speed vs epoch 0, accuracy), writes it as a PNG and JSON, and sums it up. Needs PyPI access on first
# run (or a pre-filled asset cache, see examples/assets.py). Extra arguments go to the LightningCLI, e.g.
#   bash scripts/demo.sh --trainer.max_epochs 5 --data.train_size 3000
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

bash scripts/setup.sh
PY=.venv/bin/python  # setup.sh installs the dev extras: LightningCLI's jsonargparse, matplotlib
"$PY" examples/assets.py fetch minilm-l6 rotten-tomatoes

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1  # the examples read local files only (they set these too)
OUT=outputs/text_minilm_pipetransformer
"$PY" examples/text_classification.py fit --config examples/configs/text_minilm_pipetransformer.yaml "$@"

echo
"$PY" - "$OUT/timeline.json" <<'EOF'
import json, sys

rows = json.load(open(sys.argv[1]))
print("demo: strategy=pipetransformer (AutoFreeze + AutoCache), per epoch")
print(f"{'epoch':>5}  {'frozen':>6}  {'speed vs epoch 0':>16}  {'cache hits':>16}  {'val acc':>7}")
for r in rows:
    speed = "-" if r.get("speed_vs_epoch0") is None else f"{r['speed_vs_epoch0']:.2f}x"
    acc = "-" if r["metric"] is None else f"{100 * r['metric']:.1f}%"
    print(f"{r['epoch']:>5}  {r['frozen']:>6}  {speed:>16}  {r['cache_hits']:>16}  {acc:>7}")
print(f"demo: training {sum(r['train_s'] for r in rows):.0f} s, epochs with validation {rows[-1]['total_s']:.0f} s")
EOF
echo "demo: timeline plot at $OUT/timeline.png (rows as JSON: $OUT/timeline.json)"
echo "demo: finished in $(( $(date +%s) - start )) s"
