"""The library API for pipeline plans: `runner.parallelize(pipeline_plan)` gives a `PipelineModel`.

    model = runner.parallelize("pipeline_plan.json")      # this rank's stage: its programs and parameters
    opt = model.optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    for step, batch in enumerate(my_global_batches):      # the same global batch on every rank
        loss = model(model.local_batch(batch))            # the whole schedule: every microbatch, fwd and bwd
        loss.backward()                                   # the stage's gradient synchronisation
        model.clip_grad_norm_(1.0)
        opt.step(); opt.zero_grad()
    model.save_pretrained("out/")

The loop reads as the SPMD one (runner.api, `hap run` runs both through runner.loop.train_step), with
these differences, each forced by what a pipeline is:

- `local_batch(batch)` checks the global batch and returns it whole (`PipelineBatch`): every stage
  rank needs all of it (the first stage its inputs, the last its labels, a stage plan its rows of each
  microbatch). `model(batch)` takes a global batch or what `local_batch` returned;
- `model(batch)` runs the *whole* schedule of the batch, the forward and the backward of every
  microbatch in the planned order (a pipeline cannot run the forwards of all microbatches first: the
  schedule interleaves them to bound the activations it keeps). It returns the global loss (every
  rank the same value; the mean over the batch). The schedule's gradients are held aside, not yet in
  `.grad`;
- `loss.backward()` therefore computes nothing: it synchronises those gradients inside each stage
  (the all-reduce of data-parallel or Full-parameter addends), scales them by the loss's incoming
  gradient (so `(loss / K).backward()` accumulates K microsteps as torch does) and adds them to
  `.grad`; under `with model.no_sync():` it only adds them, and the next backward synchronises the sum
  (one synchronisation per accumulated step, as for SPMD plans). A forward whose loss is never
  backpropagated leaves no gradient; backpropagating an older loss after a newer forward is refused;
- `optimizer(cls, **kw)` builds `cls` over this rank's stage parameters (its shards under a stage plan),
  weight decay on matrices by their whole shape (runner.optim.param_groups). It is `cls` itself: there
  is no loss scaling (fp16 is refused for pipelines) and no sharded optimizer state. A rank the
  partition left idle holds no parameters; its optimiser steps one empty tensor, so a loop and an LR
  scheduler run unchanged on it;
- `clip_grad_norm_` uses the true global norm: each stage's parameters counted once (a replicated
  gradient by the stage's first rank, a stage plan's shards by every rank holding one), summed over
  the stages;
- `full_state_dict` / `load_full_state_dict` / `save_pretrained` gather or scatter the single-device
  parameters across stages and shards, as for SPMD plans; `evaluate(batch)` runs the forwards only;
- `step=` is accepted and ignored: dropout is not run in pipelines (a model with dropout sites is
  refused at its first forward, as `hap run` refuses it). There are no checkpoints (`hap run` refuses
  `--checkpoint-dir` for pipelines) and no timing probes; `parallelize(..., pacer=Pacer(speed))`, installed,
  emulates a slower device (`hap run --speeds`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from engine.pipeline.plan import PipelinePlan
from engine.theory.core import FULL

from . import collectives as C
from . import optim as O
from .global_batch import ApiError, flat_batch
from .pipeline import (IDLE, Init, Links, StageRank, gathered_params, load_pipeline_plan, loss_scales, microbatch_args,
                       schedule_pass, setup_stage_rank, sync_stage)
from .precision import autocast, precision_of
from .program import shard
from .timing import Pacer
from .train import factory_device


@dataclass
class PipelineBatch:
    """The global batch in the plan's input order on this rank's device: every stage rank reads all of it."""

    inputs: tuple[torch.Tensor, ...]


class _PipelineLoss(torch.autograd.Function):
    """The global loss of a schedule already run; its backward hands the incoming gradient to the model,
    which synchronises and applies the schedule's gradients (forward number `number`)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, model: "PipelineModel", number: int) -> torch.Tensor:
        ctx.model, ctx.number = model, number
        return value.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.model._backward(g, ctx.number)
        return None, None, None, None


