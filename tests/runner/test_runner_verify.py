"""Verify mode's comparison (runner.verify): relative differences, tied weights, the verdict."""
from __future__ import annotations

import math

import pytest
import torch

from runner.verify import NEAR_ZERO, TOLERANCE, compare, rel_diff


def test_rel_diff_is_max_abs_difference_over_max_abs_reference():
    b = torch.tensor([1.0, -4.0, 0.0])
    assert rel_diff(b + torch.tensor([0.0, 0.0, 2e-4]), b) == torch.tensor(5e-5).item()
    assert rel_diff(torch.empty(0, 3), torch.empty(0, 3)) == 0.0
    assert rel_diff(torch.ones(2), torch.ones(3)) == math.inf
    assert rel_diff(torch.tensor([math.nan]), torch.ones(1)) == math.inf


def test_compare_names_the_worst_step_and_parameter_and_fails_above_tolerance():
    ref = {"a": torch.ones(3), "b": torch.full((2,), 2.0)}
    got = {"a": torch.ones(3), "b": torch.tensor([2.0, 2.01])}
    res = compare([1.0, 2.0, 3.0], got, [1.0, 2.0 * (1 + 3e-5), 3.0], ref)
    assert res.loss_step == 1 and res.loss_rel < TOLERANCE
    assert res.param_name == "b" and not res.ok()
    assert "verify: FAILED" in res.render() and "(b)" in res.render()


def test_compare_checks_a_tied_weight_once_under_the_name_the_plan_holds():
    shared = torch.randn(4, 2)
    ref = {"wte.weight": shared, "head.weight": shared, "ln.bias": torch.zeros(2)}
    res = compare([1.0], {"head.weight": shared.clone()}, [1.0], ref)
    assert res.missing == ["ln.bias"] and res.param_rel == 0.0
    assert compare([1.0], {"head.weight": shared.clone()}, [1.0, 2.0], ref).loss_rel == math.inf


def test_a_parameter_at_rounding_noise_is_compared_absolutely():
    """A zero-initialised key bias (true gradient 0) ends at ~1e-14 in both runs: noise, not a difference."""
    ref = {"key.bias": torch.tensor([3.9e-14, -1e-14]), "w": torch.ones(2)}
    noise = compare([1.0], {"key.bias": torch.tensor([-2e-14, 2e-14]), "w": torch.ones(2)}, [1.0], ref)
    assert noise.ok() and noise.param_rel < 1e-7
    real = compare([1.0], {"key.bias": torch.tensor([3.9e-14, 5e-10]), "w": torch.ones(2)}, [1.0], ref)
    assert not real.ok() and real.param_name == "key.bias"  # 5e-10 > TOLERANCE * NEAR_ZERO
    assert rel_diff(torch.tensor([4e-6]), torch.tensor([2e-6]), NEAR_ZERO) == pytest.approx(1.0)  # above the floor: relative
