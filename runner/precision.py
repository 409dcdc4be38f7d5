"""Mixed precision on a rank, as the plan's options say (`PlanOptions.precision`, `grad_dtype`).

- `autocast`: forward runs under `torch.autocast` on the rank's device type in bf16 or fp16 (CPU
  autocast under gloo here, CUDA under NCCL); parameters, gradients and optimizer state stay fp32.
  The single-device reference (`runner.train.reference_run`) runs under the same autocast, so
  verify mode compares like with like.
- `RankScaler`: fp16 training scales the loss (`torch.amp.GradScaler`, dynamic). Gradients are
  scaled on every rank by the same factor, synchronised, then unscaled; a sharded parameter's
  gradient lives on one rank only, so an inf or NaN one rank finds is made known to all (an
  all-reduce of the flag) and every rank skips the step and backs off the scale together.
- `wire_dtype`: a pipeline's boundary activations travel in the low dtype (runner.pipeline).
- `bucket_dtype`: `grad_dtype` bf16 all-reduces the gradient buckets in bf16 (cast, all-reduce,
  cast back: `runner.collectives.all_reduce_coalesced`), as DDP's bf16 compression hook does.

gloo (torch 2.13) runs all_reduce, all_gather, reduce_scatter, all_to_all_single and broadcast on
bf16 and fp16 tensors on the CPU (`tests/runner/test_runner_precision.py` checks it), so the
activation collectives take autocast's bf16 tensors as they are.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from engine.spmd.plan import Plan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The torch dtype of each mixed precision and gradient dtype (`engine.options.PRECISIONS`, `GRAD_DTYPES`)."""


def precision_of(plan) -> str:
    """The plan's training precision (`fp32` for plans made before it was recorded)."""
    return plan.options.precision


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """Forward under autocast in `precision` on `device`'s type; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[precision])


def wire_dtype(plan, tensor: int) -> torch.dtype:
    """The dtype a pipeline boundary tensor travels in: autocast's low dtype for a float32 activation
    under mixed precision (what the planner prices, `engine.pipeline.partition`), else the graph's."""
    node = plan.graph[tensor]
    low = DTYPES.get(precision_of(plan))
    if low is not None and node.dtype == "float32":
        return low
    return getattr(torch, node.dtype)


def bucket_dtype(plan: Plan) -> torch.dtype | None:
    """The dtype the plan's gradient buckets are all-reduced in (None: the gradients' own, fp32)."""
    return DTYPES.get(plan.options.grad_dtype)


class RankScaler:
    """fp16's dynamic loss scaler, agreed on by every rank of `group`: `scale` the loss before
    backward, `step` after the gradients are synchronised (unscale, skip on any rank's inf/NaN, update)."""

    def __init__(self, device: torch.device | str, group=None) -> None:
        self.device = torch.device(device)
        self.scaler = torch.amp.GradScaler(self.device.type)
        self.group = group
        self.skipped = 0
        """Steps skipped because some rank found an inf or NaN gradient."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def factor(self) -> float:
        """The current scale as a number (for callers that multiply the loss themselves, the duplex halves)."""
        return float(self.scaler.scale(torch.ones((), device=self.device)))

    def state_dict(self) -> dict:
        """The scale, its growth counter and the skipped steps (plain numbers: a checkpoint keeps them)."""
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.skipped = int(state.get("skipped", 0))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale now (before clipping); `step` then does not unscale again."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless some rank's gradients overflowed (unscaled first), then update the scale; whether it stepped."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        finite = all(bool(torch.isfinite(t).all()) for t in grads)
        bad = torch.tensor([0.0 if finite else 1.0], device=self.device)  # on the GPU under NCCL
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if bad.item() and finite and grads:
            grads[0].view(-1)[0] = float("inf")  # another rank overflowed: this rank's scaler must skip too
        self.scaler.step(optimizer)
        self.scaler.update()
        self.skipped += int(bad.item())
        return not bad.item()
