"""Measured MFU (`hap run --timing`, runner.timing.mfu_line): model FLOPs per iteration over the measured
step times the same summed peak the plan's predicted MFU uses."""
from __future__ import annotations

import dataclasses
import re

import pytest
from dist_harness import run_ranks
from runner_plans import engine_plan

from runner.config import DistEnv, RunConfig
from runner.launch import run
from runner.timing import measured_mfu, mfu_line, steady_step_s


def test_measured_mfu_is_model_flops_over_step_times_peak():
    assert measured_mfu(6e12, 2e12, 1.5) == pytest.approx(2.0)  # 6e12 / (1.5 s x 2e12 FLOP/s)
    assert measured_mfu(1e9, 1e12, 0.01) == pytest.approx(0.1)
    assert measured_mfu(1e9, None, 0.01) is None and measured_mfu(1e9, 1e12, 0.0) is None


def test_the_steady_step_is_the_median_after_the_first():
    assert steady_step_s([9.0, 1.0, 3.0, 2.0]) == 2.0
    assert steady_step_s([4.0]) == 4.0
    with pytest.raises(ValueError):
        steady_step_s([])


def test_the_report_uses_the_plans_flops_and_peak():
    plan = engine_plan("mlp", 2)
    u = plan.utilisation
    line = mfu_line(plan, [1.0, 0.02, 0.04, 0.03])
    expected = u.model_flops / (0.03 * u.peak_flops)
    m = re.search(r"measured step ([\d.]+) ms \(median of steps 1\.\.3\) · MFU ([\d.]+)% of ([\d.e+]+) FLOP/s "
                  r"summed fp32 peak; predicted ([\d.]+) ms · MFU ([\d.]+)%", line)
    assert m, line
    assert float(m.group(1)) == pytest.approx(30.0) and float(m.group(2)) == pytest.approx(expected * 100, rel=0.06)
    assert float(m.group(5)) == pytest.approx(plan.mfu * 100, rel=0.06)
    unknown = mfu_line(dataclasses.replace(plan, peak_flops=None), [0.5])
    assert "measured step 500.00 ms (one step); MFU unknown" in unknown


def train_rank(rank, world, init_method, cfg):
    return run(cfg, DistEnv(rank, world, rank, world), init_method=init_method)


def test_a_timed_run_ends_with_its_measured_mfu(tmp_path, capfd):
    plan = engine_plan("mlp", 2)
    plan.save(tmp_path / "plan.json")
    cfg = RunConfig(plan=str(tmp_path / "plan.json"), steps=2, timing=True)
    assert run_ranks(train_rank, 2, tmp_path / "run", cfg) == [0, 0]
    out = capfd.readouterr().out
    assert re.search(r"^hap run: measured step [\d.]+ ms \(step 1\) · MFU [\d.]+% of ", out, re.M), out
