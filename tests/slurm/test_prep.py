"""launch.submit_prep on the local two-node Slurm cluster: a shard build as a 2-task job array plus
a merge job gives the samples of the one-machine build; a task killed while running is resubmitted
alone and the result is the same."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from data_prep import parts as P
from data_prep.build_shards import build_shards
from data_prep.train_tokenizer import train_tokenizer
from tests.slurm.test_cluster import _slurm_nodes
from tests.slurm.test_submit import TERMINAL, job_info, run_cli
from tests.synthetic import make_text
from tests.test_corpora import make_corpus, samples_multiset, write_parquet

pytestmark = pytest.mark.slurm

JOB_TIMEOUT_S = 240


def wait_state(job: str, states: set[str], out: Path, timeout: float = JOB_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_info(job).get("JobState", "")
        if state in states:
            return state
        if state in TERMINAL:
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted((out / "slurm").glob("*.log")))
            pytest.fail(f"job {job} ended {state}, expected {states}\n{logs}")
        time.sleep(0.2)
    subprocess.run(["scancel", job], check=False, timeout=30)
    pytest.fail(f"timed out waiting for job {job} to reach {states} (now {job_info(job).get('JobState')})")


def test_array_build_equals_local_build_and_a_killed_task_reruns_alone(tmp_path):
    _slurm_nodes()
    corpus = tmp_path / "corpus"
    make_corpus(corpus, files=5)
    write_parquet(corpus / "big.parquet", [make_text(random.Random(i), 6) for i in range(40)],
                  row_group_size=8)
    tok = tmp_path / "tok"
    train_tokenizer([corpus], tok, vocab_size=300, num_threads=1)
    settings = dict(seq_len=16, val_fraction=0.2, part_size="2kb")
    local = build_shards([corpus], tok, tmp_path / "local", workers=1, **settings)
    assert local["parts"] >= 4

    out = tmp_path / "cluster"
    cmd = [sys.executable, "-m", "launch.submit_prep", "--tokenizer", str(tok), "--out", str(out),
           "--sources", str(corpus), "--seq-len", "16", "--val-fraction", "0.2", "--part-size", "2kb",
           "--tasks", "2", "--time", "00:05:00", "--cpus-per-task", "1", "--python", sys.executable]
    dry = run_cli(cmd + ["--dry-run"])
    assert dry.returncode == 0, dry.stderr
    assert f"{local['parts']} parts" in dry.stdout and "jobs: array (0,1) -> merge" in dry.stdout
    assert '--task "$SLURM_ARRAY_TASK_ID" --tasks 2' in dry.stdout and not out.exists()

    res = run_cli(cmd)
    assert res.returncode == 0, res.stdout + res.stderr
    array_job, merge_job = re.search(r"submitted array job (\d+), merge job (\d+)", res.stdout).groups()
    # Kill task 1 as soon as it runs (it is still importing when the signal comes).
    wait_state(f"{array_job}_1", {"RUNNING"}, out)
    subprocess.run(["scancel", f"{array_job}_1"], check=True, timeout=30)
    wait_state(f"{array_job}_0", {"COMPLETED"}, out)
    assert wait_state(merge_job, {"CANCELLED"} | TERMINAL - {"COMPLETED"}, out) != "COMPLETED"

    plan = P.read_plan(out)
    parts = P.parts_of(plan)
    mine = {p.index for p in P.tasks_parts(parts, 1, 2)}
    assert set(P.status(out)["todo"]) == mine and not (out / "manifest.json").exists()
    # What a kill in the middle of writing leaves behind must not end up in the shards.
    (out / "train" / parts[1].name).mkdir(parents=True, exist_ok=True)
    (out / "train" / parts[1].name / "shard.00000.mds.zstd").write_bytes(b"half a shard")
    done = {p.index: P.marker_path(out, p).stat().st_mtime_ns for p in parts if p.index not in mine}

    status = run_cli([sys.executable, "-m", "launch.submit_prep", "--status", str(out)])
    assert f"{len(parts) - len(mine)}/{len(parts)} parts complete" in status.stdout, status.stdout + status.stderr

    again = run_cli(cmd)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 tasks to run (1)" in again.stdout
    array_job, merge_job = re.search(r"submitted array job (\d+), merge job (\d+)", again.stdout).groups()
    wait_state(merge_job, {"COMPLETED"}, out)
    assert job_info(f"{array_job}_1").get("JobState") == "COMPLETED"
    assert {p.index: P.marker_path(out, p).stat().st_mtime_ns for p in parts if p.index not in mine} == done

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"] == local["splits"] and manifest["plan_id"] == local["plan_id"]
    assert samples_multiset(out) == samples_multiset(tmp_path / "local")
    assert sum(samples_multiset(out).values()) == local["splits"]["train"]["samples"] + local["splits"]["val"]["samples"]
    final = run_cli([sys.executable, "-m", "launch.submit_prep", "--status", str(out)])
    assert f"{len(parts)}/{len(parts)} parts complete" in final.stdout and "merged (manifest.json" in final.stdout
    assert Counter(f.name.split("-")[0] for f in (out / "slurm").glob("*.log"))["task"] == 3


def test_array_build_with_exact_dedup_equals_local_build(tmp_path):
    _slurm_nodes()
    corpus = tmp_path / "corpus"
    texts = make_corpus(corpus, files=4)
    (corpus / "copies.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[::3]))
    tok = tmp_path / "tok"
    train_tokenizer([corpus], tok, vocab_size=300, num_threads=1)
    local = build_shards([corpus], tok, tmp_path / "local", workers=1, seq_len=16, val_fraction=0.2,
                         part_size="2kb", dedup_mode="exact")
    assert local["dedup"]["dropped_documents"] == len(texts[::3])

    out = tmp_path / "cluster"
    res = run_cli([sys.executable, "-m", "launch.submit_prep", "--tokenizer", str(tok), "--out", str(out),
                   "--sources", str(corpus), "--seq-len", "16", "--val-fraction", "0.2", "--part-size", "2kb",
                   "--dedup", "exact", "--tasks", "2", "--time", "00:05:00", "--cpus-per-task", "1",
                   "--python", sys.executable])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "jobs: hash array (0,1) -> dedup -> array (0,1) -> merge" in res.stdout
    submitted = next(line for line in res.stdout.splitlines() if line.startswith("submitted "))
    jobs = dict(item.rsplit(" job ", 1) for item in submitted.removeprefix("submitted ").split(", "))
    assert list(jobs) == ["hash array", "dedup", "array", "merge"], submitted
    wait_state(jobs["merge"], {"COMPLETED"}, out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dedup"] == local["dedup"] and manifest["splits"] == local["splits"]
    assert samples_multiset(out) == samples_multiset(tmp_path / "local")
