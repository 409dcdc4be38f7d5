"""Verify mode: every step of the distributed run must be a single-device step, to fp32 tolerance (or,
for a plan in mixed precision, to the tolerance of its dtype: `MIXED_TOLERANCE`).

The rule, step by step. The run records, at every step t, its parameters before the step (theta_t) and
the gradients its optimiser got (g_t), gathered to full shape (`Trace`). Rank 0 then checks:

1. the program: one device runs forward and backward at the same theta_t on the same batch (same
   dropout masks, autocast, clipping, accumulation: `forced_reference`), and the loss and every
   gradient must agree with the run's;
2. the optimiser: one device's optimiser, fed the run's own gradients g_0..g_T-1 from the initial
   parameters (`replayed_optimizer`), must reach the run's final parameters.

By induction the run is then single-device training up to one step's rounding per step. It does not
compare two free-running trajectories, because Adam and AdamW divide each element's gradient by its
own running magnitude: a gradient within rounding of zero (an attention key bias, a bias feeding a
batch norm, the MLM-head bias of a token whose softmax is 1e-20) becomes a step of up to the full
learning rate with the rounding's sign, so two correct runs drift apart by ~lr there, and from the
next step on every gradient that reads those parameters differs too. Funnel's head bias differed by
1e-3 relative after two steps, MobileViTv2's batch-norm biases by 88%, and fp32 and fp64 on one device
differ the same way. Checking each step from the run's own state leaves rounding one step deep, and
the gradient check is what catches a wrong program under Adam, which trains the same parameters from
a gradient scaled by any constant (a gradient summed once per rank, say).

Differences are relative: |a - b| / |b| for a loss; rms(a - b) / max(rms(b), floor) over a tensor, the
relative Frobenius norm. Floors: a parameter whose rms is below `NEAR_ZERO` is compared absolutely; a
gradient is compared to the larger of its own rms, `GRAD_FLOOR` of the model's gradient rms at that
step, and `ROUNDING_FACTOR` times the rounding one device makes on it (in fp32, or in the plan's
autocast) over the tolerance, measured by redoing step 1's forward and backward in fp64 (`rounding`):
a difference within ROUNDING_FACTOR x that rounding passes. A gradient whose true value is zero is rounding
of terms that cancel, and how large those terms are is the model's business (MobileViTv2's
batch-norm biases sum 98,304 positions: fp32 holds 1.6e-6 there, fp64 1e-14).

Why norms and not the largest element: a ReLU unit whose input sits within rounding of zero switches
on in one run and off in the other, and the element it feeds then differs by far more than rounding,
while the rest agree (the zoo MLP on an H100: 2.4e-4 on one bias element, the same between two
single-device runs on GPU and CPU). A wrong program moves a whole row or more.

A run resumed from a checkpoint lacks the trace of the steps before it; it, and a pipeline plan's run,
are compared as two free-running trajectories (`compare`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from engine.spmd.plan import Plan

from . import optim as O
from .batches import Batches
from .config import RunConfig
from .optim import OptimConfig
from .precision import precision_of
from .train import RankState, Trace, gathered_params, initial_module, make_batch, reference_run, single_device_backward

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
initialised to zero, as transformers does, it stays at rounding noise (~1e-14) under SGD, whose ratio
between two runs means nothing."""
GRAD_FLOOR = 1e-2
"""Fraction of the model's gradient scale (its rms over every element at that step) below which a
gradient is compared absolutely, to tolerance * GRAD_FLOOR of that scale (1e-6 of it in fp32). Funnel's
key biases carry 1e-9 of rounding where the model's rms is 1.5e-2."""
ROUNDING_FACTOR = 10.0
"""How many times one fp32 device's own rounding error on a gradient (`rounding`) two correct programs
may differ by: each run has its own, of the same order, in other reduction orders."""


