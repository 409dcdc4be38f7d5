"""Verify mode's comparison (runner.verify): relative differences, tied weights, the verdict."""
from __future__ import annotations

import math

import pytest
import torch

from runner.verify import NEAR_ZERO, TOLERANCE, compare, rel_diff


def test_rel_diff_is_the_relative_norm_of_the_difference():
    b = torch.tensor([1.0, -4.0, 0.0])
    assert rel_diff(b + torch.tensor([0.0, 0.0, 2e-4]), b) == pytest.approx(2e-4 / math.sqrt(17), rel=1e-6)
    assert rel_diff(torch.empty(0, 3), torch.empty(0, 3)) == 0.0
    assert rel_diff(torch.ones(2), torch.ones(3)) == math.inf
    assert rel_diff(torch.tensor([math.nan]), torch.ones(1)) == math.inf


def test_one_element_past_a_relu_kink_passes_and_an_error_everywhere_fails():
    """The H100 case: one bias element of 4096 off by 2.4e-4 of the largest (a unit that switched at a
    ReLU kink) is rounding amplified, not a wrong program; the same error on every element is one."""
    b = torch.linspace(-0.0157, 0.0157, 4096, dtype=torch.float64)
    kink = b.clone()
    kink[7] += 2.4e-4 * 0.0157
    assert rel_diff(kink, b) < TOLERANCE
    assert rel_diff(b * (1 + 2.4e-4), b) > TOLERANCE


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


def test_factory_device_is_the_ranks_gpu_and_nothing_on_the_cpu():
    """Tensors a rank program makes itself (masks, `full`, constants) land on the rank's device under
    NCCL; on the CPU no device mode is installed (it would cost every operator)."""
    import contextlib

    import torch

    from runner.train import factory_device

    assert isinstance(factory_device(torch.device("cpu")), contextlib.nullcontext)
    with factory_device(torch.device("meta")):
        assert torch.zeros(2).device.type == "meta"
