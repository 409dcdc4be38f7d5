"""`hap run`'s training step, written against the library API (runner.api) like any user's loop, for SPMD
and pipeline plans alike (runner.pipeline_api: there a microstep's forward runs its whole schedule).

One optimiser step s: its learning rate `optim.lr_at(s)`, then K = `optim.grad_accum` microsteps, each
the global batch number s*K + j (its dropout key the same number), its loss weighted 1/K, all but the last
under `model.no_sync()` (one gradient synchronisation per step); then the global
gradient norm (clipped when asked), then the optimiser's step. `examples/own_loop.py` does the same with
torch's own scheduler, and gives bit-identical losses.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from . import optim as O
from .api import ParallelModel
from .pipeline_api import PipelineModel
from .batches import Batches
from .optim import OptimConfig


@dataclass
class StepResult:
    """What one optimiser step reports (metrics, the progress line)."""

    loss: float
    """Mean global loss of its microsteps."""
    lr: float
    grad_norm: float | None
    """Global gradient norm before clipping (None when neither clipped nor asked for)."""
    seconds: float
    """Wall time of the step, less what ran aside from it (a norm computed only to be reported)."""


def train_step(model: ParallelModel | PipelineModel, opt: torch.optim.Optimizer, batches: Batches, optim: OptimConfig,
               step: int, *, want_norm: bool = False) -> StepResult:
    """One synchronous optimiser step of `model` (see the module docstring)."""
    start = time.perf_counter()
    model.pacer.begin_step()
    lr = optim.lr_at(step)
    O.set_lr(opt, lr)
    model.zero_grad()
    k = optim.grad_accum
    total = 0.0
    for j in range(k):
        index = step * k + j
        local = j < k - 1 and model.state.grad_sync == "bucket"  # synchronise once, after the last microstep
        with model.no_sync() if local else contextlib.nullcontext():
            loss = model(model.local_batch(batches(index)), step=index)
            (loss if k == 1 else loss / k).backward()
        total += float(loss.detach())
    norm = None
    if optim.clip_grad_norm:
        norm = float(model.clip_grad_norm_(optim.clip_grad_norm))
    elif want_norm:
        with model.pacer.aside():  # reported only: not the step the plan prices
            norm = float(model.grad_norm())
    opt.step()
    model.pacer.end_step()
    seconds = time.perf_counter() - start - model.pacer.totals["aside"]
    model.state.losses.append(total / k)
    model.state.step_times.append(seconds)
    return StepResult(total / k, lr, norm, seconds)


def eval_loss(model: ParallelModel | PipelineModel, batches: Batches, count: int) -> float:
    """Mean global loss over the first `count` batches of an evaluation source (no gradients, no dropout)."""
    return sum(model.evaluate(model.local_batch(batches(i))) for i in range(count)) / count
