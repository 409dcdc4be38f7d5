"""Verify mode's comparison (runner.verify): relative differences, tied weights, the step-by-step rule
(gradients at the run's own parameters, the optimiser replayed on its gradients), the verdict."""
from __future__ import annotations

import math

import pytest
import torch

from runner.train import Trace
from runner.verify import NEAR_ZERO, TOLERANCE, compare, compare_grads, compare_steps, rel_diff


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


class PreNorm(torch.nn.Module):
    """A bias feeding a batch norm (true gradient exactly zero: the norm subtracts the batch mean, as in
    MobileViTv2's convolutions) and a linear head (an ordinary gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(8, 16)
        torch.nn.init.zeros_(self.inner.bias)
        self.norm = torch.nn.BatchNorm1d(16, affine=False)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(torch.relu(self.norm(self.inner(x)))), y)


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(32, 8, generator=gen).to(dtype), torch.randint(0, 4, (32,), generator=gen)


def loss_and_grads(theta: dict[str, torch.Tensor], step: int, dtype: torch.dtype) -> tuple[float, dict]:
    """One device's forward and backward of PreNorm at `theta` on step's batch, in `dtype`."""
    model = PreNorm().to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in theta.items()}, strict=False)
    loss = model(*batch(step, dtype))
    loss.backward()
    return float(loss.detach()), {k: p.grad.float() for k, p in model.named_parameters()}


def adam_run(dtype: torch.dtype, steps: int = 2, grad_scale: dict[str, float] | None = None,
             lr_scale: dict[str, float] | None = None) -> tuple[list[float], Trace, dict[str, torch.Tensor]]:
    """Adam (lr 1e-3) on PreNorm in `dtype`, traced as verify mode traces a run. `grad_scale` / `lr_scale`
    per parameter inject a wrong program (its gradient scaled) / a wrong update (its learning rate)."""
    model = PreNorm().to(dtype)
    groups = [{"params": [p], "lr": 1e-3 * (lr_scale or {}).get(k, 1.0)} for k, p in model.named_parameters()]
    opt = torch.optim.Adam(groups, lr=1e-3)
    losses, trace = [], Trace()
    for step in range(steps):
        trace.params.append({k: p.detach().float().clone() for k, p in model.named_parameters()})
        opt.zero_grad()
        loss = model(*batch(step, dtype))
        loss.backward()
        for k, p in model.named_parameters():
            p.grad.mul_((grad_scale or {}).get(k, 1.0))
        trace.grads.append({k: p.grad.detach().float().clone() for k, p in model.named_parameters()})
        losses.append(float(loss.detach()))
        opt.step()
    return losses, trace, {k: p.detach().float().clone() for k, p in model.named_parameters()}


def replay(trace: Trace) -> dict[str, torch.Tensor]:
    """Adam fed the trace's gradients from its first parameters (what runner.verify.replayed_optimizer does)."""
    model = PreNorm()
    model.load_state_dict(trace.params[0], strict=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for grads in trace.grads:
        for k, p in model.named_parameters():
            p.grad = grads[k].clone()
        opt.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def step_by_step(losses: list[float], trace: Trace, params: dict[str, torch.Tensor]):
    """runner.verify's rule on a PreNorm run, the one device in fp64 (another correct rounding)."""
    forced = [loss_and_grads(theta, step, torch.float64) for step, theta in enumerate(trace.params)]
    return compare_steps(losses, params, trace, [f[0] for f in forced], [f[1] for f in forced], replay(trace))


def test_two_correct_runs_whose_bias_gradient_is_rounding_pass_step_by_step():
    """fp32 and fp64 arithmetic of one program: the bias before the batch norm has a true gradient of zero,
    so fp32 holds rounding there (~1e-9, below Adam's eps 1e-8) and fp64 ~1e-17, and one Adam step makes
    of them different fractions of the learning rate. As free-running trajectories that is an order-one
    difference (verify failed so); step by step, the gradients agree to rounding and the replayed Adam
    reaches the run's parameters."""
    losses, trace, params = adam_run(torch.float32)
    ref_losses, _, ref_params = adam_run(torch.float64)
    free = compare(losses, params, ref_losses, ref_params)
    assert not free.ok() and free.param_name == "inner.bias"
    res = step_by_step(losses, trace, params)
    assert res.ok(), res.render()
    assert res.grad_rel < TOLERANCE and res.param_rel < 1e-6
    assert "verify: rule: each step's loss and gradients" in res.render() and "verify: OK" in res.render()


def test_a_gradient_counted_twice_fails_though_adam_trains_the_same_parameters():
    """A program that doubles one weight's gradient (a replicated gradient summed as if partial): Adam is
    invariant to the scale, so the parameters match free-running; the gradient comparison fails it."""
    losses, trace, params = adam_run(torch.float32, grad_scale={"head.weight": 2.0})
    _, _, ref_params = adam_run(torch.float64)
    assert rel_diff(params["head.weight"], ref_params["head.weight"]) < TOLERANCE  # invisible in the parameters
    res = step_by_step(losses, trace, params)
    assert not res.ok() and res.grad_name == "head.weight" and res.grad_rel == pytest.approx(1.0, rel=1e-3)
    assert "verify: FAILED" in res.render()


def test_a_wrong_update_fails_where_the_gradients_agree():
    """Gradients right, but the head stepped at twice the learning rate (a shard stepped wrongly): the
    optimiser replayed on the run's gradients does not reach the run's parameters."""
    losses, trace, params = adam_run(torch.float32, lr_scale={"head.weight": 2.0})
    res = step_by_step(losses, trace, params)
    assert not res.ok() and res.grad_rel < TOLERANCE and res.param_name == "head.weight"
    assert res.param_rel > 10 * TOLERANCE


def test_a_gradient_within_its_measured_rounding_passes_and_beyond_it_fails():
    """A gradient of terms that cancel carries rounding of the terms' size, not of the model's: 10x the
    rounding one fp32 device makes on it (measured against fp64) is accepted, more is not."""
    ref = {"w": torch.ones(4), "bias": torch.full((4,), 1e-12)}
    noisy = {"w": torch.ones(4), "bias": torch.full((4,), 5e-5)}
    assert compare_grads([noisy], [ref])[0] > TOLERANCE  # above GRAD_FLOOR's absolute allowance
    assert compare_grads([noisy], [ref], {"bias": 1e-5})[0] <= TOLERANCE
    assert compare_grads([noisy], [ref], {"bias": 1e-6})[1] == "bias"


def test_factory_device_is_the_ranks_gpu_and_nothing_on_the_cpu():
    """Tensors a rank program makes itself (masks, `full`, constants) land on the rank's device under
    NCCL; on the CPU no device mode is installed (it would cost every operator)."""
    import contextlib

    import torch

    from runner.train import factory_device

    assert isinstance(factory_device(torch.device("cpu")), contextlib.nullcontext)
    with factory_device(torch.device("meta")):
        assert torch.zeros(2).device.type == "meta"
