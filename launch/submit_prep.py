"""Build shards on a Slurm cluster: plan the parts here, build them in a job array, merge in a last job.

    python -m launch.submit_prep --tokenizer data/tok --out /shared/shards --sources /data/fineweb \\
        --seq-len 2048 --tasks 64 --cpus-per-task 16 --time 04:00:00 --partition cpu
    python -m launch.submit_prep ... --dry-run        # print the plan summary and both scripts
    python -m launch.submit_prep --status /shared/shards

The build settings are data_prep.build_shards's; the corpus is cut into parts on this machine (its
file list and Parquet footers only) and written to OUT/plan.json, which every task reads. Task I of
N builds parts I, I+N, ...; a merge job, run once all tasks succeeded, joins the parts into one
shard set and writes the manifest. With --dedup exact the same array runs twice, around a job that
builds the dedup index: first it hashes its parts' documents, then it builds them. Running the same command again after a task failed or was
killed submits only the tasks with unfinished parts (and the merge). Paths must be visible from
the compute nodes (a shared file system); they are made absolute here. Exit code 2: nothing was
submitted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data_prep import dedup
from data_prep import parts as P
from data_prep.build_shards import SPLIT_KEYS, check_compression, plan_build, plan_setting
from data_prep.tokenizer import tokenizer_record
from launch.sbatch import (ACTIVE_STATES, PREP_OWNED_OPTIONS, SubmitError, SubmitUnknown, check_job_name, check_repo,
                           check_slurm_path, parse_time, sbatch_lines, submit)

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "slurm" / "prep.sbatch"
SLURM_DIR = "slurm"
JOBS_FILE = "jobs.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--status", metavar="OUT", help="show the parts and jobs of the build in OUT, submit nothing")
    build = p.add_argument_group("build (as data_prep.build_shards)")
    build.add_argument("--out", help="output directory, on a file system the compute nodes share")
    build.add_argument("--tokenizer", help="tokenizer directory (train_tokenizer or import_tokenizer)")
    build.add_argument("--sources", nargs="+", default=None, metavar="PATH",
                       help="corpus files/directories (default: the Python standard library's .py files)")
    build.add_argument("--seq-len", type=int, default=512)
    build.add_argument("--val-fraction", type=float, default=0.01)
    build.add_argument("--compression", default="zstd")
    build.add_argument("--shard-size-limit", default="64mb")
    build.add_argument("--part-size", default="auto")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--split-key", choices=SPLIT_KEYS, default="relative",
                       help="what a document's split is hashed from (as data_prep.build_shards)")
    build.add_argument("--text-field", default="text")
    build.add_argument("--dedup", choices=dedup.DEDUP_MODES, default="none",
                       help="exact: drop repeated documents across the build (adds a hash array and an index job)")
    build.add_argument("--overwrite", action="store_true", help="discard an existing build in --out and plan again")
    build.add_argument("--skip-unreadable", action="store_true",
                       help="tasks count a file the file system fails to read as unreadable instead of failing")
    slurm = p.add_argument_group("slurm")
    slurm.add_argument("--tasks", type=int, default=None, help="array tasks (default: one per part, at most 1000)")
    slurm.add_argument("--max-running", type=int, default=None, help="run at most this many tasks at once (%%K)")
    slurm.add_argument("--time", default="04:00:00", help="time limit of each task, HH:MM:SS")
    slurm.add_argument("--cpus-per-task", type=int, default=None, help="CPUs (= build processes) of each task")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--qos")
    slurm.add_argument("--constraint")
    slurm.add_argument("--exclusive", action="store_true")
    slurm.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                       help="extra sbatch option rendered as an #SBATCH line, e.g. --sbatch-arg=--mem=32G")
    slurm.add_argument("--job-name", default="prep")
    slurm.add_argument("--python", default=sys.executable, help="interpreter on the compute nodes")
    slurm.add_argument("--dry-run", action="store_true", help="print the plan and the scripts; submit nothing")
    args = p.parse_args(argv)
    args.gpus_per_node = 0  # sbatch_lines: CPU jobs
    return args


def check_script_settings(args: argparse.Namespace, out: Path) -> None:
    """What the scripts' #SBATCH lines take from the command line."""
    check_slurm_path(out, "--out")
    check_job_name(args.job_name)
    if args.max_running is not None and args.max_running < 1:
        raise SubmitError(f"--max-running {args.max_running} must be >= 1 (leave it out for no limit)")
    sbatch_lines(args, PREP_OWNED_OPTIONS)  # checks --sbatch-arg


