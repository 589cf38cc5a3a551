"""Throughput rates over training steps only, and the console line without a gradient norm."""

import time

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


def test_progress_line_says_when_there_is_no_gradient_norm():
    values = {"loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0, "tflops_per_device": 0.1, "peak_memory_gb": 1.0}
    assert "gnorm n/a" in progress_line(3, 10, values)
    assert "gnorm 0.500" in progress_line(3, 10, {**values, "grad_norm": 0.5})
