"""Throughput rates over training steps only, and the console line without a gradient norm."""

import time

import pytest

from pretrain.telemetry import Throughput, progress_line


def test_paused_time_counts_for_no_interval():
    meter = Throughput(tokens_per_step=1000, flops_per_token=6e6, world_size=1)
    meter.step()
    with meter.paused():  # a validation or a checkpoint save between the steps
        time.sleep(0.3)
    meter.step()
    rates = meter.measure()
    assert rates["step_time_s"] < 0.1, rates  # two steps of almost nothing, not 0.15 s each
    meter.step()
    time.sleep(0.05)
    assert meter.measure()["step_time_s"] >= 0.05  # outside paused() the time counts


def test_rates_are_per_device_and_mfu_is_against_the_precision_s_peak(monkeypatch):
    """TFLOP/s are the model's FLOPs per device (world size 4), MFU is against the bf16 or fp32 peak
    of the device the run is on; tokens count the steps' own (a short step's fewer)."""
    import pretrain.telemetry as T

    clock = [100.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(T.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(T.torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    meter = Throughput(tokens_per_step=4096, flops_per_token=6e9, world_size=4)
    for _ in range(3):
        meter.step()
    meter.step(tokens=1000)
    clock[0] += 2.0
    rates = meter.measure()
    tokens_per_s = (3 * 4096 + 1000) / 2.0
    assert rates["tokens_per_s"] == tokens_per_s and rates["step_time_s"] == 0.5
    assert rates["tflops_per_device"] == pytest.approx(tokens_per_s * 6e9 / 4 / 1e12, rel=1e-12)
    bf16_peak, fp32_peak = T.peak_tflops("H100", True), T.peak_tflops("H100", False)
    assert bf16_peak > fp32_peak > 0
    assert rates["mfu"] == pytest.approx(rates["tflops_per_device"] / bf16_peak, rel=1e-12)
    assert Throughput(4096, 6e9, 4, bf16=False).peak == fp32_peak


def test_progress_line_says_when_there_is_no_gradient_norm():
    values = {"loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0, "tflops_per_device": 0.1, "peak_memory_gb": 1.0}
    assert "gnorm n/a" in progress_line(3, 10, values)
    assert "gnorm 0.500" in progress_line(3, 10, {**values, "grad_norm": 0.5})
    extremes = {"peak_memory_gb_max": 7.25, "peak_memory_gb_max_rank": 3, "data_wait_frac_max": 0.4,
                "data_wait_frac_max_rank": 1, "data_wait_frac": 0.05}
    line = progress_line(3, 10, {**values, **extremes})
    assert "data 5% (max 40% on rank 1)" in line and "(max 7.25 GB on rank 3)" in line


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Resuming at step 4 a run that had logged steps 1-8: TensorBoard and metrics.jsonl show 1-4 of
    the first trajectory, then the new 5-6; the old 5-8 are set aside, not lost."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.telemetry import LOGS_ASIDE, Logger

    first = Logger(tmp_path, rank=0)
    for step in range(1, 9):
        first.scalars(step, {"loss": float(step)}, prefix="train/")
    first.close()
    (tmp_path / "losses.jsonl").write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 9))
                                           + '{"step": 9, "lo')  # a line cut by a crash
    resumed = Logger(tmp_path, rank=0, start_step=4)
    for step in (5, 6):
        resumed.scalars(step, {"loss": 10.0 * step}, prefix="train/")
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 50), (6, 60)]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in metrics] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 50), (6, 60)]
    assert [json.loads(line)["step"] for line in (tmp_path / "losses.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    [aside] = (tmp_path / LOGS_ASIDE).iterdir()
    assert [json.loads(line)["step"] for line in (aside / "metrics.jsonl").read_text().splitlines()] == [5, 6, 7, 8]
    assert (aside / "losses.jsonl").read_text().splitlines()[-1] == '{"step": 9, "lo'


def test_counts_read_in_units_rounded_first():
    from pretrain.telemetry import count_text

    assert [count_text(n) for n in (999.6, 999_500, 999_600_000, 12_345_678, 3.2e12, 512)] == \
        ["1k", "1M", "1B", "12.3M", "3.2T", "512"]
