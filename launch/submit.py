"""Submit a training run to Slurm: validate the config for the node layout, render
slurm/train.sbatch into the run directory, sbatch it.

    python -m launch.submit configs/1b_uoe.yaml --nodes 4 --gpus-per-node 8 --time 24:00:00 \\
        --partition gpu --account proj train.lr=3e-4
    python -m launch.submit configs/tiny_dense.yaml --nodes 2 --cpu-procs-per-node 1 --time 00:10:00 --dry-run
    python -m launch.submit CONFIG --post --nodes 1 --gpus-per-node 8 --time 04:00:00 post.method=sga ...

The world size is nodes x processes per node (GPUs per node, or --cpu-procs-per-node for a CPU/gloo
run); tensor/expert parallel sizes must divide it. Paths in the config are made absolute, the result
is written to RUN_DIR/slurm_config.yaml and the rendered script to RUN_DIR/train.sbatch. The job's
log is RUN_DIR/slurm.log across requeues. Exit code 2: nothing was submitted (config or argument error).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from launch import slurm_job
from launch.entry_points import entry_point
from launch.layouts import one_gpu_hint
from launch.sbatch import (ACTIVE_STATES, NOT_STARTED, SIGNAL_FILE_ENV, SubmitError, SubmitUnknown, check_job_name,
                           check_repo, check_slurm_path, parse_time, sbatch_lines, submit)
from pretrain import run_lock
from pretrain.checkpoint_format import LAST_SAVE_JOB, CheckpointError
from pretrain.config import Config, ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "slurm" / "train.sbatch"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=1000 run.dir=runs/x")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPU mode: one process per GPU, NCCL")
    p.add_argument("--cpu-procs-per-node", type=int, default=0,
                   help="CPU mode: this many gloo processes per node, no GPUs requested (tests, debugging)")
    p.add_argument("--time", required=True, help="wall-clock limit per job run, HH:MM:SS")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--qos")
    p.add_argument("--constraint")
    p.add_argument("--exclusive", action="store_true")
    p.add_argument("--cpus-per-task", type=int, help="CPUs for each node's task (torchrun and its workers)")
    p.add_argument("--job-name", help="default: run.name")
    p.add_argument("--signal-seconds", type=int, default=300,
                   help="USR1 this many seconds before the time limit: time for one step plus a checkpoint save")
    p.add_argument("--shutdown-timeout", type=int,
                   help="seconds torchrun waits for the workers after forwarding a signal (default: signal seconds - 30)")
    p.add_argument("--max-requeues", type=int, default=10, help="time-limit requeues before the job stops")
    p.add_argument("--max-retries", type=int, default=2,
                   help="requeues after a failed training step (a lost node, a crashed rank) that saved a newer "
                        "checkpoint than its job run started from; 0: a failure ends the job")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra sbatch option rendered as an #SBATCH line, e.g. --sbatch-arg=--mem=0 (repeatable)")
    p.add_argument("--python", default=sys.executable, help="interpreter on the compute nodes")
    p.add_argument("--task-wrapper", default="",
                   help='command that each node\'s torchrun runs under, e.g. "apptainer exec --nv image.sif" '
                        "(shell words, rendered as given)")
    p.add_argument("--force", action="store_true", help="submit even if a job of this run dir is still queued")
    p.add_argument("--post", action="store_true", help="post-training (posttrain.train): SFT, DPO, SGA")
    p.add_argument("--dry-run", action="store_true", help="print the script and resolved config; submit nothing")
    return p.parse_intermixed_args(argv)


STARTUP_MARGIN_S = 300  # what a multi-node start may take before the first step


def check_args(args: argparse.Namespace, time_s: int) -> int:
    """Every check of the command line alone, before the config's (which imports torch and reads the
    data); returns the processes per node."""
    if args.nodes < 1:
        raise SubmitError(f"--nodes {args.nodes} must be >= 1")
    if bool(args.gpus_per_node) == bool(args.cpu_procs_per_node):
        raise SubmitError("give exactly one of --gpus-per-node G (GPU mode) or --cpu-procs-per-node P (CPU mode)")
    procs = args.gpus_per_node or args.cpu_procs_per_node
    if procs < 1:
        raise SubmitError("--gpus-per-node / --cpu-procs-per-node must be >= 1")
    if args.signal_seconds < 1 or args.signal_seconds >= time_s:
        raise SubmitError(f"--signal-seconds {args.signal_seconds} must be between 1 and the time limit ({time_s} s)")
    if args.shutdown_timeout is not None and args.shutdown_timeout < 1:
        raise SubmitError(f"--shutdown-timeout {args.shutdown_timeout} must be >= 1")
    if args.max_requeues < 0 or args.max_retries < 0:
        raise SubmitError("--max-requeues and --max-retries must be >= 0")
    if "\n" in args.task_wrapper:
        raise SubmitError("--task-wrapper must be one line")
    if args.job_name is not None:
        check_job_name(args.job_name)
    sbatch_lines(args)  # checks --sbatch-arg
    check_repo(REPO)
    return procs


def check_plugins(modules: list[str]) -> None:
    """The job runs in the repository, so a model.plugins module found here only through the current
    directory, or a relative PYTHONPATH entry (read from the repository there), would be missing there."""
    cwd = Path.cwd().resolve()
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    here = {Path(p).resolve() for p in entries} | {cwd}
    in_job = {(REPO / p).resolve() for p in entries} | {REPO}  # an absolute entry stays as it is
    for name in modules:
        spec = importlib.util.find_spec(name.split(".")[0])
        if spec is None:
            continue  # load_config reported it
        top = Path(spec.submodule_search_locations[0]) if spec.submodule_search_locations else Path(spec.origin)
        found_in = top.resolve().parent
        if found_in in here and found_in not in in_job:
            raise SubmitError(f"model.plugins module {name!r} is imported from {found_in} (the current directory "
                              f"or a relative PYTHONPATH entry), but the job runs in {REPO}, where that path does not "
                              f"lead to it: export PYTHONPATH={found_in}${{PYTHONPATH:+:$PYTHONPATH}} (absolute) "
                              "before submitting (sbatch passes it on)")


def resolve_config(args: argparse.Namespace, procs: int) -> tuple[Config, str]:
    """Load, make paths absolute, validate for the layout. Returns the config the job's starts read
    (train.resume=auto) and the train.resume its starts take until it has saved (as given: auto,
    none, or a checkpoint, made absolute and checked as the run checks it)."""
    entry = entry_point(args.post)
    cfg = load_config(args.config, args.overrides, entry.config_class)

    def absolute(path: str) -> str:
        return path if "://" in path else str(Path(path).expanduser().resolve())

    for section, key in entry.paths:
        obj = getattr(cfg, section)
        value = getattr(obj, key)
        if isinstance(value, list):
            setattr(obj, key, [absolute(v) for v in value])
        elif value:
            setattr(obj, key, absolute(value))
    cfg.data.mix = [dataclasses.replace(source, shards=absolute(source.shards)) for source in cfg.data.mix]
    if cfg.train.resume not in ("auto", "none"):
        cfg.train.resume = absolute(cfg.train.resume)
    check_slurm_path(cfg.run.dir, "run.dir=")
    check_job_name(args.job_name or cfg.run.name, "--job-name" if args.job_name else "the job name (run.name)")
    check_plugins(cfg.model.plugins)
    world = args.nodes * procs
    try:
        entry.check(cfg, world)  # as the first start will run
    except ConfigError as err:
        raise ConfigError(f"{err} (layout: {args.nodes} nodes x {procs} processes = world size {world})"
                          + one_gpu_hint(err, args.config, world, flag=None)) from None
    first_resume, cfg.train.resume = cfg.train.resume, "auto"  # once the job has saved
    return cfg, first_resume


def env_lines(args: argparse.Namespace) -> list[str]:
    if args.gpus_per_node:
        return ["# GPU mode: NCCL between processes; one process per GPU."]
    return ["# CPU mode: gloo between processes, GPUs hidden.",
            'export CUDA_VISIBLE_DEVICES=""',
            "export DS_ACCELERATOR=cpu",
            f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{max(1, (args.cpus_per_task or 1) // args.cpu_procs_per_node)}}}"]


def render(cfg: Config, args: argparse.Namespace, procs: int, first_resume: str = "auto") -> str:
    signal_s = args.signal_seconds
    shutdown = args.shutdown_timeout if args.shutdown_timeout is not None else max(signal_s - 30, 10)
    run_dir = Path(cfg.run.dir)
    values = {
        "JOB_NAME": args.job_name or cfg.run.name,
        "NODES": str(args.nodes),
        "TIME": args.time,
        "SIGNAL_SECONDS": str(signal_s),
        "RUN_DIR": str(run_dir),
        "REPO": str(REPO),
        "SBATCH_EXTRA": "\n".join(sbatch_lines(args)),
        "RUN_DIR_Q": shlex.quote(str(run_dir)),
        "CONFIG_Q": shlex.quote(str(run_dir / slurm_job.JOB_CONFIG)),
        "FIRST_RESUME_Q": shlex.quote(first_resume),
        "PYTHON_Q": shlex.quote(args.python),
        "REPO_Q": shlex.quote(str(REPO)),
        "PROCS_PER_NODE": str(procs),
        "MAX_REQUEUES": str(args.max_requeues),
        "MAX_RETRIES": str(args.max_retries),
        "SHUTDOWN_TIMEOUT": str(shutdown),
        "ENV_EXPORTS": "\n".join(env_lines(args)),
        "TASK_WRAPPER": args.task_wrapper.strip(),
        "MODULE": entry_point(args.post).module,
        "NOT_STARTED": str(NOT_STARTED),
        "SIGNAL_FILE_ENV": SIGNAL_FILE_ENV,
    }
    text = TEMPLATE.read_text()
    text = text.replace("# {{NAME}} placeholders are filled in by launch.submit; the rendered script is plain bash.",
                        "# Rendered by launch.submit from slurm/train.sbatch.")
    text = re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: values[m.group(1)], text)
    if "{{" in text:
        raise SubmitError("slurm/train.sbatch has a placeholder launch.submit does not know")
    return text


def active_job(run_dir: Path) -> str | None:
    """A job id of this run dir that Slurm still has queued or running: its newest submission's, or
    the one training in it (a job submitted again by hand records itself, and is then refused)."""
    running = run_lock.slurm_job_of(run_lock.holder(run_dir))
    if running:
        return running
    ids = slurm_job.job_ids(run_dir)
    if not ids or shutil.which("squeue") is None:
        return None
    job = ids[-1]
    try:
        res = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"squeue did not answer in 60 s about job {job} of {run_dir}; try again, or pass --force "
                          "once you know it has ended") from None
    state = res.stdout.strip()
    return job if res.returncode == 0 and state in ACTIVE_STATES else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        time_s = parse_time(args.time)
        procs = check_args(args, time_s)
        before_signal = time_s - args.signal_seconds
        if before_signal < STARTUP_MARGIN_S:
            print(f"note: --time leaves {before_signal} s before the time-limit signal (--signal-seconds "
                  f"{args.signal_seconds}); a job whose start takes longer (a multi-node rendezvous, slow "
                  "imports) requeues without training", file=sys.stderr)
        if not args.dry_run and shutil.which("sbatch") is None:
            raise SubmitError("sbatch not found; run this on a Slurm login node (or use --dry-run)")
        cfg, first_resume = resolve_config(args, procs)
        script = render(cfg, args, procs, first_resume)
        run_dir = Path(cfg.run.dir)
        job = None if args.force or args.dry_run else active_job(run_dir)
        if job:
            raise SubmitError(f"job {job} of {run_dir} is still queued or running; two jobs must not train into one "
                              f"run dir (scancel {job}, or --force)")
    except (ConfigError, CheckpointError, SubmitError) as err:
        print(f"error: {err}\nnothing was submitted", file=sys.stderr)
        return 2
    config_text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if first_resume != "auto":
        print(f"train.resume={first_resume} applies until the job saves a checkpoint; its requeues and a "
              f"resubmission of {run_dir / slurm_job.JOB_SCRIPT} then resume the run's newest (submit without "
              "train.resume to continue the run later)", file=sys.stderr)
    if args.dry_run:
        print(f"##### {run_dir / slurm_job.JOB_SCRIPT}")
        print(script, end="")
        print(f"##### {run_dir / slurm_job.JOB_CONFIG}")
        print(config_text, end="")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    if first_resume != "auto":  # the script takes the given train.resume until a save writes this again
        (run_dir / LAST_SAVE_JOB).unlink(missing_ok=True)
    (run_dir / slurm_job.JOB_CONFIG).write_text(config_text)
    script_path = run_dir / slurm_job.JOB_SCRIPT
    script_path.write_text(script)
    try:
        job_id = submit([str(script_path)])
    except SubmitUnknown as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except SubmitError as err:
        print(f"error: {err}\nnothing was submitted", file=sys.stderr)
        return 2
    if slurm_job.job_ids(run_dir)[-1:] != [job_id]:  # the job may have started and recorded itself
        with open(run_dir / slurm_job.JOB_IDS, "a") as f:
            f.write(job_id + "\n")
    print(f"submitted job {job_id}: {args.nodes} nodes x {procs} processes, run dir {run_dir}")
    print(f"log:         {run_dir / slurm_job.LOG}")
    print(f"status:      python -m launch.status {run_dir}")
    print(f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
