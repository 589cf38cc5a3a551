"""launch.submit and launch.submit_prep before and around sbatch, with stand-in sbatch/scancel
commands on PATH (the local Slurm cluster tests run the real ones): cheap checks come before the
expensive ones and before anything on disk changes, every path the job reads is absolute, and a
chain of jobs that sbatch refuses half-way leaves nothing queued."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

import pytest

from tests.synthetic import make_text, write_synthetic_shards


def stand_in(bin_dir, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def slurm_bin(tmp_path, monkeypatch):
    """sbatch that queues jobs 1001, 1002, ... and refuses the call numbered $SBATCH_FAIL_AT;
    scancel that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch_calls"
    stand_in(bin_dir, "sbatch", 'if [[ $1 == --test-only ]]; then grep -q "partition=nosuch" "$2" && '
                                '{ echo "sbatch: error: invalid partition specified: nosuch" >&2; exit 1; }; '
                                'echo "sbatch: Job 1 to start at now" >&2; exit 0; fi\n'
                                f'n=$(( $(cat {calls} 2>/dev/null || echo 0) + 1 )); echo $n > {calls}\n'
                                'if [[ $n == "${SBATCH_FAIL_AT:-0}" ]]; then echo "QOSMaxSubmitJobPerUserLimit" >&2; '
                                'exit 1; fi\necho $((1000 + n))\n')
    stand_in(bin_dir, "scancel", f'echo "$@" >> {tmp_path / "scancelled"}\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_submit_checks_the_command_line_before_the_config(tmp_path, capsys):
    from launch.submit import main

    # The config does not exist: the argument error must come first (no torch import, no data read).
    code = main([str(tmp_path / "missing.yaml"), "--nodes", "1", "--cpu-procs-per-node", "1",
                 "--time", "00:10:00", "--signal-seconds", "900", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "--signal-seconds 900 must be between 1 and the time limit (600 s)" in err, err
    code = main([str(tmp_path / "missing.yaml"), "--nodes", "1", "--cpu-procs-per-node", "1",
                 "--time", "00:10:00", "--job-name", "my run", "--dry-run"])
    assert code == 2 and "--job-name 'my run' must be a word without spaces" in capsys.readouterr().err
    # An --sbatch-arg that repeats what the script sets would override the checked value.
    for extra, message in (("--nodes=4", "sets --nodes itself, and the job was checked for that value; set it "
                                          "with --nodes"),
                           ("-t 48:00:00", "sets --time itself"), ("--signal=USR1@60", "set it with --signal-seconds"),
                           ("--output=x.log", "the template fixes it")):
        code = main([str(tmp_path / "missing.yaml"), "--nodes", "1", "--cpu-procs-per-node", "1",
                     "--time", "00:10:00", f"--sbatch-arg={extra}", "--dry-run"])
        assert code == 2 and message in capsys.readouterr().err, extra
    # A time limit hardly longer than the signal's lead: noted, as the job may requeue before training.
    main([str(tmp_path / "missing.yaml"), "--nodes", "1", "--cpu-procs-per-node", "1", "--time", "00:08:00",
          "--dry-run"])
    assert "note: --time leaves 180 s before the time-limit signal" in capsys.readouterr().err
    # --gres in place of --gpus-per-node's request, where a cluster takes only that.
    from launch.sbatch import SubmitError, sbatch_lines

    gpus = argparse.Namespace(gpus_per_node=8, partition=None, account=None, qos=None, constraint=None,
                              cpus_per_task=None, exclusive=False, sbatch_arg=["--gres=gpu:8", "--mem=0"])
    assert sbatch_lines(gpus) == ["#SBATCH --gres=gpu:8", "#SBATCH --mem=0"]
    gpus.sbatch_arg = ["--mem=0"]
    assert sbatch_lines(gpus) == ["#SBATCH --gpus-per-node=8", "#SBATCH --mem=0"]
    gpus.sbatch_arg = ["--gres=nvme:1"]  # no GPU among them: --gpus-per-node still asks
    assert sbatch_lines(gpus) == ["#SBATCH --gpus-per-node=8", "#SBATCH --gres=nvme:1"]
    gpus.sbatch_arg = ["--gres=nvme:1,gpu:h100:4"]  # 8 processes on 4 GPUs
    with pytest.raises(SubmitError, match="--gres asks for 4 GPUs per node, but --gpus-per-node 8"):
        sbatch_lines(gpus)


def test_submit_makes_every_path_absolute_and_refuses_plugins_of_the_current_directory(
        tmp_path, monkeypatch, capsys):
    import yaml

    from launch.submit import main

    write_synthetic_shards(tmp_path / "web")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"context": "1 2", "choices": ["3", "4"], "label": 0}) + "\n")
    args = ["configs/tiny_dense.yaml", "data.mix=[{shards: web/shards, name: web}]", "data.tokenizer=web/tokenizer",
            "model.vocab_size=256", "model.max_seq_len=32", "run.dir=run", "eval.downstream_tasks=[tasks.jsonl]",
            "eval.downstream_interval=10", "--nodes", "1", "--cpu-procs-per-node", "1", "--time", "00:10:00",
            "--dry-run"]
    from tests.dist_utils import REPO

    args[0] = str(REPO / args[0])
    assert main(args) == 0, capsys.readouterr().err
    resolved = yaml.safe_load(capsys.readouterr().out.split(f"##### {tmp_path / 'run' / 'slurm_config.yaml'}\n")[1])
    assert resolved["data"]["mix"][0]["shards"] == str(tmp_path / "web" / "shards")
    assert resolved["eval"]["downstream_tasks"] == [str(tmp_path / "tasks.jsonl")]
    assert resolved["run"]["dir"] == str(tmp_path / "run")
    # A plug-in module importable only because it lies in the current directory: the job, which runs
    # in the repository, would not find it.
    (tmp_path / "local_kinds.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert main([*args, "model.plugins=[local_kinds]"]) == 2
    err = capsys.readouterr().err
    assert f"model.plugins module 'local_kinds' is imported from {tmp_path} (the current directory" in err, err
    monkeypatch.setenv("PYTHONPATH", ".")  # relative: read from the repository in the job
    assert main([*args, "model.plugins=[local_kinds]"]) == 2
    assert f"export PYTHONPATH={tmp_path}" in capsys.readouterr().err
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert main([*args, "model.plugins=[local_kinds]"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("text, seconds", [("90", 5400), ("10:30", 630), ("01:00:00", 3600), ("1-02", 93600),
                                           ("1-02:03", 93780), ("1-02:03:04", 93784)])
def test_slurm_time_limits_in_every_form_slurm_takes(text, seconds):
    from launch.sbatch import SubmitError, parse_time

    assert parse_time(text) == seconds
    for bad in ("0", "abc", "1:2:3:4"):
        with pytest.raises(SubmitError):
            parse_time(bad)


def test_the_job_script_gives_the_save_time_to_spare_and_each_cpu_process_its_threads(tmp_path, capsys):
    """Without --shutdown-timeout the agents wait --signal-seconds - 30 (at least 10) for the save,
    so they end before Slurm's kill; CPU processes share the task's CPUs."""
    from launch.submit import main
    from tests.dist_utils import REPO

    write_synthetic_shards(tmp_path / "web")
    base = [str(REPO / "configs/tiny_dense.yaml"), f"data.shards={tmp_path}/web/shards",
            f"data.tokenizer={tmp_path}/web/tokenizer", "model.vocab_size=256", "model.max_seq_len=32",
            f"run.dir={tmp_path}/run", "--nodes", "1", "--cpu-procs-per-node", "2", "--time", "00:10:00", "--dry-run"]
    for signal_s, cpus, shutdown, threads in (("120", "8", 90, 4), ("20", "1", 10, 1)):
        assert main([*base, "--signal-seconds", signal_s, "--cpus-per-task", cpus]) == 0, capsys.readouterr().err
        script = capsys.readouterr().out
        assert f"SHUTDOWN_TIMEOUT={shutdown}  #" in script and f"#SBATCH --signal=B:USR1@{signal_s}" in script
        assert f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads}}}" in script


