#!/usr/bin/env bash
# GPU validation in one command (pass --deadline to bound it; about 8 minutes on one H100/H200):
#   environment (GPU, CUDA, NCCL, torch, DeepSpeed), CPU-vs-GPU losses of tiny fp32 models of every
#   family, then bf16 throughput, TFLOP/s, MFU and peak memory (against the planner's estimate) of
#   ~1B dense, UoE and hybrid models at seq 2048. Results: bench/results/gpu_check-<date>.{json,md}.
#   Without a GPU it says so and exits 0 (unless --device cpu: the script itself on tiny fp32 models).
#   Arguments go to `python -m bench.gpu_check` (--help).
#
#   PRETRAIN_PYTHON=/path/to/python bash bench/gpu_check.sh   # an existing environment (cluster module,
#                                                             # container) instead of creating .venv
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n ${PRETRAIN_PYTHON:-} ]]; then
    PY=$PRETRAIN_PYTHON
else
    bash tests/setup_env.sh
    PY=.venv/bin/python
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! import_error=$("$PY" -c "import deepspeed, megatron.core, yaml" 2>&1); then
    echo "$import_error" | tail -n 15 >&2
    echo "error: $PY cannot import deepspeed, megatron.core and yaml (above: why); install requirements.txt" \
         "into it (pip install -r requirements.txt) or unset PRETRAIN_PYTHON to use .venv" >&2
    exit 2
fi
if [[ " $* " != *" --device cpu "* ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device found: nothing measured (this check needs a GPU)"
    exit 0
fi
nvidia-smi || true
exec "$PY" -m bench.gpu_check "$@"
