"""Gradient buckets all-reduced while backward still runs (the plan's `ddp` overlap, as PyTorch DDP).

The buckets are the plan's (`engine.spmd.overlap.grad_buckets`: Full parameters, filled in reverse
order of use, in launch order). A hook after each Full parameter's gradient accumulation counts
down its bucket; buckets are launched strictly in order, each as soon as it and every bucket
before it are complete: the flat bucket goes out as one asynchronous all-reduce and backward
goes on. Before the optimizer step, `finish` launches what is left (a parameter whose gradient
never reached this rank, because it is unused here, gets a zero addend), waits for every bucket
and copies the sums back into the gradients.

Buckets travel on a process group of their own: activation collectives of backward run on the
default group, and a backend matches collectives by their order *per group*, so a bucket that
one rank launches early and another late (at `finish`) cannot cross a backward collective.
Launching strictly in order keeps the buckets themselves in the same order on every rank.

The Partial loss addend rides in the last bucket (one element more), so the loss costs no
collective of its own. With a `runner.timing.Pacer` installed, a launch reports as a collective
(the emulated computation before it is paid first, so a bucket leaves when a slower device would
have its gradients) and so does each wait: time spent waiting for a bucket shows as comm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.errors import PlanError
from engine.spmd.overlap import grad_buckets
from engine.spmd.plan import Plan
from engine.theory.core import FULL

from .collectives import FlatBuffer, run_collective
from .precision import bucket_dtype
from .program import RankProgram


@dataclass
class Bucket:
    """One all-reduce of gradients: indices into the rank's parameter list, in the bucket's order."""

    members: list[int]
    pending: int = 0
    buffer: FlatBuffer = field(default_factory=FlatBuffer)
    """Where the bucket is built, kept across steps (`runner.collectives.FlatBuffer`)."""
    flat: torch.Tensor | None = None
    work: object | None = None
    launched: float = 0.0


@dataclass
class GradBuckets:
    """The rank's gradient buckets for one run; `arm` before each backward, `finish` after it."""

    params: list[torch.nn.Parameter]
    buckets: list[Bucket]
    group: object
    hooks: list = field(default_factory=list)
    loss: torch.Tensor | None = None
    next_launch: int = 0
    live: bool = False
    dtype: torch.dtype | None = None
    """The dtype the buckets are all-reduced in (None: the gradients' fp32; bf16 under grad_dtype bf16). A
    bf16 bucket leaves the loss out: it is all-reduced alone, in fp32, at `finish`."""

    @staticmethod
    def of(plan: Plan, program: RankProgram, params: list[torch.nn.Parameter], group, *,
           hooks: bool = True) -> "GradBuckets":
        """The plan's buckets over the rank's parameters; `hooks` launches them during backward
        (ddp), without them `finish` launches every bucket after backward (duplex)."""
        staged = plan.shard_states.get("stages", {})  # reduce-scattered by runner.zero instead
        index = {node: i for i, (node, form) in enumerate(program.params) if form == FULL
                 and plan.graph[node].name not in staged}
        buckets = [Bucket([index[n] for n in b if n in index]) for b in grad_buckets(plan.graph, plan.program)]
        buckets = [b for b in buckets if b.members]
        missing = set(index.values()) - {i for b in buckets for i in b.members}
        if missing:  # a Full parameter outside every slot would never be summed: refuse loudly
            raise PlanError(f"Full parameters {sorted(missing)} are in no gradient bucket; regenerate the plan with `hap plan`")
        out = GradBuckets(params, buckets, group, dtype=bucket_dtype(plan))
        if hooks:
            owner = {i: k for k, b in enumerate(buckets) for i in b.members}
            out.hooks = [params[i].register_post_accumulate_grad_hook(out._ready_hook(owner[i])) for i in owner]
        return out

    def arm(self, loss_addend: torch.Tensor | None) -> None:
        """Before backward: every bucket waits for all its gradients; the loss addend (or None)
        rides in the last bucket."""
        for b in self.buckets:
            b.pending, b.flat, b.work = len(b.members), None, None
        self.loss, self.next_launch, self.live = loss_addend, 0, True

    def _ready_hook(self, k: int):
        def hook(_: torch.Tensor) -> None:
            if not self.live:  # a backward outside a training step (none in the runner): leave it alone
                return
            self.buckets[k].pending -= 1
            self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].pending == 0:
            self._launch(self.next_launch)

    def _launch(self, k: int) -> None:
        b = self.buckets[k]
        grads = []
        for i in b.members:
            p = self.params[i]
            if p.grad is None:  # unused on this rank: its addend is zero
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.reshape(-1))
        if self._carries_loss(k):
            grads.append(self.loss.reshape(-1))
        b.flat = b.buffer.cat(grads, self.dtype)
        b.launched = time.perf_counter()
        b.work = run_collective("all_reduce.launch", f"bucket{k}", dist.all_reduce, b.flat, dist.ReduceOp.SUM,
                                self.group, True)
        self.next_launch = k + 1

    def finish(self) -> None:
        """After backward: launch the buckets still waiting (in order), wait for all, copy back."""
        while self.next_launch < len(self.buckets):
            self._launch(self.next_launch)
        for k, b in enumerate(self.buckets):
            run_collective("all_reduce.wait", f"bucket{k}", _wait, b.work, b.flat, b.launched)
            FlatBuffer.scatter(b.flat, [self.params[i].grad for i in b.members] +
                               ([self.loss] if self._carries_loss(k) else []))
            b.flat = b.work = None
        if self.loss is not None and (not self.buckets or self.dtype is not None):  # the loss alone
            run_collective("all_reduce", "loss", dist.all_reduce, self.loss, dist.ReduceOp.SUM, self.group)
        self.live = False

    def _carries_loss(self, k: int) -> bool:
        return self.loss is not None and k == len(self.buckets) - 1 and self.dtype is None


def _wait(work, flat: torch.Tensor, launched: float) -> None:
    """Wait for a bucket's all-reduce (the flat bucket and its launch time are for the pacer)."""
    work.wait()
