"""Pieces every Slurm submission here shares (torch-free: submitting must not wait for torch).

The time-limit parser, the #SBATCH lines of the common cluster flags, and sbatch itself.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

# Slurm job states of a job that is still queued or running.
ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
                 "COMPLETING", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD"}


# What slurm/train.sbatch and launch.torchrun agree on: the agent's exit code when a signal stopped it
# before its workers started, and the variable naming the file where the batch script writes a
# signal it forwarded (for agents that start after the forward).
NOT_STARTED = 75
SIGNAL_FILE_ENV = "PRETRAIN_SIGNAL_FILE"


class SubmitError(ValueError):
    pass


class SubmitUnknown(SubmitError):
    """sbatch gave no answer: the job may or may not be queued."""


def parse_time(text: str) -> int:
    """Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise SubmitError(f"--time {text!r}: use HH:MM:SS (or D-HH:MM:SS)")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # MM:SS
        seconds = int(a) * 60 + int(b)
    else:  # MM
        seconds = int(a) * 60
    if seconds <= 0:
        raise SubmitError(f"--time {text!r} must be positive")
    return seconds


# sbatch options the job scripts set themselves: from a flag of the submit command (its dest), or
# fixed by the template (None). An --sbatch-arg repeating one would contradict what was checked.
_SHARED_OPTIONS = {"--time": "time", "--job-name": "job_name", "--partition": "partition", "--account": "account",
                   "--qos": "qos", "--constraint": "constraint", "--cpus-per-task": "cpus_per_task",
                   "--exclusive": "exclusive", "--ntasks": None, "--output": None, "--error": None, "--chdir": None}
OWNED_OPTIONS = {**_SHARED_OPTIONS, "--nodes": "nodes", "--signal": "signal_seconds", "--requeue": "max_requeues",
                 "--no-requeue": "max_requeues", "--gpus-per-node": "gpus_per_node", "--ntasks-per-node": None,
                 "--open-mode": None, "--array": None}
# The same for the data-preparation jobs (slurm/prep.sbatch; "": set by launch.submit_prep on each job
# of its chain).
PREP_OWNED_OPTIONS = {**_SHARED_OPTIONS, "--array": "", "--dependency": ""}
SHORT_OPTIONS = {"-N": "--nodes", "-t": "--time", "-J": "--job-name", "-p": "--partition", "-A": "--account",
                 "-q": "--qos", "-C": "--constraint", "-c": "--cpus-per-task", "-n": "--ntasks", "-o": "--output",
                 "-e": "--error", "-D": "--chdir", "-a": "--array", "-d": "--dependency"}


def check_sbatch_arg(extra: str, args: argparse.Namespace, owned: dict = OWNED_OPTIONS) -> None:
    if not extra.startswith("-") or "\n" in extra:
        raise SubmitError(f"--sbatch-arg {extra!r}: expected one option such as --mem=0")
    name = re.split(r"[=\s]", extra, maxsplit=1)[0]
    name = SHORT_OPTIONS.get(name[:2], name) if not name.startswith("--") else name
    if name not in owned:
        return
    dest = owned[name]
    how = ("the command sets it on each job it submits" if dest == "" else
           f"set it with --{dest.replace('_', '-')}" if dest and hasattr(args, dest)
           else "the template fixes it (edit slurm/*.sbatch to change it)")
    raise SubmitError(f"--sbatch-arg {extra!r}: the job script sets {name} itself, and the job was checked "
                      f"for that value; {how}")


def gres_gpu_count(option: str) -> int | None:
    """GPUs per node a --gres option asks for (gpu:8, gpu:a100:8, gpu alone: 1); None: no GPU in it."""
    for item in re.split(r"[=\s]", option, maxsplit=1)[-1].split(","):
        parts = item.strip().split(":")
        if parts[0] == "gpu":
            count = parts[-1] if len(parts) > 1 else "1"
            return int(count) if count.isdigit() else 1  # gpu:a100 is one of that type
    return None


def sbatch_lines(args: argparse.Namespace, owned: dict = OWNED_OPTIONS) -> list[str]:
    """#SBATCH lines of the cluster flags both submit commands take (GPUs, partition, account, ...);
    `owned`: the options the command's own job script sets."""
    lines = []
    if getattr(args, "cpus_per_task", None) is not None and args.cpus_per_task < 1:
        raise SubmitError(f"--cpus-per-task {args.cpus_per_task} must be >= 1")
    for extra in args.sbatch_arg:
        check_sbatch_arg(extra, args, owned)
    gres_gpus = [gres_gpu_count(extra) for extra in args.sbatch_arg if re.match(r"--gres[=\s]", extra)]
    gres_gpus = [count for count in gres_gpus if count is not None]
    if args.gpus_per_node and any(count != args.gpus_per_node for count in gres_gpus):
        raise SubmitError(f"--sbatch-arg --gres asks for {gres_gpus[0]} GPUs per node, but --gpus-per-node "
                          f"{args.gpus_per_node} starts that many processes on each: make them equal")
    if args.gpus_per_node and not gres_gpus:  # --sbatch-arg=--gres=gpu:G asks for them where that is the way
        lines.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    for flag in ("partition", "account", "qos", "constraint", "cpus_per_task"):
        value = getattr(args, flag)
        if value not in (None, ""):
            lines.append(f"#SBATCH --{flag.replace('_', '-')}={value}")
    if args.exclusive:
        lines.append("#SBATCH --exclusive")
    lines += [f"#SBATCH {extra}" for extra in args.sbatch_arg]
    return lines


# What an #SBATCH line cannot carry in a value: sbatch splits it at spaces, reads '%' as a filename
# pattern, '#' as the start of a comment, quotes as quoting and '\' as an escape.
SBATCH_UNSAFE = r"[\s%#'\"\\]"


def check_slurm_path(path, what: str) -> None:
    """A path that goes on an #SBATCH line (--output, --chdir)."""
    if re.search(SBATCH_UNSAFE, str(path)):
        raise SubmitError(f"{what} {path}: an #SBATCH line cannot take a path with spaces, '%', '#', quotes "
                          "or backslashes")


def check_repo(repo: Path) -> None:
    """The jobs run in this checkout (#SBATCH --chdir)."""
    check_slurm_path(repo, "this checkout (move it, or link it from a path without spaces and run from there):")


def check_job_name(name: str, flag: str = "--job-name") -> None:
    if not name or re.search(SBATCH_UNSAFE, name):
        raise SubmitError(f"{flag} {name!r} must be a word without spaces, '%', '#', quotes or backslashes")


def submit(args_and_script: list[str]) -> str:
    """sbatch --parsable ARGS... SCRIPT; the job id (raises SubmitError with sbatch's message)."""
    try:
        res = subprocess.run(["sbatch", "--parsable", *args_and_script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise SubmitUnknown("sbatch did not answer in 120 s, so the job may be queued: look with squeue "
                            "before submitting again") from None
    if res.returncode != 0:
        raise SubmitError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout.strip().split(";")[0]
