"""The GPU check script, run end to end on the CPU (tiny fp32 models) so that its own code is
exercised wherever the suite runs; the GPU numbers come from running it on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.dist_utils import REPO, child_env

FAMILIES = "dense-1b,hybrid-1b,uoe-1b grouped-gemm"


def test_cpu_smoke_run_writes_report(tmp_path):
    earlier = tmp_path / "earlier" / "report.json"  # --baseline: rows both runs have, before -> now
    earlier.parent.mkdir()
    earlier.write_text(json.dumps({"date": "2026-01-01", "environment": {"gpu": "GPU X"}, "throughput": {
        "dense-1b": {"tokens_per_s": 1000.0, "mfu": 0.1, "peak_memory_gb": 1.0},
        "gone": {"tokens_per_s": 1.0}},
        "attention": {"lisa @ 64": {"train_ms": 5.0, "train_x_softmax": 3.0, "kept_mb": 1.0, "batch": 8}}}))
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--steps", "1",
                          "--families", FAMILIES, "--out-dir", str(tmp_path), "--baseline", str(earlier)],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [report_file] = tmp_path.glob("gpu_check-*-cpu-smoke.json")
    report = json.loads(report_file.read_text())
    names = FAMILIES.split(",")
    assert list(report["throughput"]) == names
    seconds = report["part_seconds"]  # every part that ran, in its order
    assert list(seconds)[:2] == ["check:device_info", "check:correctness"] and names[0] in seconds, seconds
    assert all(s > 0 for s in seconds.values())
    assert "Seconds per part" in report_file.with_suffix(".md").read_text()
    for name in names:
        row = report["throughput"][name]
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["peak_memory_gb"] > 0 and row["planned_memory_gb"] > 0
        assert row["params_active"] <= row["params_total"]
        shares = [op["share"] for op in row["top_ops"]]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9, row["top_ops"]
        assert any("mm" in op["op"] for op in row["top_ops"]), row["top_ops"]  # the model's matmuls
    profiles = (tmp_path / report_file.name.replace(".json", "-profiles.txt")).read_text()
    sections = [line for line in profiles.splitlines() if line.startswith("=====")]
    assert [line for line in sections if "attention" not in line] == [f"===== {n} =====" for n in names]
    profiled = ("softmax_gqa", "lisa", "lisa_torch", "lisa_linear_gqa")  # their operator tables too
    assert [line for line in sections if "attention" in line] == \
        [f"===== attention {k} @ 64 =====" for k in profiled]
    assert profiles.count("Self CPU") >= len(names) + len(profiled)
    assert report["throughput"]["uoe-1b grouped-gemm"]["params_active"] < \
        report["throughput"]["uoe-1b grouped-gemm"]["params_total"]
    assert report["grouped_gemm"]["match"], report["grouped_gemm"]
    assert report["relu_kernels"]["match"] and len(report["relu_kernels"]["max_rel_error"]) == 2, report["relu_kernels"]
    align = report["lisa_align"]
    assert align["match"] and len(align["max_rel_error"]) == 2, align
    flash = report["lisa_flash"]
    cases = ["sll float32", "rll docs float32", "sll linear float32"]
    assert flash["match"] and list(flash["max_rel_error"]) == cases, flash
    assert flash["kernel_calls"] == dict.fromkeys(cases, 2), flash
    decode = report["lisa_decode"]
    assert decode["match"] and len(decode["rows"]) == 2, decode
    assert all(r["fused_ms"] > 0 and r["pytorch_ms"] > 0 and r["softmax_ms"] > 0 for r in decode["rows"].values())
    assert list(report["correctness"]) == ["dense-1b", "hybrid-1b", "uoe-1b grouped-gemm"]
    for name, c in report["correctness"].items():  # on a CPU both runs are the CPU's: the tiny models train
        assert c["match"] and len(c["cpu"]) == 3 and c["cpu"][0] > c["cpu"][1] > c["cpu"][2], (name, c)
    attention = report["attention"]
    kinds = {"softmax", "softmax_sink", "relu", "lisa", "lisa_linear_gqa"}
    assert {r["kind"] for r in attention.values()} >= kinds | {"lisa_chain", "lisa_linear_chain_gqa"}
    for name, r in attention.items():
        assert "error" not in r and r["train_ms"] > 0, (name, r)
        if r["kind"] in ("softmax", "softmax_sink", "relu", "lisa"):
            assert r["decode_ms_per_token"] > 0 and r["prefill_ms"] > 0, (name, r)
    for r in attention.values():  # every kind beside softmax at the same sequence, decode kinds also at decode
        assert r["train_x_softmax"] > 0 and (("decode_x_softmax" in r) == ("decode_ms_per_token" in r)), r
    assert all(attention[f"{k} @ 64"]["top_ops"] for k in profiled)
    table = (tmp_path / report_file.name.replace(".json", ".md")).read_text()
    assert "| lisa @ 64 |" in table and "- attention lisa @ 64: " in table
    now = report["throughput"]["dense-1b"]
    assert f"Against {earlier} (2026-01-01, GPU X): before -> now" in table
    assert "Different devices (GPU X before, cpu" in table
    assert now["mfu"] is None and "| gone |" not in table  # a CPU has no MFU: its cell stays empty
    tokens, peak = now["tokens_per_s"], now["peak_memory_gb"]
    assert f"| dense-1b | 1,000 -> {tokens:,.0f} |  | 1.00 -> {peak:.2f} |" in table
    # times taken at another batch say so (the GPU rows time several sequences per call, a CPU one)
    assert (f"| lisa @ 64 |  |  |  | 5.00 -> {attention['lisa @ 64']['train_ms']:.2f} (batch 8 -> 1) | 3.00 -> "
            in table)
    assert f"| lisa @ 64 | 1 | {attention['lisa @ 64']['train_ms']:.2f} |" in table
    assert all(f"| {name} |" in table for name in names)
    assert all(f"- {name}: " in table for name in names)  # the profiled step's top operators


def test_a_deadline_skips_what_no_longer_fits_and_still_writes_the_report(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--families", "dense-1b",
                          "--deadline", "1", "--out-dir", str(tmp_path)], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "skipped (--deadline): dense-1b" in out.stdout, out.stdout[-2000:]
    [report_file] = tmp_path.glob("gpu_check-*-cpu-smoke.json")
    report = json.loads(report_file.read_text())
    skipped = {"skipped": "--deadline 1.0 s reached"}
    assert report["throughput"]["dense-1b"] == skipped and report["lisa_decode"] == skipped
    assert "| dense-1b | skipped: --deadline 1.0 s reached |" in (tmp_path / report_file.name.replace(".json", ".md")).read_text()


def test_deadline_budget(monkeypatch):
    """A part gets its own limit while the run has time, what is left (less the report's reserve)
    near the end, and nothing once less than a minimal part is left."""
    from bench import gpu_check

    clock = [100.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    deadline = gpu_check.Deadline(300)
    assert deadline.budget(200) == 200
    clock[0] = 300.0  # 100 s left: 90 after the reserve
    assert deadline.budget(200) == 90
    clock[0] = 365.0  # 35 s left: 25 after the reserve, under a minimal part
    assert deadline.budget(200) is None
    assert gpu_check.Deadline(0).budget(200) == 200  # no deadline


def test_attention_rows_finished_before_a_timeout_are_kept(monkeypatch, tmp_path):
    """The attention process is stopped while timing its third kind: the first two keep their
    numbers and ratios, the third carries the timeout, the others say they never ran; what it printed
    is in a file under --out-dir as it printed it (a run killed from outside keeps it)."""
    import argparse

    from bench import gpu_check

    kinds = gpu_check.ATTENTION_KINDS
    printed = "".join(gpu_check.ROW + json.dumps({"kind": kind, "seq": 64, "train_ms": ms}) + "\n"
                      for kind, ms in ((kinds[0], 2.0), (kinds[1], 3.0)))

    def stopped(*args, **kwargs):
        kwargs["stdout"].write(printed)
        kwargs["stderr"].write("compiling\n")
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    monkeypatch.setattr(gpu_check.subprocess, "run", stopped)
    args = argparse.Namespace(steps=1, device="cpu", families="dense-1b", micro_batch=None, out_dir=str(tmp_path),
                              profile=False)
    rows = gpu_check.run_isolated(gpu_check.ATTENTION_ROW + "64", args, timeout=5)
    [kept] = (tmp_path / f"{gpu_check.report_stem('cpu')}-parts").glob("attention_64.out")
    assert kept.read_text() == printed
    assert rows[f"{kinds[0]} @ 64"]["train_x_softmax"] == 1.0 and rows[f"{kinds[1]} @ 64"]["train_ms"] == 3.0
    assert rows[f"{kinds[2]} @ 64"]["error"].startswith("timed out after 5 s")
    assert all(rows[f"{k} @ 64"]["error"].startswith("not run") for k in kinds[3:])


def test_unknown_family_is_rejected_before_any_work(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--families", "dense-7b",
                          "--out-dir", str(tmp_path)], cwd=REPO, env=child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "unknown families ['dense-7b']" in out.stderr
    assert not list(tmp_path.iterdir())
    # a Triton kernel check on the CPU runs under the interpreter, which must be on when Triton loads
    env = {k: v for k, v in child_env().items() if k != "TRITON_INTERPRET"}
    one = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--one", "check:lisa_flash"]
    out = subprocess.run(one, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "set TRITON_INTERPRET=1" in out.stderr, out.stderr[-2000:]


def test_shell_entry_without_gpu_says_so_and_exits_0():
    env = {**child_env(), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no CUDA device found: nothing measured" in out.stdout


def test_shell_entry_names_a_python_without_the_requirements(tmp_path):
    bare = tmp_path / "python"
    bare.write_text("#!/bin/sh\nexit 1\n")
    bare.chmod(0o755)
    out = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env={**os.environ, "PRETRAIN_PYTHON": str(bare)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot import deepspeed" in out.stderr and str(bare) in out.stderr


def test_gpu_wheel_list_covers_what_the_carried_packages_need():
    """bench/gpu_wheels.sh --list names requirements.txt's pins for the packages the GPU machine
    lacks, and every runtime requirement of a carried package is carried, on the machine, or
    named as skipped."""
    import re
    from importlib import metadata

    out = subprocess.run(["bash", "bench/gpu_wheels.sh", "3.12", "--list"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    listed = {}
    for line in out.stdout.splitlines():
        spec, how, tag = line.split()
        name, version = spec.split("==")
        assert how in ("binary", "build") and tag == "cp312", line
        listed[norm(name)] = version
    pins = dict(line.split("==") for line in (REPO / "requirements.txt").read_text().split())
    for name in ("deepspeed", "megatron-core", "mosaicml-streaming"):
        assert listed[name] == pins[name], name
    text = (REPO / "bench" / "gpu_wheels.txt").read_text()
    have = {norm(n) for line in text.splitlines() if line.startswith(("have ", "skip ")) for n in line.split()[1:]}
    missing = []
    for name in listed:
        for requirement in metadata.requires(name) or []:
            if "extra ==" in requirement or "python_version <" in requirement:
                continue
            needed = norm(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0])
            if needed not in listed and needed not in have:
                missing.append(f"{name} needs {needed}")
    assert not missing, missing
    bad = subprocess.run(["bash", "bench/gpu_wheels.sh", "latest"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: bash bench/gpu_wheels.sh PYTHON_VERSION" in bad.stderr


def test_lisa_decode_speed_part_runs_alone_on_earlier_layouts(tmp_path):
    """bench.lisa_decode --speed-only (what gpu_run.sh --lisa-decode runs on a GPU in bf16), here on
    CPU at a tiny width: the layouts of the committed results, each timed against the source, their
    KV caches smaller by the LISA layers' rank-r keys."""
    results = REPO / "bench/results/lisa_decode.json"
    out = tmp_path / "speed.json"
    sizes = ["--speed-hidden", "256", "--speed-contexts", "16", "--speed-batches", "1",
             "--equal-memory-batch", "2", "--equal-memory-contexts", "36", "--speed-new", "2",  # past the others
             "--speed-train-seq", "32", "--repeats", "1"]
    run = subprocess.run([sys.executable, "-m", "bench.lisa_decode", "--speed-only", str(results), *sizes,
                          "--out", str(out)],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    speed = json.loads(out.read_text())["speed"]
    rows = json.loads(results.read_text())["rows"]
    assert (speed["device"], speed["dtype"], speed["hidden"]) == ("cpu", "float32", 256)
    assert list(speed["models"]) == [r["model"] for r in rows]
    source = speed["models"]["source"]
    for name, row in zip(speed["models"], rows):
        model = speed["models"][name]
        assert model["attention"] == row["attention"]
        # as the conversion sets it: kept where LISA layers form a chain (train_step times that)
        assert model["keep_chain_scores"] == ("lisa,lisa" in row["attention"]), name
        for key in ("framework_decode@16", "hf_decode@16", "equal_memory_decode@36", "train_step"):
            assert model[key]["median_s"] > 0 and model[key]["x_source"] > 0, (name, key, model[key])
        shared = row["attention"].count("lisa")
        assert (model["cache_bytes_per_position"] < source["cache_bytes_per_position"]) == (shared > 0), name


def test_the_correctness_check_tells_device_losses_apart(monkeypatch):
    """On a CPU the dry run compares the CPU's losses with themselves; the comparison itself: device
    losses off by more than 1e-3 relative are a mismatch, within it a match, an error is reported."""
    from bench import gpu_check

    cpu = [6.2958, 5.8394, 5.6201]
    off = {"dense-1b": 1.01, "hybrid-1b": 1.0002}

    def tiny_losses(cfg_path, overrides, device):
        name = next(n for n, (path, _) in gpu_check.FAMILIES.items() if path == cfg_path)
        if device == "cpu":
            return cpu
        if name.startswith("uoe"):
            raise RuntimeError("CUDA error: an illegal memory access")
        return [loss * off[name] for loss in cpu]

    monkeypatch.setattr(gpu_check, "tiny_losses", tiny_losses)
    result = gpu_check.correctness("cuda", ["dense-1b", "hybrid-1b", "uoe-1b"])
    assert result["dense-1b"]["match"] is False and result["hybrid-1b"]["match"] is True
    assert result["uoe-1b"] == {"error": "RuntimeError: CUDA error: an illegal memory access"}