@dataclass
class Comparison:
    """Largest relative differences between a distributed run and the single-device reference."""

    loss_rel: float
    loss_step: int
    param_rel: float
    param_name: str
    missing: list[str] = field(default_factory=list)
    """Reference parameters the plan does not hold (not compared)."""
    grad_rel: float | None = None
    """Largest gradient difference (None: a free-running comparison, gradients not compared)."""
    grad_name: str = "-"
    grad_step: int = 0
    rounding: str = ""
    """How the rounding of step 1's gradients was measured, or why it was not."""

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return (self.loss_rel <= tolerance and self.param_rel <= tolerance
                and (self.grad_rel is None or self.grad_rel <= tolerance))

    def render(self, tolerance: float = TOLERANCE) -> str:
        forced = self.grad_rel is not None
        lines = []
        if forced:
            lines.append("verify: rule: each step's loss and gradients against one device's forward and backward at "
                         "the run's own parameters; the final parameters against one device's optimiser fed the "
                         "run's gradients (no free-running comparison: Adam turns rounding of a near-zero gradient "
                         "into a full-lr step)")
        lines.append(f"verify: largest loss relative difference      {self.loss_rel:.3e} (step {self.loss_step})")
        if forced:
            lines.append(f"verify: largest gradient relative difference  {self.grad_rel:.3e} "
                         f"({self.grad_name}, step {self.grad_step})")
        what = "after the optimiser on the run's gradients" if forced else ""
        lines.append(f"verify: largest parameter relative difference {self.param_rel:.3e} ({self.param_name})"
                     + (f" {what}" if what else ""))
        if self.rounding:
            lines.append(f"verify: {self.rounding}")
        if self.missing:
            lines.append(f"verify: not in the plan, not compared: {', '.join(self.missing)}")
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


def rms(t: torch.Tensor) -> float:
    return float(t.detach().double().square().mean().sqrt()) if t.numel() else 0.0


# ----------------------------------------------------------------------------- one device, step by step


