#!/usr/bin/env bash
# The main job on the built-in default, on CPU:
#   1. set up .venv and install requirements,
#   2. train a tokenizer on this machine's Python standard library sources,
#   3. write train/val streaming shards,
#   4. train a small model on 2 processes, stop at step STOP with a checkpoint,
#   5. resume from that checkpoint and train to STEPS.
#
#   bash launch/demo.sh [CONFIG] [dotted overrides...]
#
# Env: DEMO_DATA (default data/demo) keeps the tokenizer and shards between runs;
# the run directory (run.dir of the config) is started afresh each time, if this script wrote it
# (a run directory it did not write is refused, never removed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CONFIG=${1:-configs/demo.yaml}
shift || true
DATA=${DEMO_DATA:-data/demo}
NPROC=${DEMO_NPROC:-2}
PY=.venv/bin/python
export PYTHONPATH=$PWD

bash tests/setup_env.sh

# The config and overrides first: a mistake is named before the tokenizer and shards are built.
CHECK='import sys
from pretrain.config import ConfigError, load_config, validate
try:
    cfg = load_config(sys.argv[2], sys.argv[3:])
    validate(cfg, int(sys.argv[1]))
except ConfigError as err:
    sys.exit(f"error: {err}")
print(cfg.train.steps, cfg.run.dir, sep="\n")'
SETTINGS=$($PY -c "$CHECK" "$NPROC" "$CONFIG" "$@")
{ read -r STEPS; read -r RUN_DIR; } <<< "$SETTINGS"  # the run directory whole, spaces and all
# It starts its run directory afresh: only one it wrote itself (marked .demo_run) is removed.
if [[ -e $RUN_DIR && ! -f $RUN_DIR/.demo_run ]] && [[ -n $(ls -A "$RUN_DIR" 2>/dev/null) || ! -d $RUN_DIR ]]; then
    echo "error: run.dir=$RUN_DIR holds files this demo did not write, and the demo starts its run directory" \
         "afresh: give another one (e.g. run.dir=runs/demo-2), or remove that one if it is an earlier demo's" >&2
    exit 2
fi

if [[ ! -f $DATA/tokenizer/tokenizer.model ]]; then
    $PY -m data_prep.train_tokenizer --out "$DATA/tokenizer" --vocab-size 4096
fi
if [[ ! -f $DATA/shards/manifest.json ]]; then
    $PY -m data_prep.build_shards --tokenizer "$DATA/tokenizer" --out "$DATA/shards" --seq-len 128 \
        --val-fraction 0.02
fi

STOP=$((STEPS / 2))
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR" && touch "$RUN_DIR/.demo_run"
COMMON=(data.shards="$DATA/shards" data.tokenizer="$DATA/tokenizer")

echo "== training to step $STOP of $STEPS, then stopping with a checkpoint"
$PY -m launch.local "$CONFIG" --nproc "$NPROC" "${COMMON[@]}" "$@" train.stop_at_step=$STOP
echo "== resuming from the latest checkpoint in $RUN_DIR/checkpoints"
$PY -m launch.local "$CONFIG" --nproc "$NPROC" "${COMMON[@]}" "$@" train.resume=auto
echo "== done: checkpoints in $RUN_DIR/checkpoints"
echo "   TensorBoard: .venv/bin/tensorboard --logdir $RUN_DIR/tensorboard"
echo "   (train/, val/, routing/ = expert load and routing telemetry per layer, sinks/ = attention-sink metrics, checkpoint/ = save time and size;"
echo "    the same scalars as JSON lines in $RUN_DIR/metrics.jsonl)"
