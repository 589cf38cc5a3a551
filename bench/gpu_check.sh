#!/usr/bin/env bash
# GPU validation in one command (under 8 minutes on one H100/H200):
#   environment (GPU, CUDA, NCCL, torch, DeepSpeed), CPU-vs-GPU losses of tiny fp32 models of every
#   family, then bf16 throughput, TFLOP/s, MFU and peak memory of ~1B dense, UoE and hybrid models
#   at seq 2048. Results: bench/results/gpu_check-<date>.{json,md}. Without a GPU it says so, exits 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tests/setup_env.sh
export PYTHONPATH=$PWD
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device found: nothing measured (this check needs a GPU)"
    exit 0
fi
nvidia-smi || true
exec .venv/bin/python -m bench.gpu_check "$@"