def render(args: argparse.Namespace, out: Path, command: str, log: str) -> str:
    check_script_settings(args, out)
    values = {"JOB_NAME": args.job_name, "TIME": args.time, "LOG": log, "REPO": str(REPO),
              "REPO_Q": shlex.quote(str(REPO)), "SBATCH_EXTRA": "\n".join(sbatch_lines(args, PREP_OWNED_OPTIONS)),
              "COMMAND": command}
    text = TEMPLATE.read_text().replace(
        "# {{NAME}} placeholders are filled in by launch.submit_prep; the rendered script is plain bash.",
        "# Rendered by launch.submit_prep from slurm/prep.sbatch.")
    unknown = sorted(set(re.findall(r"\{\{([A-Z_]+)\}\}", text)) - set(values))
    if unknown:
        raise SubmitError(f"slurm/prep.sbatch has placeholders {unknown} that launch.submit_prep does not fill: "
                          "remove them from the template, or give them values in launch.submit_prep.render")
    text = re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: values[m.group(1)], text)
    return text


def pending_tasks(out: Path, plan: dict, tasks: int) -> list[int]:
    """Tasks of ``tasks`` that still have a part without its completion marker."""
    parts = P.parts_of(plan)
    return [t for t in range(tasks) if any(P.read_marker(out, p, plan) is None for p in P.tasks_parts(parts, t, tasks))]


