"""Smoke test for the local two-node Slurm cluster (tests/slurm/cluster.sh)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import uuid

import pytest

pytestmark = pytest.mark.slurm

START_HINT = (
    "start it with `bash tests/slurm/cluster.sh start` and point the clients at it with "
    '`eval "$(bash tests/slurm/cluster.sh env)"` (bash tests/run.sh does both)'
)
JOB_TIMEOUT_S = 120
# --label prefixes each output line with the task rank: "0: 127.0.0.1", "1: n2".
JOB_SCRIPT = """#!/bin/bash
set -e
srun --label hostname --ip-address
srun --label printenv SLURMD_NODENAME
"""


def _slurm_nodes() -> dict[str, str]:
    """Node name -> state, failing the test when no cluster answers."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        pytest.fail(f"Slurm client commands are not installed; {START_HINT}")
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        # sinfo would spend about a minute looking for a configuration server.
        pytest.fail(f"SLURM_CONF={conf!r} does not exist; {START_HINT}")
    try:
        res = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], check=False, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"sinfo did not answer within 30 s; {START_HINT}")
    if res.returncode != 0:
        pytest.fail(
            f"Slurm cluster not reachable (SLURM_CONF={os.environ.get('SLURM_CONF')!r}): "
            f"{res.stderr.strip()}; {START_HINT}"
        )
    nodes = {}
    for line in res.stdout.splitlines():
        name, state = line.split()
        nodes[name] = state
    return nodes


def test_two_node_batch_job_runs_one_task_per_node(tmp_path):
    nodes = _slurm_nodes()
    assert len(nodes) >= 2, f"need 2 nodes, sinfo shows {nodes}; {START_HINT}"

    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(JOB_SCRIPT)
    name = f"pretrain-smoke-{uuid.uuid4().hex[:8]}"
    cmd = [
        "sbatch", "--parsable", "--wait",
        "--nodes=2", "--ntasks-per-node=1", "--time=2",
        f"--job-name={name}", f"--chdir={tmp_path}", f"--output={out}",
        str(script),
    ]  # fmt: skip
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], check=False, timeout=30)
        pytest.fail(f"2-node job did not finish within {JOB_TIMEOUT_S} s; squeue:\n" + _squeue())
    log = out.read_text() if out.exists() else "<no job output>"
    assert res.returncode == 0, f"sbatch --wait exited {res.returncode}: {res.stderr}\njob output:\n{log}"

    task_addrs: dict[str, str] = {}
    task_nodes: dict[str, str] = {}
    for line in log.splitlines():
        rank, sep, value = line.partition(":")
        value = value.strip()
        if not sep:
            continue
        if value in nodes:
            task_nodes[rank.strip()] = value
        elif _is_ip_list(value):
            task_addrs[rank.strip()] = value
    assert set(task_addrs) == {"0", "1"}, f"expected both tasks to print their address:\n{log}"
    assert set(task_nodes) == {"0", "1"}, f"expected ranks 0 and 1 to report a node:\n{log}"
    assert len(set(task_nodes.values())) == 2, f"both tasks ran on one node: {task_nodes}\n{log}"


def _is_ip_list(text: str) -> bool:
    """`hostname --ip-address` prints one or more addresses separated by spaces."""
    try:
        return all(ipaddress.ip_address(word) for word in text.split()) and bool(text)
    except ValueError:
        return False


def _squeue() -> str:
    res = subprocess.run(["squeue", "-l"], capture_output=True, text=True, check=False, timeout=30)
    return res.stdout + res.stderr
