"""The optimiser of a run: its kind, weight decay, learning-rate schedule, clipping and accumulation.

One `OptimConfig` describes them all, the same on every rank, in the single-device reference and in
a checkpoint's run key, so that a resumed run and `--verify` step exactly as the run does:

- `name`: `sgd`, `adam` or `adamw` (torch.optim's, with their defaults besides the rate and decay);
- `weight_decay` applies to weights of two or more dimensions only (matrices and embeddings), never to
  biases and norm scales, as nanoGPT and most trainers do. The rule reads the *whole* weight's shape
  (`decays`), so a rank's flat ZeRO slice of a matrix is decayed like the matrix;
- the learning rate of optimiser step k is `lr_at(k)`, a pure function of k (linear warm-up over
  `warmup` steps, then `constant`, `cosine` or `linear` decay to `min_lr` at `steps`): no scheduler
  state to save, so resume continues the schedule exactly;
- `clip_grad_norm` > 0 rescales the gradients so their global norm is at most that value;
- `grad_accum` = K: one optimiser step sums the gradients of K microsteps, each one plan batch, each
  microstep's loss weighted 1/K (the step's loss is the mean of the microsteps').
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import torch

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}
"""The learning rate when none is given: SGD's old default, and Adam's usual one."""
MAX_LR = 1e6
"""A learning rate above this is a typo."""
MAX_ACCUM = 4096


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """How the run steps its parameters (see the module docstring)."""

    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0
    steps: int = 1
    """Optimiser steps of the whole run: where `cosine` and `linear` reach `min_lr`."""
    clip_grad_norm: float = 0.0
    """0: no clipping."""
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{self.name}'")
        if not (0 < self.lr <= MAX_LR):
            raise ValueError(f"--lr must be a positive number up to {MAX_LR:g}, got {self.lr}")
        if not (0 <= self.weight_decay < 1e3):
            raise ValueError(f"--weight-decay must be in [0, 1000), got {self.weight_decay}")
        if self.weight_decay and self.name == "adam":
            raise ValueError("--weight-decay with adam adds the decay to the gradient (L2), which is rarely meant: "
                             "use --optimizer adamw (decoupled decay)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got '{self.schedule}'")
        if not 0 <= self.warmup <= max(self.steps, 0):
            raise ValueError(f"--warmup must be in 0..{self.steps} (the run's steps), got {self.warmup}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if not (0 <= self.clip_grad_norm < math.inf):
            raise ValueError(f"--clip-grad-norm must be a non-negative number (0: off), got {self.clip_grad_norm}")
        if not 1 <= self.grad_accum <= MAX_ACCUM:
            raise ValueError(f"--grad-accum must be in 1..{MAX_ACCUM}, got {self.grad_accum}")

    def record(self) -> dict[str, Any]:
        """The settings as plain JSON (metrics, checkpoints' run key)."""
        return asdict(self)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimiser step `step` (0-based): `lr * factor_at(step)`, as torch's LambdaLR
        computes it, so a loop using LambdaLR(opt, cfg.factor_at) gets the same rates to the bit."""
        return self.lr * self.factor_at(step)

    def factor_at(self, step: int) -> float:
        """The schedule's multiplier of the peak rate at optimiser step `step`."""
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        floor = self.min_lr / self.lr
        done = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        if self.schedule == "linear":
            return 1.0 + (floor - 1.0) * done
        return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * done))

    def key(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to continue it (the run's length only matters to a
        decaying schedule)."""
        out = self.record()
        if self.schedule == "constant":
            out.pop("steps")
        return out

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[self.name]

    def kwargs(self) -> dict[str, Any]:
        """The optimiser's constructor arguments besides its parameter groups."""
        kw: dict[str, Any] = {"lr": self.lr}
        if self.name == "adamw":
            kw["weight_decay"] = self.weight_decay
        return kw


def decays(shape: Sequence[int]) -> bool:
    """Whether a weight of this (whole) shape gets weight decay: matrices and embeddings do, biases and
    norm scales don't."""
    return len(shape) >= 2


def param_groups(params: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], weight_decay: float
                 ) -> list[dict[str, Any]]:
    """Two groups, decayed and not, by each parameter's whole shape; in the parameters' order inside
    each group (so state_dict indexes are the same for every run of the same model). One group when
    there is no decay."""
    if not weight_decay:
        return [{"params": list(params)}]
    yes = [p for p, s in zip(params, shapes) if decays(s)]
    no = [p for p, s in zip(params, shapes) if not decays(s)]
    return [{"params": yes, "weight_decay": weight_decay}, {"params": no, "weight_decay": 0.0}]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build(cfg: OptimConfig, params: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]]) -> torch.optim.Optimizer:
    """The reference's optimiser over whole parameters (a rank's comes from `runner.api.ParallelModel.optimizer`)."""
    return cfg.optimizer_class()(param_groups(params, shapes, cfg.weight_decay), **cfg.kwargs())


NORM_ROW = 4096
"""Elements per fp32 partial norm in `total_norm`: short enough that fp32 accumulation stays within a few ulps."""


def total_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together (as a 0-d fp32 tensor).

    Each gradient is cut into rows of `NORM_ROW` elements whose norms are taken in fp32 (in place, no
    copy); their squares are summed in fp64. A whole-gradient fp64 copy cost a step 10-16 ms at 4M
    parameters on a CPU, and a whole-gradient fp32 norm drifts ~1e-5 from the fp64 sum.
    """
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        flat = g.detach().reshape(-1)
        whole = flat.numel() // NORM_ROW * NORM_ROW
        if whole:
            rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1, dtype=torch.float32)
            total += rows.double().square().sum().cpu()
        if whole < flat.numel():
            total += flat[whole:].double().square().sum().cpu()
    return total.sqrt().float()


def clip_(grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients in place so their norm `norm` becomes at most `max_norm` (torch's rule and epsilon)."""
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
