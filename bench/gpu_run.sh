#!/usr/bin/env bash
# The GPU check as the GPU machine runs it, in one command: the wheels of bench/gpu_wheels.sh are
# installed with --no-deps into a folder of their own (the machine's own packages stay as they are)
# that goes on PYTHONPATH, then bench/gpu_check.sh runs with the machine's python3 and writes its
# reports and log under OUT_DIR as it goes (a timeout keeps what was measured).
#
#   bash bench/gpu_run.sh OUT_DIR [bench.gpu_check arguments, e.g. --row-timeout 200]
#   bash bench/gpu_run.sh OUT_DIR --uoe-bench [bench.uoe_vs_moe arguments, e.g. --seeds 0]
#   bash bench/gpu_run.sh OUT_DIR --lisa-decode [bench.lisa_decode arguments, e.g. --repeats 3]
#
# --uoe-bench runs bench.uoe_vs_moe --gpu instead of the check (125M models, about 2 minutes each;
# carry data/demo/tokenizer and data/gpu_uoe, or it builds the sequence-2048 shards there first from
# the tokenizer) and writes its JSON and PNG under OUT_DIR. --lisa-decode runs the speed part of
# bench.lisa_decode on the GPU in bf16 (the layouts of bench/results/lisa_decode.json at the 1B
# hybrid width: decode with the KV cache, at equal cache memory, and a training step; a few minutes)
# and writes OUT_DIR/lisa_decode_gpu.json.
#
# PRETRAIN_PYTHON (python3) and GPU_WHEELS (.whl) name another interpreter or wheel folder.
# bash bench/gpu_dry_run.sh runs this script on a CPU machine, against a Python that holds only
# what the GPU machine holds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: bash bench/gpu_run.sh OUT_DIR [bench.gpu_check arguments]}
shift
PY=${PRETRAIN_PYTHON:-python3}
wheels=${GPU_WHEELS:-.whl}
if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "error: no wheels in $wheels; build them with bash bench/gpu_wheels.sh PYTHON_VERSION" >&2
    exit 2
fi
site=$(mktemp -d /tmp/pretrain-site.XXXXXX)
trap 'rm -rf "$site"' EXIT
mkdir -p "$out"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [[ ${1:-} == --uoe-bench ]]; then
    shift
    "$PY" -m bench.uoe_vs_moe --gpu --out "$out/uoe_vs_moe_gpu.json" --runs "$(mktemp -d /tmp/uoe-runs.XXXXXX)" \
        "$@" 2>&1 | tee "$out/log"
    exit "${PIPESTATUS[0]}"
fi
if [[ ${1:-} == --lisa-decode ]]; then
    shift
    "$PY" -m bench.lisa_decode --speed-only bench/results/lisa_decode.json --speed-hidden 2048 \
        --speed-train-seq 2048 --out "$out/lisa_decode_gpu.json" "$@" 2>&1 | tee "$out/log"
    exit "${PIPESTATUS[0]}"
fi
PRETRAIN_PYTHON=$PY bash bench/gpu_check.sh --out-dir "$out" "$@" 2>&1 | tee "$out/log"
