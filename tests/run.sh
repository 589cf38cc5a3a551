#!/usr/bin/env bash
# Run the test suite:
#
#   bash tests/run.sh [pytest arguments...]
#
# Sets up .venv (tests/setup_env.sh), starts the local two-node Slurm cluster
# (tests/slurm/cluster.sh) unless one is already reachable, runs pytest, and
# stops the cluster again if this script started it. Exits with pytest's
# exit code.
#
# PRETRAIN_NO_SLURM=1 skips the cluster; tests marked `slurm` then fail.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# DeepSpeed's CPU collective op is compiled per checkout: its build file names the venv's path, so
# checkouts sharing one build folder (~/.cache/torch_extensions) rebuild it whenever another ran.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}"
bash tests/setup_env.sh

started_cluster=0
# shellcheck disable=SC2317  # called from the EXIT trap
stop_cluster() {
    if [[ $started_cluster == 1 ]]; then
        bash tests/slurm/cluster.sh stop || true
    fi
}
trap stop_cluster EXIT

if [[ ${PRETRAIN_NO_SLURM:-0} == 1 ]]; then
    echo "[run] PRETRAIN_NO_SLURM=1: not starting Slurm; tests marked 'slurm' will fail" >&2
    unset PRETRAIN_SLURM
else
    # A cluster is already reachable (SLURM_CONF from the caller, or ours
    # left running by `cluster.sh start`): use it as it is.
    if [[ -z ${SLURM_CONF:-} ]] && bash tests/slurm/cluster.sh status >/dev/null 2>&1; then
        eval "$(bash tests/slurm/cluster.sh env)"
    fi
    if ! { command -v sinfo >/dev/null && timeout 10 sinfo -h >/dev/null 2>&1; }; then
        bash tests/slurm/cluster.sh start
        started_cluster=1
        eval "$(bash tests/slurm/cluster.sh env)"
    fi
    export SLURM_CONF PRETRAIN_SLURM=1
fi

# With no paths among the arguments pytest runs `testpaths` (tests/, set in
# pyproject.toml), so `bash tests/run.sh tests/slurm -x` runs just that folder.
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
exit "$rc"