def _absolute(path: str | None) -> str | None:
    """An absolute path to the same name: links are not followed, so that a source named by a link is
    keyed (--split-key relative) by the name a local build keys it by."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def finished_differently(args: argparse.Namespace, out: Path) -> str:
    """The settings given here that differ from those a finished build in `out` was planned with
    (its relative paths read from where it was planned; a tokenizer retrained in place differs)."""
    plan = P.read_plan(out) or {}
    planned = dict(plan.get("settings", {}))
    where = plan.get("planned_in") or os.getcwd()

    def located(path: str) -> str:
        return os.path.abspath(os.path.join(where, os.path.expanduser(path)))

    if planned:
        planned["split_key"] = plan_setting(planned, "split_key")
    if "tokenizer" in planned:
        planned["tokenizer"] = located(planned["tokenizer"])
    if "sources" in planned:
        planned["sources"] = [located(source) for source in planned["sources"]]
    given = {"seq_len": args.seq_len, "val_fraction": args.val_fraction, "seed": args.seed,
             "text_field": args.text_field, "dedup": args.dedup, "split_key": args.split_key,
             "compression": check_compression(args.compression),
             "shard_size_limit": P.parse_size(args.shard_size_limit), "tokenizer": _absolute(args.tokenizer)}
    with contextlib.suppress(OSError, ValueError):  # no tokenizer record there: the build would say so
        given["tokenizer_sha256"] = tokenizer_record(args.tokenizer)["sha256"]
    if args.sources:
        given["sources"] = [_absolute(source) for source in args.sources]
    if str(args.part_size) != "auto":
        given["part_bytes"] = P.parse_size(args.part_size)
    return ", ".join(f"{key}: {planned[key]!r} there, {value!r} now" for key, value in given.items()
                     if key in planned and planned[key] != value)


def check_sbatch_accepts(args: argparse.Namespace, out: Path) -> None:
    """sbatch --test-only on a script with the jobs' #SBATCH lines: a partition, account, QoS or
    option it refuses is found before --overwrite clears a build or any job is queued."""
    with tempfile.TemporaryDirectory(prefix="prep-check-") as tmp:
        script = Path(tmp) / "check.sbatch"
        script.write_text(render(args, out, "true", str(Path(tmp) / "check.log")))
        try:
            res = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return  # no answer: the submission itself will say
        if res.returncode != 0:
            raise SubmitError(f"sbatch refuses these job settings ({res.stderr.strip()}); nothing was changed")


def submit_build(args: argparse.Namespace) -> int:
    if not args.out or not args.tokenizer:
        raise SubmitError("--out and --tokenizer are required (or --status OUT)")
    parse_time(args.time)  # a malformed limit fails here, not in sbatch
    if args.tasks is not None and args.tasks < 1:
        raise SubmitError(f"--tasks {args.tasks} must be >= 1")
    check_repo(REPO)
    out = Path(_absolute(args.out))
    if "/" in args.python:  # the jobs run in the repository: a relative path would be read from there
        args.python = _absolute(args.python)
        if not os.access(args.python, os.X_OK):
            raise SubmitError(f"--python {args.python}: no executable there; give the interpreter the compute "
                              "nodes run")
    check_script_settings(args, out)  # before --overwrite clears anything
    if (out / "manifest.json").is_file() and not args.overwrite:
        if differences := finished_differently(args, out):
            raise SubmitError(f"{out} holds a finished build with other settings ({differences}): pass "
                              "--overwrite to build it again with these, or choose another --out")
        print(f"{out} is complete already (manifest.json): nothing to submit (--overwrite builds it again)")
        return 0
    recorded = _jobs(out)
    previous = [] if args.overwrite else recorded  # --overwrite: a new build (dry runs show it too)
    if not args.dry_run:
        # Before anything on disk changes (--overwrite clears the build).
        if shutil.which("sbatch") is None:
            raise SubmitError("sbatch not found; run this on a Slurm login node (or use --dry-run)")
        if recorded:  # queued or running jobs stop a new submission, --overwrite or not
            active = [f"{task} {state}" for job in recorded[-1]["jobs"].values()
                      for task, state in job_states(job).items() if state in ACTIVE_STATES]
            if active:
                raise SubmitError(f"jobs of this build are still queued or running ({', '.join(active)}): wait "
                                  "for them, or scancel them first")
        check_sbatch_accepts(args, out)
    sources = [_absolute(s) for s in args.sources] if args.sources else None
    plan = plan_build(sources, _absolute(args.tokenizer), out, args.seq_len, args.val_fraction,
                      compression=args.compression, shard_size_limit=args.shard_size_limit, seed=args.seed,
                      text_field=args.text_field, part_size=args.part_size, dedup_mode=args.dedup,
                      split_key=args.split_key, overwrite=args.overwrite, dry_run=args.dry_run,
                      progress=sys.stderr.isatty(), skip_unreadable=args.skip_unreadable)
    n_parts = len(plan["parts"])
    tasks = args.tasks if args.tasks is not None else (previous[-1]["tasks"] if previous else min(n_parts, 1000))
    tasks = min(tasks, n_parts)
    if previous and previous[-1]["tasks"] != tasks and previous[-1]["plan_id"] == plan["plan_id"]:
        # Parts are dealt to tasks by index modulo the count; keep it within one build.
        raise SubmitError(f"this build was submitted with --tasks {previous[-1]['tasks']}: keep it (or leave "
                          "--tasks out) so the remaining tasks build the remaining parts")
    parts = P.parts_of(plan)
    # --overwrite: every task, whatever an old build left (a dry run has cleared nothing)
    todo = list(range(tasks)) if args.overwrite else pending_tasks(out, plan, tasks)
    py = shlex.quote(args.python)
    out_q = shlex.quote(str(out))
    logs = out / SLURM_DIR
    # The same task script hashes (while a dedup index is missing) or builds its parts.
    scripts = {
        "task": render(args, out, f'exec {py} -m data_prep.build_shards --out {out_q} '
                                  f'--task "$SLURM_ARRAY_TASK_ID" --tasks {tasks} --no-progress'
                                  + (" --skip-unreadable" if args.skip_unreadable else ""),
                       str(logs / "task-%A_%a.log")),
        "dedup": render(args, out, f"exec {py} -m data_prep.build_shards --out {out_q} --dedup-index",
                        str(logs / "dedup-%j.log")),
        "merge": render(args, out, f"exec {py} -m data_prep.build_shards --out {out_q} --merge",
                        str(logs / "merge-%j.log")),
    }

    def array_of(ids: list[int]) -> str:
        return ",".join(map(str, ids)) + (f"%{args.max_running}" if args.max_running else "")

    steps: list[tuple[str, str | None, str]] = []  # (name, --array or None, script), each after the last
    if plan["settings"].get("dedup", "none") == "exact" and (args.overwrite or not dedup.index_done(out, plan)):
        to_hash = [t for t in range(tasks) if args.overwrite
                   or any(not dedup.hashes_done(out, p) for p in P.tasks_parts(parts, t, tasks))]
        if to_hash:
            steps.append(("hash array", array_of(to_hash), "task"))
        steps.append(("dedup", None, "dedup"))
    if todo:
        steps.append(("array", array_of(todo), "task"))
    steps.append(("merge", None, "merge"))
    summary = (f"{len(parts)} parts of {plan['files']} files ({plan['bytes']:,} bytes, about "
               f"{plan['settings']['part_bytes']:,} per part) over {tasks} tasks; "
               f"{len(todo)} tasks to run{(' (' + array_of(todo) + ')') if todo else ''}; jobs: "
               + " -> ".join(name + (f" ({array})" if array else "") for name, array, _ in steps))
    if args.dry_run:
        print(f"# {summary}")
        for name in dict.fromkeys(script for _, _, script in steps):
            print(f"##### {logs / (name + '.sbatch')}")
            print(scripts[name], end="")
        return 0
    logs.mkdir(parents=True, exist_ok=True)
    for name, text in scripts.items():
        (logs / f"{name}.sbatch").write_text(text)
    jobs: dict[str, str] = {}
    record = {"submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "plan_id": plan["plan_id"], "tasks": tasks,
              "array": array_of(todo) if todo else "", "jobs": jobs}
    last = None
    for name, array, script in steps:
        options = [f"--array={array}"] if array else []
        if last is not None:  # cancelled, not left pending, when the step before it fails
            options += [f"--dependency=afterok:{last}", "--kill-on-invalid-dep=yes"]
        try:
            last = jobs[name] = submit([*options, str(logs / f"{script}.sbatch")])
        except SubmitUnknown as err:
            queued = ", ".join(f"{n} job {j}" for n, j in jobs.items()) or "none"
            print(f"error: {err} (the {name} job; queued before it: {queued}, recorded in {logs / JOBS_FILE})",
                  file=sys.stderr)
            return 1
        except SubmitError as err:
            if not jobs:
                raise
            return cancel_partial_chain(err, name, jobs, logs / JOBS_FILE, previous + [record])
        # Recorded at once: a later failure (or a kill of this command) must not hide queued jobs.
        P.write_json_atomic(logs / JOBS_FILE, {"jobs": previous + [record]})
    print(summary)
    print("submitted " + ", ".join(f"{name} job {job}" for name, job in jobs.items()))
    print(f"logs:   {logs}/" + ", ".join(dict.fromkeys(f"{script}-*.log" for _, _, script in steps)))
    print(f"status: python -m launch.submit_prep --status {out}")
    return 0


def cancel_partial_chain(err: SubmitError, failed: str, jobs: dict[str, str], jobs_file: Path,
                         records: list[dict]) -> int:
    """sbatch refused a later job of the chain: cancel the ones queued before it, so nothing of this
    submission runs (their record is kept if scancel fails too); returns the exit code."""
    queued = ", ".join(f"{name} job {job}" for name, job in jobs.items())
    try:
        res = subprocess.run(["scancel", *jobs.values()], capture_output=True, text=True, timeout=60)
        cancelled, why = res.returncode == 0, res.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as scancel_err:
        cancelled, why = False, str(scancel_err)
    if cancelled:
        records[-1]["jobs"] = {}
        P.write_json_atomic(jobs_file, {"jobs": records})
        print(f"error: {err} (the {failed} job)\ncancelled the jobs queued before it ({queued}): nothing was "
              "submitted", file=sys.stderr)
        return 2
    print(f"error: {err} (the {failed} job)\nthe jobs queued before it ({queued}) could not be cancelled "
          f"({why}): scancel them before submitting again; they are recorded in {jobs_file}",
          file=sys.stderr)
    return 1


def _jobs(out: Path) -> list[dict]:
    path = out / SLURM_DIR / JOBS_FILE
    return json.loads(path.read_text())["jobs"] if path.is_file() else []


def array_task_ids(spec: str) -> list[str]:
    """The task ids of a Slurm array spec as scontrol shows a pending array's one record
    ("0-3", "0,2-5:2", "0-9%2")."""
    ids = []
    for part in spec.split("%")[0].split(","):
        first, _, rest = part.partition("-")
        last, _, step = rest.partition(":")
        ids += [str(i) for i in range(int(first), int(last or first) + 1, int(step or 1))]
    return ids


def job_states(job: str) -> dict[str, str]:
    """Array task or job id -> Slurm state, for what scontrol still knows of ``job`` (the tasks of a
    pending array's one record each)."""
    if shutil.which("scontrol") is None:
        return {}
    res = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60)
    states = {}
    for line in res.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        task, state = fields.get("ArrayTaskId"), fields.get("JobState", "?")
        if task:
            states.update({f"{fields.get('ArrayJobId')}_{i}": state for i in array_task_ids(task)})
        else:
            states[fields.get("JobId", job)] = state
    return states