class PipelineModel:
    """One rank of a pipeline plan, as a model object for your own loop (see the module docstring)."""

    def __init__(self, plan: PipelinePlan, state: StageRank, rank: int, link_s: Sequence[float] | None = None,
                 pacer: Pacer | None = None) -> None:
        self.plan, self.state, self.rank = plan, state, rank
        self.link_s = list(link_s) if link_s else None
        self.pacer = pacer or Pacer()
        """runner.loop marks steps on it; installed, it emulates the rank's speed (`hap run --speeds`) between
        the schedule's sends, receives and collectives. A pipeline records no timeline."""
        self.forwards = 0
        self._pending: list[torch.Tensor | None] | None = None
        self._pending_forward = -1
        self._optimizer: torch.optim.Optimizer | None = None
        self._sync = True
        """False inside `no_sync()`: backward keeps the stage's gradients local."""
        self._local = False
        """Whether `.grad` holds local addends of no_sync microsteps not yet synchronised inside the stage."""

    # --- what the plan is -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def stage(self) -> int:
        """This rank's stage (runner.pipeline.IDLE, -1, for a device the partition left out)."""
        return self.state.stage

    def _leaves(self) -> list[tuple[int, int]]:
        sr = self.state
        return [] if sr.stage == IDLE else list(sr.programs[0].params)

    def _graph(self):
        return self.state.plans[self.state.stage].graph

    def names(self) -> list[str]:
        """The model's name of each of this rank's parameters, in `parameters()` order."""
        return [self._graph()[n].attrs["target"] for n, _ in self._leaves()]

    def whole_shapes(self) -> list[tuple[int, ...]]:
        """The whole (single-device) shape of each parameter, in `parameters()` order."""
        return [tuple(self._graph()[n].shape) for n, _ in self._leaves()]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's stage parameters (its shards under a stage plan); none on an idle rank."""
        return iter(self.state.params)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return zip(self.names(), self.state.params)

    def param_groups(self, weight_decay: float = 0.0) -> list[dict[str, Any]]:
        """Parameter groups with weight decay on matrices only (by the whole weight's shape)."""
        return O.param_groups(self.state.params, self.whole_shapes(), weight_decay)

    # --- batches ----------------------------------------------------------------------------------
    def local_batch(self, batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> PipelineBatch:
        """The global batch checked and moved to this rank's device: a pipeline rank reads all of it."""
        return PipelineBatch(tuple(t.to(self.device) for t in flat_batch(self.plan.graph, batch)))

    # --- the schedule -------------------------------------------------------------------------------
    def __call__(self, batch: PipelineBatch | Sequence[torch.Tensor] | Mapping[str, torch.Tensor], *,
                 step: int | None = None) -> torch.Tensor:
        return self.forward(batch, step=step)

    def forward(self, batch: PipelineBatch | Sequence[torch.Tensor] | Mapping[str, torch.Tensor], *,
                step: int | None = None) -> torch.Tensor:
        """Run the batch's whole schedule; the global loss, whose backward applies its gradients (`step`:
        ignored, pipelines run no dropout)."""
        inputs = (batch if isinstance(batch, PipelineBatch) else self.local_batch(batch)).inputs
        sr = self.state
        self.forwards += 1
        self._pending = None
        loss_sum = torch.zeros(1, dtype=torch.float64, device=sr.device)
        if sr.stage != IDLE:
            held = [p.grad for p in sr.params]
            for p in sr.params:
                p.grad = None
            loss_sum = schedule_pass(self.plan, sr, inputs, self.link_s)
            self._pending = [p.grad for p in sr.params]
            for p, h in zip(sr.params, held):
                p.grad = h
            self._pending_forward = self.forwards
        C.run_collective("all_reduce", "loss", dist.all_reduce, loss_sum)  # only the last stage's ranks hold addends
        anchor = torch.zeros((), requires_grad=True)
        return _PipelineLoss.apply(anchor, loss_sum.float().reshape(()), self, self.forwards)

    def _backward(self, g: torch.Tensor, number: int) -> None:
        """Synchronise the schedule's gradients inside the stage, scale them by `g`, add them to `.grad`."""
        sr = self.state
        if sr.stage == IDLE:
            return
        if self._pending is None or number != self._pending_forward:
            raise ApiError("loss.backward() on a pipeline loss applies the gradients of the last model(batch) "
                           "only, once: call backward on the newest loss before the next forward")
        held = [p.grad for p in sr.params]
        if not self._sync and not self._local and any(h is not None for h in held):
            raise ApiError("a backward under no_sync() after a synchronised one in the same step would count the "
                           "synchronised gradients again: use no_sync() for the first microsteps of a step only")
        for p, grad in zip(sr.params, self._pending):
            p.grad = grad
        self._pending = None
        summed = not self._sync or self._local  # local addends of no_sync microsteps: synchronised as one sum
        if not summed:
            sync_stage(sr, len(self.plan.stages[sr.stage].devices))
        scale = float(g)
        for p, h in zip(sr.params, held):
            if p.grad is not None and scale != 1.0:
                p.grad.mul_(scale)
            if h is not None:
                p.grad = h if p.grad is None else h.add_(p.grad)
        if summed and self._sync:
            sync_stage(sr, len(self.plan.stages[sr.stage].devices))
        self._local = not self._sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside add the schedule's gradients to `.grad` without the stage's synchronisation;
        the first backward after it synchronises the sum, once (DDP's `no_sync`, for the first microsteps of
        an accumulated step)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @torch.no_grad()
    def evaluate(self, batch: PipelineBatch | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> float:
        """The global loss of a batch: the forwards of its microbatches only, no gradients."""
        inputs = (batch if isinstance(batch, PipelineBatch) else self.local_batch(batch)).inputs
        loss_sum = forward_pass(self.plan, self.state, inputs, self.link_s)
        dist.all_reduce(loss_sum)
        return float(loss_sum)

    # --- the optimiser ------------------------------------------------------------------------------
    def optimizer(self, cls: type[torch.optim.Optimizer] = torch.optim.AdamW, weight_decay: float | None = None,
                  **kwargs: Any) -> torch.optim.Optimizer:
        """`cls` over this rank's stage parameters, decay on matrices only (see the module docstring)."""
        extra = {"weight_decay": weight_decay} if weight_decay is not None else {}
        if self.state.params:
            groups = self.param_groups(weight_decay or 0.0)
        else:  # an idle rank: torch's optimisers refuse an empty parameter list
            groups = [{"params": [torch.nn.Parameter(torch.zeros(0, device=self.device))]}]
        opt = cls(groups, **kwargs, **extra)
        self.state.optimizer = opt
        self._optimizer = opt
        return opt

    def zero_grad(self) -> None:
        for p in self.state.params:
            p.grad = None
        self._pending = None
        self._local = False

    # --- gradients ------------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients: each stage's parameters counted once (see the module docstring)."""
        sr = self.state
        mine = []
        for (_, form), p in zip(self._leaves(), sr.params):
            replicated = not sr.hap or form == FULL
            if p.grad is not None and (sr.index == 0 or not replicated):
                mine.append(p.grad)
        total = O.total_norm(mine).double().square().to(sr.device)
        dist.all_reduce(total)
        return total.cpu().sqrt().float()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so their global norm is at most `max_norm`; returns the norm before clipping."""
        norm = self.grad_norm()
        O.clip_([p.grad for p in self.state.params if p.grad is not None], norm, max_norm)
        return norm

    # --- whole state ---------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its whole shape, by the model's names (collective: every rank calls it)."""
        return gathered_params(self.plan, self.state)

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set this rank's stage parameters from whole tensors by the model's names (its shards under a stage plan)."""
        sr = self.state
        for (node, form), p, name, shape in zip(self._leaves(), sr.params, self.names(), self.whole_shapes()):
            if name not in state:
                raise ApiError(f"load_full_state_dict: no tensor '{name}' in the state given")
            whole = state[name]
            if tuple(whole.shape) != shape:
                raise ApiError(f"load_full_state_dict: '{name}' has shape {list(whole.shape)}, the plan's model "
                               f"{list(shape)}")
            piece = shard(sr.plans[sr.stage], node, form, sr.index, whole) if sr.hap else whole
            p.copy_(piece.to(sr.device))

    def save_pretrained(self, out_dir: str | Path, tokenizer_dir: str | None = None) -> None:
        """Write the whole model as safetensors (a directory `from_pretrained` loads for transformers
        models) on rank 0; collective."""
        from .weights import module_with_state, save_model

        state = self.full_state_dict()
        if self.rank == 0:
            save_model(out_dir, module_with_state(self.plan, state), tokenizer_dir)  # type: ignore[arg-type]
        dist.barrier()


@torch.no_grad()
def forward_pass(plan: PipelinePlan, sr: StageRank, batch: tuple[torch.Tensor, ...],
                 link_s: Sequence[float] | None = None) -> torch.Tensor:
    """The forwards of every microbatch in order, cut tensors sent on as in training; this rank's addend
    of the global loss (fp64; zero but on the last stage)."""
    loss_sum = torch.zeros(1, dtype=torch.float64, device=sr.device)
    if sr.stage == IDLE:
        return loss_sum
    S, i = len(plan.stages), sr.stage
    links, weights = Links(plan, sr, link_s), loss_scales(plan, sr, batch)
    group = sr.groups[i] if sr.hap else None
    for m in range(plan.microbatches):
        cut = links.recv(i - 1, m, 0) if i > 0 else {}
        with C.stream(group), factory_device(sr.device), autocast(precision_of(plan), sr.device):
            out = sr.programs[m].module(*microbatch_args(plan, sr, m, batch, cut))
        if i == S - 1:
            loss_sum += float(out * weights[m])
        else:
            links.send(i, m, 0, dict(zip(sr.pieces[i].outputs, out)))
    links.drain()
    return loss_sum


def parallelize_pipeline(plan: PipelinePlan | str | Path, rank: int | None = None, *, seed: int = 0, init: Init = None,
                         device: torch.device | str | None = None, emulate_links: bool = False,
                         pacer: Pacer | None = None) -> PipelineModel:
    """This rank's model for a pipeline plan (a PipelinePlan or a plan JSON), under an initialised process
    group: its stage's programs and parameters from the model initialised from `seed`, or from `init`;
    `pacer` (installed by the caller) emulates the rank's speed."""
    if not dist.is_available() or not dist.is_initialized():
        raise ApiError("runner.parallelize needs a process group: call torch.distributed.init_process_group "
                       "first (under torchrun, or with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set)")
    world = dist.get_world_size()
    if not isinstance(plan, PipelinePlan):
        plan = load_pipeline_plan(str(plan), world)
    elif plan.world_size != world:
        raise ApiError(f"the plan is for {plan.world_size} devices but the process group has {world} ranks")
    elif precision_of(plan) == "fp16":
        raise ApiError("a pipeline plan runs in fp32 or bf16 (fp16's loss scaler would have to span the stages): "
                       "plan it with --precision bf16 (or fp32)")
    rank = dist.get_rank() if rank is None else rank
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sr = setup_stage_rank(plan, rank, seed, device=device, init=init)
    link_s = [b.transfer_s for b in plan.boundaries] if emulate_links else None
    return PipelineModel(plan, sr, rank, link_s, pacer)

