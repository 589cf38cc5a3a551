"""Where a Slurm run stands: job state, requeues, progress, checkpoints.

    python -m launch.status runs/1b_uoe
    python -m launch.status runs/1b_uoe --json

The job id comes from RUN_DIR/slurm_job_ids.txt (written by launch.submit and by the job itself,
when it was submitted with plain sbatch). Its state is asked from `scontrol show job`, then squeue
(Slurm forgets finished jobs after MinJobAge), then sacct (needs accounting storage); the requeue count from scontrol's Restarts= or, once Slurm forgot the job, from
RUN_DIR/slurm_history.log, which the batch script appends at every start and end.
Given a shard build's directory instead, it prints the build's status (launch.submit_prep --status).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from data_prep import parts
from launch import slurm_job
from launch.sbatch import ACTIVE_STATES
from pretrain import checkpoint_format, run_lock


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return res.stdout if res.returncode == 0 else None


def slurm_state(job: str) -> dict:
    """{'state', 'reason', 'restarts', 'exit_code', 'source'} from whichever Slurm tool knows the job."""
    out = _run(["scontrol", "show", "job", "-o", job])
    if out and f"JobId={job}" in out:
        fields = dict(re.findall(r"(\w+)=(\S*)", out))
        return {"state": fields.get("JobState"), "reason": fields.get("Reason"),
                "restarts": int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else None,
                "exit_code": fields.get("ExitCode"), "source": "scontrol"}
    out = _run(["squeue", "-h", "-j", job, "-o", "%T|%r"])
    if out and out.strip():
        state, reason = out.strip().splitlines()[0].split("|", 1)
        return {"state": state, "reason": reason, "restarts": None, "exit_code": None, "source": "squeue"}
    out = _run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "State,ExitCode"])
    if out and out.strip():
        state, exit_code = out.strip().splitlines()[-1].split("|")[:2]
        return {"state": state.split()[0], "reason": None, "restarts": None, "exit_code": exit_code,
                "source": "sacct"}
    return {"state": "UNKNOWN (Slurm no longer lists it)", "reason": None, "restarts": None,
            "exit_code": None, "source": None}


def history(run_dir: Path, job: str) -> dict:
    """Starts and the last recorded restart count / end of `job` from the batch script's history."""
    starts, restarts, last_end, end_fields = 0, None, None, {}
    for line, fields in slurm_job.job_history(run_dir, job):
        restarts = int(fields.get("restarts", 0))
        if " start " in f" {line} ":
            starts += 1
        elif " end " in f" {line} ":
            last_end, end_fields = line, fields
        elif line.endswith(" requeue failed") and end_fields:  # the batch script's scontrol requeue
            end_fields = {**end_fields, "action": "requeue failed"}
    return {"starts": starts, "restarts": restarts, "last_end": last_end, "end_fields": end_fields}