def prep_args(tmp_path, tok_dir, *extra: str) -> list[str]:
    import random

    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    rng = random.Random(0)
    for i in range(3):
        (corpus / f"doc{i}.jsonl").write_text("".join(json.dumps({"text": make_text(rng, 4)}) + "\n"
                                                      for _ in range(20)))
    return ["--tokenizer", str(tok_dir), "--out", str(tmp_path / "out"), "--sources", str(corpus),
            "--seq-len", "16", "--part-size", "1kb", "--tasks", "2", "--time", "00:05:00", *extra]


def test_prep_overwrite_keeps_a_finished_build_when_an_argument_is_wrong(tmp_path, tok_dir, slurm_bin, capsys):
    from launch.submit_prep import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    (out / "train").mkdir()
    code = main(prep_args(tmp_path, tok_dir, "--overwrite", "--job-name", "my prep"))
    assert code == 2 and "--job-name 'my prep' must be a word without spaces" in capsys.readouterr().err
    assert (out / "manifest.json").is_file() and (out / "train").is_dir()
    assert main(prep_args(tmp_path, tok_dir, "--tasks", "0")) == 2
    assert "--tasks 0 must be >= 1" in capsys.readouterr().err
    # values sbatch itself would refuse, once --overwrite had cleared the build
    for extra, message in ((["--cpus-per-task", "0"], "--cpus-per-task 0 must be >= 1"),
                           (["--max-running", "-1"], "--max-running -1 must be >= 1"),
                           (["--out", str(tmp_path / "run#2")], "cannot take a path with spaces, '%', '#'"),
                           (["--job-name", "prep'2"], "must be a word without spaces, '%', '#', quotes")):
        assert main(prep_args(tmp_path, tok_dir, "--overwrite", *extra)) == 2
        assert message in capsys.readouterr().err, extra
    # ... and a partition (account, QoS, option) only sbatch can judge: asked with --test-only first
    assert main(prep_args(tmp_path, tok_dir, "--overwrite", "--partition", "nosuch")) == 2
    assert "sbatch refuses these job settings (sbatch: error: invalid partition" in capsys.readouterr().err
    assert (out / "manifest.json").is_file() and (out / "train").is_dir()
    assert not (tmp_path / "sbatch_calls").exists()


