#!/usr/bin/env bash
# Create the project virtualenv (.venv) if it is missing and install
# requirements.txt into it. Safe to run again: when requirements.txt has not
# changed since the last successful install, it does nothing.
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
if [[ ${PRETRAIN_REINSTALL:-0} != 1 && -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
    exit 0
fi

echo "[setup_env] installing requirements.txt into .venv" >&2
rm -f "$STAMP"
.venv/bin/pip install -q -r requirements.txt
echo "$want" >"$STAMP"