def _named(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(module.named_parameters(remove_duplicate=False))


def forced_reference(plan: Plan, thetas: Sequence[Mapping[str, torch.Tensor]], seed: int, optim: OptimConfig, *,
                     device: torch.device | str = "cpu", batches: Batches | None = None, dtype: torch.dtype | None = None,
                     init: Mapping[str, torch.Tensor] | str | Path | None = None
                     ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One device's loss and gradients (as its optimiser would get them: unscaled, clipped) at each step's
    parameters `thetas[t]`, on that step's batches and dropout masks; `dtype` casts the model, its float
    inputs and the parameters (fp64 for `rounding`)."""
    module = initial_module(plan, seed, init).to(device)
    if dtype is not None:
        module = module.to(dtype)
    named = _named(module)
    precision = precision_of(plan) if dtype is None else "fp32"
    scaler = torch.amp.GradScaler(torch.device(device).type) if precision == "fp16" else None
    draw = batches or Batches(lambda index: make_batch(plan, index, seed))
    k = optim.grad_accum
    losses, grads = [], []
    for step, theta in enumerate(thetas):
        with torch.no_grad():
            for name, value in theta.items():
                named[name].copy_(value)
        module.zero_grad(set_to_none=True)
        loss = single_device_backward(module, draw, step, k, seed, precision, device, scaler, dtype)
        held = [p for p in module.parameters() if p.grad is not None]
        if scaler is not None:
            inv = 1.0 / float(scaler.get_scale())
            for p in held:
                p.grad.mul_(inv)
        if optim.clip_grad_norm:
            O.clip_([p.grad for p in held], O.total_norm([p.grad for p in held]), optim.clip_grad_norm)
        grads.append({name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu().clone()
                      for name, p in named.items()})
        losses.append(loss)
    return losses, grads


def replayed_optimizer(plan: Plan, seed: int, optim: OptimConfig, grads: Sequence[Mapping[str, torch.Tensor]], *,
                       init: Mapping[str, torch.Tensor] | str | Path | None = None) -> dict[str, torch.Tensor]:
    """One device's optimiser (same kind, schedule and decay) fed the run's gradients from the initial
    parameters: the parameters it ends at. A step whose gradients are not finite is skipped, as fp16's
    loss scaler skips it."""
    module = initial_module(plan, seed, init)
    params = list(module.parameters())
    opt = O.build(optim, params, [tuple(p.shape) for p in params])
    named = _named(module)
    for step, got in enumerate(grads):
        O.set_lr(opt, optim.lr_at(step))
        opt.zero_grad(set_to_none=True)
        for name, g in got.items():
            named[name].grad = g.to(named[name].dtype).clone()
        if all(bool(torch.isfinite(g).all()) for g in got.values()):
            opt.step()
    return {k: v.detach() for k, v in named.items()}


def rounding(plan: Plan, theta: Mapping[str, torch.Tensor], seed: int, optim: OptimConfig, grads32: Mapping[str, torch.Tensor],
             **kw) -> tuple[dict[str, float], str]:
    """rms of one device's rounding error on each gradient of step 1 (its difference from fp64 at the same
    parameters: fp32's, or the plan's autocast's in mixed precision, where a zero true gradient is bf16 or
    fp16 rounding), and a line saying so; empty when fp64 cannot run the model (a module that casts to fp32
    itself)."""
    try:
        _, (grads64,) = forced_reference(plan, [theta], seed, optim, dtype=torch.float64, **kw)
    except (RuntimeError, TypeError, ValueError) as e:
        return {}, f"rounding not measured (fp64 replay of step 1 failed: {str(e).splitlines()[0][:120]})"
    out = {k: rms(grads32[k].double() - g.double()) for k, g in grads64.items() if k in grads32}
    return out, f"rounding measured: step 1's gradients redone in fp64; a gradient may differ by {ROUNDING_FACTOR:g}x it"


# ----------------------------------------------------------------------------- comparisons


def grad_scale(ref: Mapping[str, torch.Tensor]) -> float:
    """The rms of the model's whole gradient (over every element of every parameter)."""
    count = sum(t.numel() for t in ref.values())
    return math.sqrt(sum(float(t.double().square().sum()) for t in ref.values()) / max(count, 1))


def compare_grads(grads: Sequence[Mapping[str, torch.Tensor]], ref_grads: Sequence[Mapping[str, torch.Tensor]],
                  noise: Mapping[str, float] | None = None, tolerance: float = TOLERANCE) -> tuple[float, str, int]:
    """The largest gradient difference over steps and parameters, each against the larger of its own rms,
    GRAD_FLOOR of the step's model gradient rms and ROUNDING_FACTOR x its measured rounding over `tolerance`
    (`noise`, step 1's: the same order at every step, since each starts from the run's own parameters), so
    a difference passes when it is within ROUNDING_FACTOR x that rounding."""
    if len(grads) != len(ref_grads):
        return math.inf, "(steps)", min(len(grads), len(ref_grads))
    worst = (0.0, "-", 0)
    for step, (got, ref) in enumerate(zip(grads, ref_grads)):
        scale = grad_scale(ref)
        for k, b in ref.items():
            if k in got:
                floor = max(GRAD_FLOOR * scale, ROUNDING_FACTOR * (noise or {}).get(k, 0.0) / tolerance)
                d = rel_diff(got[k], b, floor)
                if d > worst[0]:
                    worst = (d, k, step)
    return worst


def _missing(params: Mapping[str, torch.Tensor], ref_params: Mapping[str, torch.Tensor]) -> list[str]:
    """Reference parameters the plan does not hold under any of their names (tied weights share one)."""
    held = {v.data_ptr() for k, v in ref_params.items() if k in params and v.numel()}
    return sorted(k for k, v in ref_params.items() if k not in params and not (v.numel() and v.data_ptr() in held))


def _param_rels(params: Mapping[str, torch.Tensor], ref_params: Mapping[str, torch.Tensor]) -> tuple[float, str]:
    rels = {k: rel_diff(params[k], v, NEAR_ZERO) for k, v in ref_params.items() if k in params}
    name = max(rels, key=rels.__getitem__, default="-")
    return rels.get(name, 0.0), name


def _loss_rels(losses: Sequence[float], ref_losses: Sequence[float]) -> tuple[float, int]:
    rels = [rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)]
    if len(losses) != len(ref_losses):
        rels.append(math.inf)
    step = max(range(len(rels)), key=rels.__getitem__, default=0)
    return max(rels, default=0.0), step


