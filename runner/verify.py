"""Verify mode: the distributed run must be single-device training, to fp32 tolerance (or, for a plan
in mixed precision, to the tolerance of its dtype: `MIXED_TOLERANCE`).

Rank 0 re-runs the same steps on one device (same seed, same batches, same optimizer) and
compares the global loss of every step and every parameter at the end, gathered to full shape.
Relative differences: |a - b| / |b| for a loss; rms(a - b) / max(rms(b), NEAR_ZERO) over a
parameter tensor, i.e. the relative Frobenius norm (an element-wise ratio would blow up on entries
near zero, and so would a parameter that stays at rounding noise: see NEAR_ZERO).

Why the norm and not the largest element: a ReLU unit whose input sits within rounding of zero
switches on in one run and off in the other, and the element it feeds then differs by far more
than rounding, while the rest agree. On an H100 the zoo MLP's fifth step showed exactly that
(2.4e-4 on one element of a bias, and the same between two single-device runs on GPU and CPU).
A wrong program (a missing gradient addend, a wrong slice) moves a whole row or more: its norm
error stays orders above the tolerance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.spmd.plan import Plan

from .batches import Batches
from .config import RunConfig
from .precision import precision_of
from .train import RankState, gathered_params, reference_run

TOLERANCE = 1e-4
"""Largest relative difference accepted in fp32 (issue: runner, verify mode)."""
MIXED_TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3}
"""Largest relative difference accepted under autocast. Both runs round every matmul's output and every
activation to the low dtype, but at different places: a rank rounds its shard's partial sums before a
collective adds them, the reference rounds the whole sum once, and the ranks' reduction orders differ.
One rounding is a relative 2^-9 in bf16 (8 significant bits, eps 2^-8 ~ 3.9e-3) and 2^-12 in fp16
(eps 2^-11 ~ 4.9e-4); a step chains tens of them, and they compound over the steps, so the tolerance
is about five bf16 eps (and ten fp16 eps): on the zoo GPT over 4 steps on 3 uneven gloo ranks the
largest differences were 5e-3 (bf16) and 8e-4 (fp16), on a layer-norm bias that starts at zero
(tests/runner/test_runner_precision.py). A wrong program (a missing gradient addend, a wrong slice)
moves a whole parameter's update, a relative difference of order one."""
NEAR_ZERO = 1e-6
"""Scale below which a parameter is compared absolutely (to TOLERANCE * NEAR_ZERO = 1e-10). An
attention key bias has a true gradient of exactly zero (softmax ignores a shift common to all keys):
initialised to zero, as transformers does, it stays at rounding noise (~1e-14), whose ratio between
two runs means nothing."""


@dataclass
class Comparison:
    """Largest relative differences between a distributed run and the single-device reference."""

    loss_rel: float
    loss_step: int
    param_rel: float
    param_name: str
    missing: list[str] = field(default_factory=list)
    """Reference parameters the plan does not hold (not compared)."""
    noise: list[str] = field(default_factory=list)
    """Parameters whose gradient was rounding noise under an adaptive optimiser (runner.train.noise_parameters): not compared."""

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return self.loss_rel <= tolerance and self.param_rel <= tolerance

    def render(self, tolerance: float = TOLERANCE) -> str:
        lines = [f"verify: largest loss relative difference      {self.loss_rel:.3e} (step {self.loss_step})",
                 f"verify: largest parameter relative difference {self.param_rel:.3e} ({self.param_name})"]
        if self.missing:
            lines.append(f"verify: not in the plan, not compared: {', '.join(self.missing)}")
        if self.noise:
            lines.append(f"verify: gradient only rounding noise, which Adam scales to full steps; not compared: "
                         f"{', '.join(self.noise)}")
        verdict = "OK" if self.ok(tolerance) else "FAILED"
        lines.append(f"verify: {verdict} (tolerance {tolerance:.0e} relative)")
        return "\n".join(lines)


def tolerance_for(precision: str) -> float:
    """The relative tolerance of verify mode for a plan trained in `precision`."""
    return MIXED_TOLERANCE.get(precision, TOLERANCE)


def rel_diff(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """rms(a - b) / max(rms(b), floor) (0 for two empty tensors; inf on a shape mismatch or a NaN)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return math.inf
    if b.numel() == 0:
        return 0.0
    d = float((a - b).square().mean().sqrt()) / max(float(b.square().mean().sqrt()), floor, 1e-30)
    return math.inf if math.isnan(d) else d


def compare(losses: list[float], params: dict[str, torch.Tensor],
            ref_losses: list[float], ref_params: dict[str, torch.Tensor], noise: Sequence[str] = ()) -> Comparison:
    """Largest differences; a reference parameter reached under several names (tied weights) is
    compared once, under whichever name the plan holds."""
    loss_rels = [rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)]
    if len(losses) != len(ref_losses):
        loss_rels.append(math.inf)
    step = max(range(len(loss_rels)), key=loss_rels.__getitem__, default=0)
    param_rels = {k: rel_diff(params[k], v, NEAR_ZERO) for k, v in ref_params.items() if k in params and k not in noise}
    name = max(param_rels, key=param_rels.__getitem__, default="-")
    held = {v.data_ptr() for k, v in ref_params.items() if k in params and v.numel()}
    missing = sorted(k for k, v in ref_params.items() if k not in params and not (v.numel() and v.data_ptr() in held))
    return Comparison(max(loss_rels, default=0.0), step, param_rels.get(name, 0.0), name, missing,
                      sorted(k for k in noise if k in params))


def verify(plan: Plan, cfg: RunConfig, st: RankState, rank: int, device: torch.device, batches: Batches | None = None) -> int:
    """Gather parameters (every rank takes part), then save and/or compare them on rank 0.

    Returns the rank's exit status: 1 on rank 0 when the differences exceed the tolerance.
    """
    if not (cfg.verify or cfg.save_params):
        return 0
    params = gathered_params(plan, st)
    if rank != 0:
        return 0
    if cfg.save_params:
        torch.save({k: v.cpu() for k, v in params.items()}, cfg.save_params)
    if not cfg.verify:
        return 0
    optim = cfg.optim(plan.options.optimizer)
    noise: set[str] = set()
    ref_losses, ref_params = reference_run(plan, cfg.steps, cfg.seed, device=device, optim=optim, batches=batches,
                                           init=cfg.init_from, noise=noise)
    result = compare(st.losses, params, ref_losses, ref_params, sorted(noise))
    print(f"verify: {cfg.steps} steps against single-device training "
          f"({optim.name}, lr {optim.lr:g}, seed {cfg.seed})")
    tolerance = tolerance_for(precision_of(plan))
    print(result.render(tolerance), flush=True)
    return 0 if result.ok(tolerance) else 1
