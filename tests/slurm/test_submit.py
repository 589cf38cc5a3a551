"""launch.submit / slurm/train.sbatch / launch.status on the local two-node Slurm cluster
(tests/slurm/cluster.sh): 2 nodes x 1 CPU process on gloo, a tiny model on synthetic shards.

The signal tests wait until training has logged a few steps, signal the job, and check that the
run saved, requeued or stopped, resumed from the right checkpoint, and produced the same losses as
an uninterrupted 2-process torchrun run on this machine (bitwise: same world size and batch on CPU).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.dist_utils import REPO, train
from tests.slurm.test_cluster import _slurm_nodes
from tests.synthetic import tiny_overrides, write_synthetic_shards

pytestmark = pytest.mark.slurm

# Steps take ~0.05 s here; 120 of them leave a few seconds for a signal to arrive mid-run.
STEPS = 120
WRAPPER = "bash tests/slurm/jobs/private_node.sh"  # each emulated node gets its own /dev/shm
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}
JOB_TIMEOUT_S = 300


# ------------------------------------------------------------------ helpers


def overrides(data: Path, run_dir: Path) -> list[str]:
    return tiny_overrides(data, run_dir, **{"train.steps": STEPS, "train.eval_interval": 40,
                                            "train.save_interval": 10, "train.keep_last": 20})


def submit_cmd(config: Path, run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launch.submit", str(config), *overrides(data, run_dir),
            "--nodes", "2", "--cpu-procs-per-node", "1", "--time", "00:10:00", "--signal-seconds", "60",
            "--shutdown-timeout", "60", "--max-requeues", "2", f"--task-wrapper={WRAPPER}", *extra]


def run_cli(cmd: list[str], timeout: float = 120, **env_extra: str) -> subprocess.CompletedProcess:
    # sbatch passes this environment on to the job.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def job_info(job: str) -> dict:
    res = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", res.stdout)) if res.returncode == 0 else {}


def log_text(run_dir: Path) -> str:
    log = run_dir / "slurm.log"
    return log.read_text() if log.exists() else "<no slurm.log>"


def log_tail(run_dir: Path) -> str:
    """The job log for failure messages: without library warnings and C++ stack frames, the first
    traceback (the root cause; later ones are usually peers noticing) and the last 5000 characters."""
    noise = ("Warning", "return func", "frame #", "<omitting python frames>")
    lines = [line for line in log_text(run_dir).splitlines() if not any(n in line for n in noise)]
    tail = "\n".join(lines)[-5000:]
    first = next((i for i, line in enumerate(lines) if "Traceback" in line), None)
    if first is None or "\n".join(lines[first:first + 3]) in tail:
        return tail
    return "\n".join(["--- first traceback ---", *lines[max(0, first - 5):first + 40], "--- end of log ---", tail])


def wait_for(predicate, what: str, run_dir: Path, job: str, timeout: float = JOB_TIMEOUT_S, poll: float = 0.1):
    """Poll until predicate() is truthy; fail at the timeout or as soon as the job has ended without it."""
    deadline = time.monotonic() + timeout
    next_state_check = 0.0
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= next_state_check:
            state = job_info(job).get("JobState")
            if state in TERMINAL and not (value := predicate()):
                pytest.fail(f"job {job} ended ({state}) before {what}\n{log_tail(run_dir)}")
            next_state_check = time.monotonic() + 2
        time.sleep(poll)
    subprocess.run(["scancel", job], check=False, timeout=30)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (job {job}: {job_info(job).get('JobState')})\n"
                f"{log_tail(run_dir)}")


def wait_finished(job: str, run_dir: Path) -> dict:
    return wait_for(lambda: (info := job_info(job)).get("JobState") in TERMINAL and info, f"job {job} to end",
                    run_dir, job, poll=0.5)


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []
    return max(steps, default=0)


def complete_steps(run_dir: Path) -> list[int]:
    ckpt = run_dir / "checkpoints"
    return sorted(int(d.name[5:]) for d in ckpt.glob("step_*") if (d / "COMPLETE").is_file()) \
        if ckpt.is_dir() else []


def losses_jsonl(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "losses.jsonl").read_text().splitlines())]


def metric_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every logged train loss, in order (steps redone after a crash appear twice)."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]


def status_json(run_dir: Path) -> dict:
    res = run_cli([sys.executable, "-m", "launch.status", str(run_dir), "--json"], timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def submit(config: Path, run_dir: Path, data: Path, jobs: list[str], **env_extra: str) -> str:
    res = run_cli(submit_cmd(config, run_dir, data), **env_extra)
    assert res.returncode == 0, f"launch.submit failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    jobs.append(job)
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in res.stdout
    return job


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The training process of `rank` of this run (not its torchrun agent)."""
    marker = str(run_dir / "slurm_config.yaml").encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if marker not in cmdline or b"pretrain.train" not in cmdline or b"torch.distributed.run" in cmdline:
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cluster():
    nodes = _slurm_nodes()
    assert len(nodes) >= 2, f"need 2 nodes, sinfo shows {nodes}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_synthetic_shards(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text("run:\n  name: slurm-test\nparallel:\n  zero_stage: 1\n")
    return path