def compare(losses: list[float], params: dict[str, torch.Tensor],
            ref_losses: list[float], ref_params: dict[str, torch.Tensor]) -> Comparison:
    """Two free-running trajectories (a resumed run, a pipeline plan's): largest differences; a reference
    parameter reached under several names (tied weights) is compared once, under whichever name the plan holds."""
    loss_rel, step = _loss_rels(losses, ref_losses)
    return Comparison(loss_rel, step, *_param_rels(params, ref_params), _missing(params, ref_params))


def compare_steps(losses: list[float], params: dict[str, torch.Tensor], trace: Trace, ref_losses: list[float],
                  ref_grads: list[dict[str, torch.Tensor]], replayed: dict[str, torch.Tensor],
                  noise: Mapping[str, float] | None = None, rounding_line: str = "",
                  tolerance: float = TOLERANCE) -> Comparison:
    """The step-by-step rule (module docstring): the run's losses and gradients against one device's at the
    run's own parameters (`forced_reference`), its final parameters against the optimiser replayed on its
    gradients (`replayed_optimizer`); `tolerance` is the plan's (`tolerance_for`)."""
    loss_rel, step = _loss_rels(losses, ref_losses)
    result = Comparison(loss_rel, step, *_param_rels(params, replayed), _missing(params, replayed))
    result.grad_rel, result.grad_name, result.grad_step = compare_grads(trace.grads, ref_grads, noise, tolerance)
    result.rounding = rounding_line
    return result


def check_steps(plan: Plan, losses: list[float], params: dict[str, torch.Tensor], trace: Trace, seed: int,
                optim: OptimConfig, *, device: torch.device | str = "cpu", batches: Batches | None = None,
                init: Mapping[str, torch.Tensor] | str | Path | None = None) -> Comparison:
    """The whole step-by-step verification of a traced run on one device (rank 0)."""
    kw = {"device": device, "batches": batches, "init": init}
    ref_losses, ref_grads = forced_reference(plan, trace.params, seed, optim, **kw)
    replayed = replayed_optimizer(plan, seed, optim, trace.grads, init=init)
    noise, line = rounding(plan, trace.params[0], seed, optim, ref_grads[0], **kw) if trace.params else ({}, "")
    return compare_steps(losses, params, trace, ref_losses, ref_grads, replayed, noise, line,
                         tolerance_for(precision_of(plan)))


def verify(plan: Plan, cfg: RunConfig, st: RankState, rank: int, device: torch.device, batches: Batches | None = None) -> int:
    """Gather parameters (every rank takes part), then save and/or check them on rank 0: step by step
    when the run traced every step (`RankState.trace`), else as a free-running trajectory (a resumed run).

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
    trace = st.trace
    if trace is not None and len(trace.grads) == cfg.steps and len(st.losses) == cfg.steps:
        result = check_steps(plan, st.losses, params, trace, cfg.seed, optim, device=device, batches=batches,
                             init=cfg.init_from)
        how = "step by step against single-device training"
    else:
        ref_losses, ref_params = reference_run(plan, cfg.steps, cfg.seed, device=device, optim=optim, batches=batches,
                                               init=cfg.init_from)
        result = compare(st.losses, params, ref_losses, ref_params)
        how = "against single-device training (free-running: the run resumed)"
    print(f"verify: {cfg.steps} steps {how} ({optim.name}, lr {optim.lr:g}, seed {cfg.seed})")
    tolerance = tolerance_for(precision_of(plan))
    print(result.render(tolerance), flush=True)
    return 0 if result.ok(tolerance) else 1
