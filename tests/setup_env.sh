#!/usr/bin/env bash
# Create the project virtualenv (.venv) if it is missing and install
# requirements.txt into it, then builds DeepSpeed's CPU op. Safe to run again: when
# requirements.txt has not changed since the last successful install, pip is skipped.
#
#   bash tests/setup_env.sh
#
# Set PRETRAIN_REINSTALL=1 to run pip even when requirements.txt is unchanged.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python3}"
STAMP=.venv/.requirements.sha256

if [[ ! -x .venv/bin/python ]]; then
    echo "[setup_env] creating .venv with $($PY --version 2>&1)" >&2
    "$PY" -m venv .venv
fi

want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [[ ${PRETRAIN_REINSTALL:-0} == 1 || ! -f $STAMP || $(cat "$STAMP") != "$want" ]]; then
    echo "[setup_env] installing requirements.txt into .venv" >&2
    rm -f "$STAMP"
    .venv/bin/pip install -q -r requirements.txt
    echo "$want" >"$STAMP"
fi

# DeepSpeed compiles its CPU collective op at first use (~40 s on 2 cores, cached under
# ~/.cache/torch_extensions). Build it once here, so that the ranks of the first CPU run do not
# start by queueing on one compile (not on GPU machines: their runs use NCCL).
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
        >/dev/null 2>&1 || echo "[setup_env] note: DeepSpeed's CPU collective op did not build;" \
            "runs will try at first use" >&2
fi