def progress(run_dir: Path) -> dict:
    """Last logged training step, loss, tokens/s and when it was logged (metrics.jsonl)."""
    out = {"step": None, "loss": None, "tokens_per_s": None, "logged_at": None}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in reversed(path.read_text().splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if out["logged_at"] is None:
            out["logged_at"] = record.get("time")
        if "train/loss" in record:
            out.update(step=record["step"], loss=record["train/loss"], tokens_per_s=record.get("train/tokens_per_s"))
            break
    return out


def status(run_dir: Path) -> dict:
    run_dir = run_dir.resolve()
    ids = slurm_job.job_ids(run_dir)
    job = ids[-1] if ids else None
    info: dict = {"run_dir": str(run_dir), "job_id": job, "submissions": len(ids)}
    if job:
        info.update(slurm_state(job))
        hist = history(run_dir, job)
        if info.get("restarts") is None:
            info["restarts"] = hist["restarts"]
        info["last_job_end"] = hist["last_end"]
        ended = hist["end_fields"]
        if info["source"] is None and "action" in ended:  # Slurm forgot the job; its batch script recorded it
            info["state"] = f"ended: {ended['action']} (exit code {ended.get('rc', '?')}, from {slurm_job.HISTORY})"
    prog = progress(run_dir)
    info.update(step=prog["step"], loss=prog["loss"], tokens_per_s=prog["tokens_per_s"])
    log = run_dir / slurm_job.LOG
    stamps = [t for t in (prog["logged_at"], log.stat().st_mtime if log.is_file() else None) if t]
    info["seconds_since_last_log"] = round(time.time() - max(stamps), 1) if stamps else None
    ckpt = checkpoint_format.latest_complete(checkpoint_format.checkpoint_dir(run_dir))
    info["latest_checkpoint"] = str(ckpt) if ckpt else None
    info["latest_checkpoint_step"] = checkpoint_format.latest_complete_step(run_dir)
    info["stopped_on_signal"] = checkpoint_format.read_stop_marker(run_dir)
    info["failed"] = checkpoint_format.read_failure_marker(run_dir)
    info["log"] = str(log) if log.is_file() else None
    info["running_in_it"] = run_lock.holder(run_dir)  # a job of another submission too
    info["train_steps"] = slurm_job.configured_steps(run_dir)
    info["unfinished"] = unfinished(info, hist["end_fields"] if job else {})
    return info


def unfinished(info: dict, ended: dict) -> str | None:
    """Why a run whose job has ended stopped short of its configured steps, and how to go on; None
    while its job is queued or running, and once the last step is saved."""
    steps, saved = info.get("train_steps"), info.get("latest_checkpoint_step")
    if not info.get("job_id") or steps is None or (saved or 0) >= steps:
        return None
    if info.get("source") is None and not ended:  # Slurm did not answer and no end was recorded: it may run
        return None
    if str(info.get("state")).split()[0].rstrip(":") in ACTIVE_STATES:
        return None
    signal, action = ended.get("signal", "none"), ended.get("action")
    if action == "stopped" and signal in slurm_job.TIME_LIMIT_SIGNALS:
        why = f"{slurm_job.TIME_LIMIT_SIGNALS[signal]} stopped it after {info.get('restarts')} requeues (launch.submit --max-requeues)"
    elif action == "stopped":
        why = f"it stopped on SIG{signal} (preemption or cancel)"
    elif action == "failed":
        why = f"its last job run failed (exit code {ended.get('rc', '?')}; see the log)"
    elif action == "requeue failed":
        why = "the time limit stopped it and its requeue (scontrol requeue) failed"
    else:
        why = "its job ended"
    resubmit = f"`sbatch {info['run_dir']}/{slurm_job.JOB_SCRIPT}`"
    if (Path(info["run_dir"]) / checkpoint_format.LAST_SAVE_JOB).is_file():  # its jobs resume the newest save
        return f"step {saved} of {steps} saved: {why}; {resubmit} resumes from it"
    return (f"step {saved or 0} of {steps} saved: {why}; {resubmit} starts it again as submitted "
            "(with the train.resume given to launch.submit)")


def format_status(info: dict) -> str:
    def fmt(value, spec=""):
        return "-" if value is None else format(value, spec)

    lines = [f"run dir:     {info['run_dir']}"]
    if info.get("job_id"):
        reason = f" ({info['reason']})" if info.get("reason") not in (None, "None", "") else ""
        lines.append(f"job:         {info['job_id']} {info['state']}{reason}"
                     + (f", exit code {info['exit_code']}" if info.get("exit_code") else ""))
        lines.append(f"requeues:    {fmt(info.get('restarts'))}  (submissions: {info['submissions']})")
        if info.get("last_job_end"):
            lines.append(f"last end:    {info['last_job_end'].strip()}")
    else:
        lines.append("job:         none submitted from this run dir (no slurm_job_ids.txt)")
    if info.get("running_in_it"):
        lines.append(f"running:     {info['running_in_it']}")
    loss = fmt(info["loss"], ".4f")
    tps = fmt(info["tokens_per_s"], ",.0f")
    lines.append(f"progress:    step {fmt(info['step'])}, loss {loss}, {tps} tokens/s")
    lines.append(f"checkpoint:  {fmt(info['latest_checkpoint'])}")
    if info.get("stopped_on_signal"):
        m = info["stopped_on_signal"]
        lines.append(f"last stop:   saved at step {m.get('step')} on {m.get('signal')}")
    if info.get("failed"):
        m = info["failed"]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.get("time", 0)))
        lines.append(f"failed:      {when} on rank {m.get('rank')}: {m.get('error', '?').splitlines()[0][:300]}")
    if info.get("unfinished"):
        lines.append(f"unfinished:  {info['unfinished']}")
    lines.append(f"last log:    {fmt(info['seconds_since_last_log'])} s ago")
    lines.append(f"log file:    {fmt(info['log'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    marks = ("config.yaml", "checkpoints", "metrics.jsonl", slurm_job.JOB_CONFIG, slurm_job.JOB_IDS,
             slurm_job.HISTORY, parts.PLAN_FILE)
    if not any((args.run_dir / name).exists() for name in marks):  # a mistyped path reads as "not started"
        print(f"error: {args.run_dir} holds no run (none of {', '.join(marks)}): give the run.dir of a run, or "
              "the --out of a shard build", file=sys.stderr)
        return 2
    if (args.run_dir / parts.PLAN_FILE).is_file() and not (args.run_dir / "config.yaml").is_file():
        # A shard build (launch.submit_prep's, or data_prep.build_shards'): its own status.
        from launch.submit_prep import format_status as build_status

        print(json.dumps({"shard_build": str(args.run_dir.resolve()), **parts.status(args.run_dir)})
              if args.json else build_status(args.run_dir))
        return 0
    info = status(args.run_dir)
    print(json.dumps(info) if args.json else format_status(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