@pytest.fixture(scope="module")
def reference(data, config, tmp_path_factory) -> Future:
    """Uninterrupted 2-process torchrun run on this machine, started in the background so it
    overlaps the first Slurm job; .result() gives its per-step losses."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    future: Future = Future()

    def work():
        try:
            train(2, ["--config", str(config), *overrides(data, run_dir)], timeout=600)
            future.set_result(dict(losses_jsonl(run_dir)))
        except BaseException as err:  # noqa: BLE001 - handed to the test
            future.set_exception(err)

    threading.Thread(target=work, daemon=True).start()
    return future


@pytest.fixture
def jobs():
    """Job ids a test submitted; cancelled at teardown if still around."""
    submitted: list[str] = []
    yield submitted
    for job in submitted:
        if job_info(job).get("JobState") not in TERMINAL | {None}:
            subprocess.run(["scancel", job], check=False, timeout=30)


# ------------------------------------------------------------------ tests


def test_dry_run_renders_a_valid_requeueing_script(cluster, data, config, tmp_path):
    run_dir = tmp_path / "run"
    res = run_cli(submit_cmd(config, run_dir, data, "--dry-run", "--partition=debug"))
    assert res.returncode == 0, res.stderr
    assert not run_dir.exists(), "--dry-run must not write anything"
    parts = re.split(r"^##### (\S+)\n", res.stdout, flags=re.M)
    files = dict(zip(parts[1::2], parts[2::2]))
    script, resolved = files[str(run_dir / "train.sbatch")], files[str(run_dir / "slurm_config.yaml")]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --signal=B:USR1@60",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append", f"#SBATCH --output={run_dir}/slurm.log",
                 "#SBATCH --partition=debug", "trap 'forward USR1' USR1", "trap 'forward TERM' TERM",
                 'scontrol requeue "$SLURM_JOB_ID"', "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                 "--shutdown-timeout=\"$SHUTDOWN_TIMEOUT\"", "--rdzv-id=\"$SLURM_JOB_ID\"", "MAX_REQUEUES=2",
                 "PROCS_PER_NODE=1", f"CONFIG={run_dir}/slurm_config.yaml", "RESUME=auto",
                 'train.resume="$RESUME"'):
        assert line in script, line
    assert "{{" not in script
    path = tmp_path / "train.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    # The controller accepts the request as rendered (nothing is queued).
    test_only = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60)
    assert test_only.returncode == 0 and "to start at" in test_only.stderr, test_only.stderr
    assert f"dir: {run_dir}" in resolved and f"shards: {data / 'shards'}" in resolved
    assert "resume: auto" in resolved


@pytest.mark.parametrize("bad, message", [
    ("parallel.tensor=4", "world size 2 is not divisible by parallel.tensor=4"),
    ("train.stepz=5", "unknown config key 'train.stepz'"),
])
def test_config_layout_errors_stop_before_sbatch(cluster, data, config, tmp_path, bad, message):
    run_dir = tmp_path / "run"
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout
    res = run_cli(submit_cmd(config, run_dir, data, bad))
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and "nothing was submitted" in res.stderr, res.stderr
    if "tensor" in bad:
        assert "2 nodes x 1 processes" in res.stderr
    assert not run_dir.exists()
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout
    assert set(after.split()) <= set(before.split()), "a job was queued"


def test_a_signal_while_srun_registers_the_step_stops_it_before_training(cluster, data, config, tmp_path, jobs):
    """A signal forwarded while srun is still registering the training step reaches none of its
    processes; the agents, once started, find it in the batch script's file and stop before any
    worker. srun is slowed here (a wrapper that sleeps first) so the signal lands in that moment."""
    slow = tmp_path / "slow_srun"
    slow.mkdir()
    (slow / "srun").write_text(f'#!/bin/bash\nsleep 3\nexec {shutil.which("srun")} "$@"\n')
    (slow / "srun").chmod(0o755)
    run_dir = tmp_path / "run"
    job = submit(config, run_dir, data, jobs, PATH=f"{slow}:{os.environ['PATH']}")
    wait_for(lambda: "rendezvous" in log_text(run_dir), "the batch script to start the training step", run_dir, job)
    subprocess.run(["scancel", "--signal=TERM", "--batch", job], check=True, timeout=30)
    info = wait_finished(job, run_dir)
    log = log_text(run_dir)
    assert "got SIGTERM; forwarding it to the training step" in log and "not starting it" not in log, log_tail(run_dir)
    assert "SIGTERM was forwarded to this step before it started" in log, log_tail(run_dir)
    assert "training step exited with 75" in log and "decision: stopped" in log, log_tail(run_dir)
    assert info["JobState"] == "COMPLETED" and last_step(run_dir) == 0, info


def test_time_limit_requeue_preemption_and_crash_resume(cluster, data, config, reference, tmp_path, jobs):
    """One run through every stop: time limit -> requeue -> preemption -> resubmit -> crash -> retry
    (requeue) -> done -> resubmit (nothing to train); the losses equal the uninterrupted run's throughout."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"

    # 1. Time limit: what --signal=B:USR1@N does, twice in a row (the second must change nothing).
    job = submit(config, run_dir, data, jobs)
    wait_for(lambda: last_step(run_dir) >= 3, "training to reach step 3", run_dir, job)
    for _ in range(2):
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    wait_for(lambda: job_info(job).get("Restarts") == "1", "the job to requeue itself", run_dir, job, poll=0.5)
    log = log_text(run_dir)
    stop = re.search(r"stopping at step (\d+) on SIGUSR1", log)
    assert stop and "decision: requeue" in log, log_tail(run_dir)
    first_stop = int(stop.group(1))
    assert 3 <= first_stop < STEPS and complete_steps(run_dir)[-1] == first_stop
    assert log.count("got SIGUSR1; forwarding") == 1 and "got SIGUSR1 again" in log

    # 2. The requeued run resumes; preemption-like TERM straight to the job step, twice (the agents
    #    and workers get both; the batch shell none, so the marker tells it why the step stopped).
    resumed = f"resumed from {ckpt}/step_{first_stop:08d}"
    wait_for(lambda: resumed in log_text(run_dir) and last_step(run_dir) >= first_stop + 3,
             "the requeued run to resume and train", run_dir, job)
    for _ in range(2):
        subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
    info = wait_finished(job, run_dir)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{log_tail(run_dir)}"
    marker = json.loads((run_dir / "STOPPED_ON_SIGNAL").read_text())
    assert marker["signal"] == "SIGTERM" and first_stop < marker["step"] < STEPS, marker
    second_stop = marker["step"]
    assert complete_steps(run_dir)[-1] == second_stop and "decision: stopped" in log_text(run_dir)
    history = (run_dir / "slurm_history.log").read_text()
    assert "restarts=0 start" in history and "restarts=1 start" in history
    assert re.search(r"restarts=0 end rc=\d+ signal=USR1 action=requeue", history), history
    assert re.search(r"restarts=1 end rc=\d+ signal=TERM action=stopped", history), history  # from the marker
    assert (run_dir / "last_save_job").read_text() == job  # its requeues resume with train.resume=auto
    want = reference.result(timeout=600)
    got = losses_jsonl(run_dir)  # appended by each process run: both runs together, each step once
    assert [s for s, _ in got] == list(range(1, second_stop + 1)), got
    assert [loss for _, loss in got] == [want[s] for s in range(1, second_stop + 1)]  # bitwise on CPU
    status = status_json(run_dir)
    assert status["job_id"] == job and status["state"] == "COMPLETED" and status["restarts"] == 1, status
    assert status["step"] == second_stop and status["latest_checkpoint_step"] == second_stop, status
    assert status["stopped_on_signal"]["signal"] == "SIGTERM" and status["tokens_per_s"] > 0, status
    assert status["loss"] == pytest.approx(want[second_stop]), status

    # 3. Resubmitted: resumes; one rank is killed, if the timing allows while a checkpoint is written.
    job = submit(config, run_dir, data, jobs)
    wait_for(lambda: complete_steps(run_dir)[-1] > second_stop, "a checkpoint after the resume", run_dir, job)
    pid = wait_for(lambda: worker_pid(run_dir, 1), "the rank-1 process", run_dir, job)

    def partial_or_late():
        if any(not (d / "COMPLETE").exists() for d in ckpt.glob("step_*")):
            return "during a save"
        return "between saves" if last_step(run_dir) >= STEPS - 20 else None

    moment = wait_for(partial_or_late, "a checkpoint being written", run_dir, job, poll=0.01)
    os.kill(pid, signal.SIGKILL)
    # The step failed after saving a newer checkpoint than it started from: the job retries (requeues)
    # and resumes from the newest complete checkpoint, never a partial one.
    info = wait_finished(job, run_dir)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{log_tail(run_dir)}"
    log = log_text(run_dir)
    assert f"resumed from {ckpt}/step_{second_stop:08d}" in log and "decision: retry" in log, log_tail(run_dir)
    retried = re.search(r"latest complete checkpoint: step (\d+), newer than step (\d+) this job run started "
                        r"from: retry 1 of at most 2", log)
    assert retried and int(retried.group(2)) == second_stop, log_tail(run_dir)
    last_complete = int(retried.group(1))
    assert second_stop < last_complete < STEPS
    assert f"resumed from {ckpt}/step_{last_complete:08d}" in log.split("decision: retry")[-1], log_tail(run_dir)
    assert not (run_dir / "STOPPED_ON_SIGNAL").exists() and complete_steps(run_dir)[-1] == STEPS
    assert not [d for d in ckpt.glob("step_*") if not (d / "COMPLETE").exists()]  # crash leftovers pruned
    assert re.search(r"restarts=0 end rc=\d+ signal=none action=retry", (run_dir / "slurm_history.log").read_text())
    print(f"killed rank 1 {moment}: retried from step {last_complete}")
    got = metric_losses(run_dir)
    assert {s for s, _ in got} == set(range(1, STEPS + 1))
    for step, loss in got:  # every logged loss, including the steps redone after the crash
        assert loss == want[step], (step, loss, want[step])

    # 4. Submitted again with plain sbatch once finished: nothing to train, and the job records itself
    #    for launch.status.
    res = run_cli(["sbatch", "--parsable", str(run_dir / "train.sbatch")])
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    jobs.append(job)
    info = wait_finished(job, run_dir)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log_tail(run_dir)}"
    assert "nothing to train" in log_text(run_dir).split(f"job {job} restart 0")[-1], log_tail(run_dir)
    status = status_json(run_dir)
    assert status["latest_checkpoint_step"] == STEPS and status["job_id"] == job and status["submissions"] == 3
