#!/bin/bash
# Task wrapper for the test cluster, whose two "nodes" share one host: gives each node's processes
# their own /dev/shm and temp directory, as separate machines have. The data loader keeps per-node
# shared memory there under fixed names, which would collide between the emulated nodes.
#
#   launch.submit ... --task-wrapper "bash tests/slurm/jobs/private_node.sh"
#
# Every step execs the next, so the command keeps the task's process and receives Slurm's signals
# directly, with no shell in between.
set -euo pipefail
# shellcheck disable=SC2016  # expanded by the inner shell
exec unshare --mount --propagation private bash -c '
    mount -t tmpfs -o size=512m tmpfs /dev/shm
    mkdir -p /dev/shm/tmp
    export TMPDIR=/dev/shm/tmp
    exec "$@"
' bash "$@"