def format_status(out: Path) -> str:
    st = P.status(out)
    pct = 100 * st["bytes_done"] / max(st["bytes"], 1)
    lines = [f"{out}: {len(st['done'])}/{st['parts']} parts complete ({pct:.0f}% of {st['bytes']:,} input bytes), "
             f"{st['documents']:,} documents, {st['tokens']:,} tokens so far; "
             f"{'merged (manifest.json written)' if st['merged'] else 'not merged yet'}"]
    plan = P.read_plan(out)
    if plan["settings"].get("dedup", "none") == "exact":
        hashed = sum(dedup.hashes_done(out, p) for p in P.parts_of(plan))
        lines.append(f"  dedup exact: {hashed}/{st['parts']} parts hashed, index "
                     f"{'written' if dedup.index_done(out, plan) else 'not written yet'}")
    if st["todo"]:
        shown = ", ".join(map(str, st["todo"][:20])) + (" ..." if len(st["todo"]) > 20 else "")
        lines.append(f"  parts to build: {shown}")
    jobs = _jobs(out)
    if jobs:
        last = jobs[-1]
        lines.append(f"  last submission {last['submitted']}: {last['tasks']} tasks, array {last['array'] or '-'}")
        for name, job in last["jobs"].items():
            if job:
                states = job_states(job)
                counts: dict[str, int] = {}
                for state in states.values():
                    counts[state] = counts.get(state, 0) + 1
                shown = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no longer known to Slurm"
                lines.append(f"  {name} job {job}: {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.status:
            print(format_status(Path(args.status)))
            return 0
        return submit_build(args)
    except (SubmitError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"error: {err}\nnothing was submitted", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
