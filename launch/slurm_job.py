"""Helpers the Slurm batch script (slurm/train.sbatch) calls, and the run-directory files they share
with launch.submit and launch.status.

    python -m launch.slurm_job decide RUN_DIR --rc RC --received USR1|TERM| --restarts N --max-requeues M \
        [--started 0|1] [--job ID --max-retries R]

prints the action for the batch script, and the signal the step stopped on (USR1, TERM, ...; none):
    requeue  the run saved on the time-limit signal (USR1, or ALRM: train.stop_after_minutes) and may be
             requeued again
    retry    the training step failed (a lost node, a crashed rank) after saving a newer checkpoint
             than the job run started from: requeued to resume it, at most R times per job
    stopped  the run saved on a signal and ends here (preemption/TERM, or requeues used up)
    done     training finished (or stopped where train.stop_at_step asked)
    failed   anything else: the job exits with the training step's code
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.checkpoint_format import latest_complete_step, read_stop_marker

JOB_CONFIG = "slurm_config.yaml"  # resolved config the job trains with (written by launch.submit)
JOB_SCRIPT = "train.sbatch"  # rendered batch script
JOB_IDS = "slurm_job_ids.txt"  # one line per submission: job id
HISTORY = "slurm_history.log"  # one line per start/end of the batch script (job id, restart count)
LOG = "slurm.log"  # stdout+stderr of every run of the job, appended


def configured_steps(run_dir: Path) -> int | None:
    """The step the job's config ends training at: train.stop_at_step where set, else train.steps."""
    import yaml

    for name in (JOB_CONFIG, "config.yaml"):
        path = Path(run_dir) / name
        if path.is_file():
            try:
                train = yaml.safe_load(path.read_text())["train"]
                steps, stop = int(train["steps"]), int(train.get("stop_at_step") or 0)
            except (OSError, KeyError, TypeError, ValueError, AttributeError, yaml.YAMLError):
                return None
            return min(stop, steps) if stop > 0 else steps
    return None


def job_ids(run_dir: Path) -> list[str]:
    """The run's jobs, oldest first (launch.submit and the batch script both record a job's id)."""
    path = Path(run_dir) / JOB_IDS
    return list(dict.fromkeys(path.read_text().split())) if path.is_file() else []


def job_history(run_dir: Path, job: str) -> list[tuple[str, dict]]:
    """The batch script's history lines of `job` (HISTORY), each with its key=value fields."""
    import re

    path = Path(run_dir) / HISTORY
    lines = path.read_text().splitlines() if path.is_file() else []
    return [(line, fields) for line in lines if (fields := dict(re.findall(r"(\w+)=(\S+)", line))).get("job") == job]


def job_runs(run_dir: Path, job: str) -> tuple[int, str | None]:
    """(retries so far, the checkpoint tag the latest run started with: its start line's saved=) of
    `job`, from the batch script's history."""
    retries, saved = 0, None
    for line, fields in job_history(run_dir, job):
        retries += fields.get("action") == "retry"
        saved = fields.get("saved", saved) if " start " in f" {line} " else saved
    return retries, saved


def decide(run_dir: Path, rc: int, received: str, restarts: int, max_requeues: int,
           started: bool = True, job: str = "", max_retries: int = 0) -> tuple[str, str]:
    """(action, reason) after the training step of one job run returned `rc` (or, with a signal
    before it, was never started)."""
    if not started:  # nothing was trained, so nothing is lost: as after a save on that signal
        if received != "USR1":
            return "stopped", f"SIG{received} before the training step started: not requeueing"
        if restarts >= max_requeues:
            return "stopped", (f"SIGUSR1 (time limit) before the training step started, but the job was "
                               f"requeued {restarts} times (max {max_requeues})")
        return "requeue", (f"SIGUSR1 (time limit) before the training step started: requeue {restarts + 1} of "
                           f"at most {max_requeues}; give the job more --time than --signal-seconds plus its start")
    marker = read_stop_marker(run_dir)
    if marker is not None:
        # The batch shell knows why it was signalled; a signal sent straight to the step is only
        # known from the marker.
        reason = received or marker_signal(marker)
        where = f"saved at step {marker.get('step')} on SIG{reason}"
        if reason not in TIME_LIMIT_SIGNALS:
            return "stopped", f"{where} (preemption or cancel): not requeueing"
        if restarts >= max_requeues:
            return "stopped", f"{where} but the job was requeued {restarts} times (max {max_requeues})"
        return "requeue", f"{where} ({TIME_LIMIT_SIGNALS[reason]}): requeue {restarts + 1} of at most {max_requeues}"
    steps = configured_steps(run_dir)
    last = latest_complete_step(run_dir)
    if rc == 0:
        return "done", "training step exited 0"
    if steps is not None and last == steps:
        # e.g. the signal arrived during the last step: the agents exit non-zero after forwarding it
        return "done", f"checkpoint of the last step {steps} is complete (step exit code {rc})"
    failed = f"training step exited {rc} without a signal save; latest complete checkpoint: step {last}"
    if job and max_retries:
        retries, saved = job_runs(run_dir, job)
        before = int(saved.removeprefix("step_")) if saved and saved.startswith("step_") else 0
        if (last or 0) <= before:  # no progress: a retry would fail the same way
            return "failed", f"{failed}, as when this job run started: not retrying"
        if retries >= max_retries:
            return "failed", f"{failed}; the job was retried {retries} times after failures (max {max_retries})"
        return "retry", f"{failed}, newer than step {before} this job run started from: retry {retries + 1} of at " \
                        f"most {max_retries}"
    return "failed", failed


# Slurm's warning before the time limit, and the trainer's own: requeued. Signal -> what it means.
TIME_LIMIT_SIGNALS = {"USR1": "the time limit", "ALRM": "train.stop_after_minutes"}


def marker_signal(marker: dict) -> str:
    """The signal a stop marker records, without its SIG prefix (USR1, TERM)."""
    return str(marker.get("signal", "")).removeprefix("SIG")


def stop_signal(run_dir: Path, received: str, started: bool = True) -> str:
    """The signal the job run stopped on, for its history line: the one the batch shell received, else
    (a signal sent straight to the step) the one the trainer's stop marker records; "none"."""
    marker = read_stop_marker(run_dir) if started else None
    return received or (marker_signal(marker) if marker else "") or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decide", help="what the batch script does after the training step")
    d.add_argument("run_dir", type=Path)
    d.add_argument("--rc", type=int, required=True)
    d.add_argument("--received", default="", help="signal the batch shell got (USR1, TERM) or empty")
    d.add_argument("--restarts", type=int, default=0, help="SLURM_RESTART_COUNT")
    d.add_argument("--max-requeues", type=int, default=0)
    d.add_argument("--started", type=int, default=1, help="0: a signal came before the training step started")
    d.add_argument("--job", default="", help="SLURM_JOB_ID, whose runs the history records")
    d.add_argument("--max-retries", type=int, default=0, help="requeues after failures with progress, per job")
    args = parser.parse_args(argv)
    action, reason = decide(args.run_dir, args.rc, args.received, args.restarts, args.max_requeues,
                            bool(args.started), args.job, args.max_retries)
    print(f"[slurm_job] {action}: {reason}", file=sys.stderr, flush=True)
    print(action, stop_signal(args.run_dir, args.received, bool(args.started)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