def test_prep_of_a_finished_build_with_other_settings_and_a_relative_python(tmp_path, tok_dir, slurm_bin, capsys,
                                                                            monkeypatch):
    """A finished local build asked for again: complete with the same settings, its relative paths
    read from where it was planned; refused naming every setting that differs, among them the split
    key, the compression and a tokenizer retrained in place."""
    import shutil

    from data_prep import build_shards as bs
    from launch.submit_prep import main

    prep_args(tmp_path, tok_dir)  # writes tmp_path/corpus
    shutil.copytree(tok_dir, tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    bs.plan_build(["corpus"], "tok", "out", seq_len=16, val_fraction=0.1, compression="none", split_key="path")
    bs.build_parts(Path("out"), workers=1)
    bs.merge_parts(Path("out"))
    same = ["--tokenizer", "tok", "--out", "out", "--sources", "corpus", "--seq-len", "16", "--val-fraction", "0.1",
            "--compression", "none", "--split-key", "path", "--time", "00:05:00"]
    assert main(same) == 0
    assert "is complete already (manifest.json): nothing to submit" in capsys.readouterr().out
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    absolute = [str(tmp_path / a) if a in ("tok", "out", "corpus") else a for a in same]
    assert main(absolute) == 0 and "complete already" in capsys.readouterr().out
    defaults = absolute[:absolute.index("--compression")] + ["--time", "00:05:00"]
    assert main(defaults + ["--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert "finished build with other settings (seq_len: 16 there, 32 now, split_key: 'path' there, " \
           "'relative' now, compression: None there, 'zstd' now)" in err
    record = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps({**record, "sha256": "0" * 64}))
    assert main(absolute) == 2
    assert f"(tokenizer_sha256: {record['sha256']!r} there, {'0' * 64!r} now)" in capsys.readouterr().err
    assert not (tmp_path / "sbatch_calls").exists()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    assert main(prep_args(tmp_path, tok_dir, "--overwrite", "--python", "venv/bin/python")) == 2
    assert f"--python {tmp_path / 'venv/bin/python'}: no executable there" in capsys.readouterr().err


def test_prep_sources_named_by_links_keep_their_names(tmp_path, monkeypatch):
    """A source given by a link is keyed (--split-key relative) by the link's name, as a local build
    keys it: the same documents go to val."""
    from launch.submit_prep import _absolute

    (tmp_path / "dump-2024.jsonl").write_text("")
    (tmp_path / "latest.jsonl").symlink_to(tmp_path / "dump-2024.jsonl")
    monkeypatch.chdir(tmp_path)
    assert _absolute("latest.jsonl") == str(tmp_path / "latest.jsonl")


def test_prep_tasks_take_skip_unreadable(tmp_path, tok_dir, slurm_bin, capsys):
    from launch.submit_prep import main

    assert main(prep_args(tmp_path, tok_dir, "--skip-unreadable", "--dry-run")) == 0
    assert '--tasks 2 --no-progress --skip-unreadable' in capsys.readouterr().out


def test_prep_sbatch_args_are_judged_by_the_prep_script(tmp_path, tok_dir, capsys, monkeypatch):
    """The prep jobs set neither --requeue nor --nodes (a preemptible partition may requeue a task: its
    parts resume); what they do set is refused with the prep command's own way to set it."""
    from launch import submit_prep
    from launch.submit_prep import main

    assert main(prep_args(tmp_path, tok_dir, "--dry-run", "--sbatch-arg=--requeue")) == 0
    assert "#SBATCH --requeue" in capsys.readouterr().out
    for extra, how in (("--time=01:00:00", "set it with --time"), ("--array=0-3", "sets it on each job it submits"),
                       ("-d afterok:5", "sets it on each job it submits"), ("--output=x.log", "the template fixes it")):
        assert main(prep_args(tmp_path, tok_dir, "--dry-run", f"--sbatch-arg={extra}")) == 2
        assert how in capsys.readouterr().err, extra
    # A template placeholder the command does not fill is named, not a traceback.
    template = tmp_path / "prep.sbatch"
    template.write_text(submit_prep.TEMPLATE.read_text() + "#SBATCH --mem={{MEM}}\n")
    monkeypatch.setattr(submit_prep, "TEMPLATE", template)
    assert main(prep_args(tmp_path, tok_dir, "--dry-run")) == 2
    assert "slurm/prep.sbatch has placeholders ['MEM'] that launch.submit_prep does not fill" in capsys.readouterr().err


def test_prep_chain_with_an_unanswered_sbatch_keeps_the_queued_jobs_on_record(tmp_path, tok_dir, slurm_bin,
                                                                              monkeypatch, capsys):
    import subprocess

    from launch import sbatch
    from launch.submit_prep import JOBS_FILE, SLURM_DIR, main

    calls, real_run = [], subprocess.run

    def second_times_out(cmd, **kwargs):
        if "--test-only" in cmd:  # the settings check before anything is queued
            return real_run(cmd, **kwargs)
        calls.append(cmd)
        if len(calls) == 2:
            raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(sbatch.subprocess, "run", second_times_out)
    code = main(prep_args(tmp_path, tok_dir, "--dedup", "exact"))
    err = capsys.readouterr().err
    assert code == 1 and "may be queued: look with squeue" in err and "hash array job 1001" in err, err
    assert not (tmp_path / "scancelled").exists()  # the unanswered job may be running: nothing cancelled
    records = json.loads((tmp_path / "out" / SLURM_DIR / JOBS_FILE).read_text())["jobs"]
    assert records[-1]["jobs"] == {"hash array": "1001"}


def test_prep_tasks_throttle_running_jobs_and_overwrite(tmp_path, tok_dir, slurm_bin, capsys):
    """--tasks beyond the parts run one task per part, --max-running throttles the array; a build with
    jobs still running takes no new submission; --overwrite submits every task whatever the last
    submission's --tasks and the parts built since."""
    from data_prep import build_shards as bs
    from data_prep import parts as P
    from launch.submit_prep import JOBS_FILE, SLURM_DIR, main

    out = tmp_path / "out"
    assert main(prep_args(tmp_path, tok_dir, "--max-running", "0")) == 2
    assert "--max-running 0 must be >= 1" in capsys.readouterr().err
    assert main(prep_args(tmp_path, tok_dir, "--tasks", "50", "--max-running", "2")) == 0
    parts = len(P.read_plan(out)["parts"])
    record = json.loads((out / SLURM_DIR / JOBS_FILE).read_text())["jobs"][-1]
    assert parts >= 2 and record["tasks"] == parts
    assert record["array"] == ",".join(map(str, range(parts))) + "%2"
    assert main(["--status", str(out)]) == 0
    assert f"0/{parts} parts complete (0% of" in capsys.readouterr().out
    stand_in(tmp_path / "bin", "scontrol", 'echo "JobId=1001 ArrayJobId=1001 ArrayTaskId=1 JobState=RUNNING"\n')
    assert main(prep_args(tmp_path, tok_dir, "--overwrite")) == 2
    assert "jobs of this build are still queued or running (1001_1 RUNNING" in capsys.readouterr().err
    stand_in(tmp_path / "bin", "scontrol", 'echo "JobId=1001 ArrayJobId=1001 ArrayTaskId=1 JobState=COMPLETED"\n')
    bs.build_parts(out, workers=1)
    assert main(prep_args(tmp_path, tok_dir, "--overwrite", "--tasks", "1", "--dry-run")) == 0
    assert "over 1 tasks; 1 tasks to run (0)" in capsys.readouterr().out
    assert main(prep_args(tmp_path, tok_dir, "--overwrite", "--tasks", "1")) == 0
    assert json.loads((out / SLURM_DIR / JOBS_FILE).read_text())["jobs"][-1]["tasks"] == 1


def test_prep_chain_refused_half_way_is_cancelled(tmp_path, tok_dir, slurm_bin, monkeypatch, capsys):
    from launch.submit_prep import JOBS_FILE, SLURM_DIR, main

    monkeypatch.setenv("SBATCH_FAIL_AT", "2")  # the hash array is queued, the dedup job refused
    code = main(prep_args(tmp_path, tok_dir, "--dedup", "exact"))
    err = capsys.readouterr().err
    assert code == 2 and "QOSMaxSubmitJobPerUserLimit" in err and "cancelled the jobs queued before it" in err, err
    assert (tmp_path / "scancelled").read_text().split() == ["1001"]
    records = json.loads((tmp_path / "out" / SLURM_DIR / JOBS_FILE).read_text())["jobs"]
    assert records[-1]["jobs"] == {}  # nothing of it left queued, so nothing to wait for
    # scancel fails too: the queued job stays on record (a rerun then waits for it) and the exit code says so.
    (tmp_path / "sbatch_calls").unlink()
    stand_in(tmp_path / "bin", "scancel", 'echo "scancel: error: Unable to contact slurm controller" >&2; exit 1\n')
    code = main(prep_args(tmp_path, tok_dir, "--dedup", "exact"))
    err = capsys.readouterr().err
    assert code == 1 and "could not be cancelled" in err and "hash array job 1001" in err, err
    records = json.loads((tmp_path / "out" / SLURM_DIR / JOBS_FILE).read_text())["jobs"]
    assert records[-1]["jobs"] == {"hash array": "1001"}


def test_submit_takes_train_resume_until_the_job_has_saved(tmp_path, monkeypatch, capsys):
    """train.resume (none, or a checkpoint to roll back to) applies until the job has saved a
    checkpoint; its requeues then resume the run's newest, else each would start over or roll back
    again."""
    import subprocess

    from launch.submit import main
    from tests.dist_utils import REPO

    write_synthetic_shards(tmp_path / "web")
    monkeypatch.chdir(tmp_path)
    args = [str(REPO / "configs/tiny_dense.yaml"), "data.shards=web/shards", "data.tokenizer=web/tokenizer",
            "model.vocab_size=256", "model.max_seq_len=32", "run.dir=run", "--nodes", "1",
            "--cpu-procs-per-node", "1", "--time", "00:10:00", "--dry-run"]

    def resume_at(script: str, last_save_job: str | None) -> str:
        """The train.resume a start of job 77 passes, after a save by `last_save_job` (None: none)."""
        start = script.index("RUN_DIR=")
        lines = script[start:script.index("\nfi\n", script.index("RESUME=", start)) + 4]
        marker = tmp_path / "run" / "last_save_job"
        marker.parent.mkdir(exist_ok=True)
        marker.unlink(missing_ok=True)
        if last_save_job is not None:
            marker.write_text(last_save_job)
        env = {**os.environ, "SLURM_JOB_ID": "77"}
        return subprocess.run(["bash", "-c", lines + 'echo "$RESUME"'], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert main([*args, "train.resume=none"]) == 0
    out = capsys.readouterr()
    assert "train.resume=none applies until the job saves a checkpoint" in out.err
    assert 'train.resume="$RESUME"' in out.out and "resume: auto" in out.out  # the job's config
    # Once a job has saved, its requeues and a resubmission of the script (job 12 saved, 77 starts) go on.
    assert [resume_at(out.out, job) for job in (None, "12", "77")] == ["none", "auto", "auto"]
    tag = tmp_path / "run" / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    assert main([*args, "train.resume=run/checkpoints/step_00000004"]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
    from pretrain.config import load_config

    model = load_config(args[0], [a for a in args[1:] if "=" in a]).to_dict()["model"]
    marker = {"model": model, "step": 4, "world_size": 1, "tensor_parallel": 1, "zero_stage": 1}
    (tag / "COMPLETE").write_text(json.dumps(marker))
    assert main([*args, "train.resume=run/checkpoints/step_00000004"]) == 2  # its files are checked too
    assert "is missing 3 file(s): rank_00000.pt, mp_rank_00_model_states.pt, [bf16_]zero_pp_rank_0_mp_rank_00_" \
        "optim_states.pt" in capsys.readouterr().err
    for name in ("rank_00000.pt", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tag / name).write_bytes(b"")
    assert main([*args, "train.resume=run/checkpoints/step_00000004"]) == 0
    script = capsys.readouterr().out
    assert [resume_at(script, job) for job in (None, "77")] == [str(tag), "auto"]
    assert main(args) == 0
    script = capsys.readouterr().out
    assert [resume_at(script, job) for job in (None, "77")] == ["auto", "auto"]
    # Submitted (sbatch faked): a given train.resume removes the marker of an earlier job's save, so
    # that the new script takes it; continuing (auto) keeps it.
    import launch.submit as submit_module

    monkeypatch.setattr(submit_module.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(submit_module, "submit", lambda argv: "123")
    marker = tmp_path / "run" / "last_save_job"
    dry = [a for a in args if a != "--dry-run"]
    for resume, kept in (("train.resume=auto", True), ("train.resume=none", False)):
        marker.write_text("12")
        assert main([*dry, resume, "--force"]) == 0
        assert marker.exists() == kept, resume


def test_status_of_a_shard_build_is_the_build_s(tmp_path, tok_dir, capsys):
    """launch.status given a shard build's directory reports the build (parts, documents, merged),
    as launch.submit_prep --status does, not an empty training run."""
    from data_prep import build_shards as bs
    from launch.status import main as status_main
    from launch.submit_prep import main as prep_main

    args = prep_args(tmp_path, tok_dir)
    sources, out = args[args.index("--sources") + 1], tmp_path / "out"
    manifest = bs.build_shards([sources], tok_dir, out, seq_len=16, val_fraction=0.1, workers=1)
    assert status_main([str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{manifest['documents']} documents" in text and "merged (manifest.json written)" in text
    assert "job:" not in text
    assert prep_main(["--status", str(out)]) == 0 and capsys.readouterr().out == text
    assert status_main([str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["merged"] and report["documents"] == manifest["documents"] and report["todo"] == []


def test_status_of_a_job_slurm_forgot_is_its_batch_script_s_record(tmp_path, monkeypatch, capsys):
    """Once Slurm no longer lists the job (no accounting), launch.status takes how it ended from
    slurm_history.log, and prints the last end line."""
    from launch import status

    run = tmp_path / "run"
    run.mkdir()
    (run / "slurm_job_ids.txt").write_text("77\n")
    (run / "slurm_history.log").write_text(
        "2026-12-07T06:00:00Z job=77 restarts=0 start node=n1\n"
        "2026-12-07T06:05:00Z job=77 restarts=0 end rc=1 signal=none action=failed\n")
    monkeypatch.setattr(status, "_run", lambda cmd: None)  # scontrol, squeue and sacct know nothing of it
    assert status.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "job:         77 ended: failed (exit code 1, from slurm_history.log)" in out
    assert "last end:    2026-12-07T06:05:00Z job=77 restarts=0 end rc=1 signal=none action=failed" in out


def test_status_and_submit_see_the_job_that_trains_in_the_run_dir(tmp_path, monkeypatch, capsys):
    """A job submitted again by hand records itself as the newest and is refused by the run's lock:
    launch.status names the job that holds the run directory, and launch.submit counts it as active
    (looking at the lock never takes it from a run that starts)."""
    import subprocess
    import sys

    from launch import status, submit
    from pretrain import run_lock
    from tests.dist_utils import REPO, child_env

    run = tmp_path / "run"
    run.mkdir()
    (run / "slurm_job_ids.txt").write_text("91\n92\n")  # 92: the refused duplicate
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from pretrain import run_lock; run_lock.hold(Path(sys.argv[1])); print('held', "
                               "flush=True); time.sleep(600)", str(run)], cwd=REPO,
                              env=child_env(SLURM_JOB_ID="91"), stdout=subprocess.PIPE, text=True)
    monkeypatch.setattr(status, "_run", lambda cmd: None)
    try:
        assert holder.stdout.readline() == "held\n"
        assert status.main([str(run)]) == 0
        assert "running:     host " in capsys.readouterr().out
        assert run_lock.slurm_job_of(status.status(run)["running_in_it"]) == "91"
        assert submit.active_job(run) == "91"
    finally:
        holder.kill()
        holder.wait()
    assert run_lock.holder(run) is None and status.status(run)["running_in_it"] is None


@pytest.mark.parametrize("end, why", [
    ("rc=0 signal=USR1 action=stopped", "the time limit stopped it after 3 requeues (launch.submit --max-requeues)"),
    ("rc=0 signal=ALRM action=stopped",
     "train.stop_after_minutes stopped it after 3 requeues (launch.submit --max-requeues)"),
    ("rc=0 signal=TERM action=stopped", "it stopped on SIGTERM (preemption or cancel)"),
    ("rc=1 signal=none action=failed", "its last job run failed (exit code 1; see the log)"),
    ("rc=0 signal=USR1 action=requeue\n2026-12-07T06:05:01Z job=77 restarts=3 requeue failed",
     "the time limit stopped it and its requeue (scontrol requeue) failed")])
def test_status_says_why_an_ended_run_is_short_of_its_steps_and_how_to_go_on(tmp_path, monkeypatch, capsys, end, why):
    from launch import status

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004" / "COMPLETE").write_text(json.dumps({"step": 4}))
    (run / "slurm_config.yaml").write_text("train:\n  steps: 10\n")
    (run / "slurm_job_ids.txt").write_text("77\n")
    (run / "slurm_history.log").write_text(f"2026-12-07T06:05:00Z job=77 restarts=3 end {end}\n")
    monkeypatch.setattr(status, "_run", lambda cmd: None)
    assert status.main([str(run)]) == 0
    script = f"`sbatch {run.resolve()}/train.sbatch`"
    assert f"unfinished:  step 4 of 10 saved: {why}; {script} starts it again as submitted" in capsys.readouterr().out
    (run / "last_save_job").write_text("77")  # a job of the script saved: its resubmissions resume
    assert status.main([str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unfinished"] == f"step 4 of 10 saved: {why}; {script} resumes from it"
    # Queued or running, or with its last step saved: nothing to say.
    monkeypatch.setattr(status, "slurm_state", lambda job: {"state": "PENDING", "reason": "BeginTime",
                                                            "restarts": 3, "exit_code": None, "source": "scontrol"})
    assert status.status(run)["unfinished"] is None
    monkeypatch.undo()
    monkeypatch.setattr(status, "_run", lambda cmd: None)
    # Slurm does not answer and the job's end is not recorded: it may still run, so no resubmission
    (run / "slurm_history.log").write_text("2026-12-07T06:00:00Z job=77 restarts=3 start nodes=n1\n")
    assert status.status(run)["unfinished"] is None
    (run / "slurm_config.yaml").write_text("train:\n  steps: 4\n")
    assert status.status(run)["unfinished"] is None
    # A run never submitted to Slurm (launch.local): its status, nothing unfinished to say
    local = tmp_path / "local"
    (local / "checkpoints").mkdir(parents=True)
    (local / "config.yaml").write_text("train:\n  steps: 10\n")
    assert status.main([str(local)]) == 0
    assert "none submitted from this run dir" in capsys.readouterr().out
    # A folder that holds no run (a mistyped path, an export): an error, not "not started yet"
    (tmp_path / "empty").mkdir()
    assert status.main([str(tmp_path / "empty")]) == 2
    assert f"error: {tmp_path / 'empty'} holds no run (none of config.yaml, checkpoints, metrics.jsonl" in capsys.readouterr().err


def test_prep_status_counts_the_tasks_of_a_pending_array(monkeypatch):
    """scontrol shows a pending array as one record (ArrayTaskId=0-1): each of its tasks counts."""
    import subprocess
    from types import SimpleNamespace

    from launch import submit_prep

    shown = ("JobId=31 ArrayJobId=31 ArrayTaskId=2-6:2%1 JobState=PENDING\n"
             "JobId=32 ArrayJobId=31 ArrayTaskId=0 JobState=RUNNING\n"
             "JobId=33 ArrayJobId=31 ArrayTaskId=1 JobState=COMPLETED\n")
    monkeypatch.setattr(submit_prep.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=shown, returncode=0))
    assert submit_prep.job_states("31") == {"31_2": "PENDING", "31_4": "PENDING", "31_6": "PENDING",
                                            "31_0": "RUNNING", "31_1": "COMPLETED"}
