"""The library API: a plan's rank as a model object, for a training loop of your own (`hap run` is one).

    import torch.distributed as dist, runner
    dist.init_process_group("gloo")                       # torchrun / Slurm set the environment
    model = runner.parallelize("plan.json")               # this rank's program and parameter shards
    opt = model.optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    for step, batch in enumerate(my_global_batches):      # the same global batch on every rank
        loss = model(model.local_batch(batch))            # the global loss
        loss.backward()                                   # gradients synchronised as the plan says
        model.clip_grad_norm_(1.0)
        opt.step(); opt.zero_grad()
    model.save_pretrained("out/")                         # safetensors (from_pretrained for hf models)

What the object does for you, and why each piece is here:
- `local_batch` slices every input by the plan's (uneven) ratios, and for overlap `duplex` into the two
  half-batch streams; `model(local)` returns the *global* loss (a Partial loss's addends are summed);
- `loss.backward()` runs the rank's backward, then, at the end of the backward pass (an autograd
  callback, as DDP does), synchronises gradients as the plan says: its buckets (overlap), the
  reduce-scatters of sharded states (ZeRO). Gradients already held from earlier microsteps are set
  aside during a backward and added back after it, so accumulation sums correctly synchronised
  gradients; `with model.no_sync():` around the first microsteps of a step keeps their gradients local
  and the last backward synchronises the sum, once per step, as DDP's `no_sync` does;
- `optimizer(cls, **kw)` builds `cls` over what this rank steps (its ZeRO slices where the plan shards
  states), weight decay only on matrices (runner.optim.decays of the whole weight), and its `step()` does
  fp16's agreed loss scaling and the all-gathers of updated slices. It is a subclass of `cls`, so
  torch's LR schedulers take it. Without sharded states or fp16, any `torch.optim` over `parameters()` works;
- `clip_grad_norm_` computes the true global norm: replicated gradients counted once, the squares of
  sharded and sliced ones summed across ranks;
- `full_state_dict` / `load_full_state_dict` gather or scatter the single-device parameters (names as the
  model has them); `full_grad_dict` gathers the gradients the optimiser last got (verify mode compares them); `save_pretrained` writes them as safetensors (runner.weights).

Pipeline plans: `parallelize` returns a `runner.pipeline_api.PipelineModel` with the same surface where it
applies, so the loop above runs unchanged. What differs: `local_batch` returns the whole global batch
(every stage reads it), `model(batch)` runs the batch's whole schedule, forward and backward of every
microbatch (a pipeline cannot separate them), and `loss.backward()` only synchronises the gradients inside
each stage and applies them, scaled by the loss's incoming gradient; the optimiser is `cls` itself (no
ZeRO, no fp16); no dropout. Its module docstring says more.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from engine.model.dropout import RngKey
from engine.bundle.archive import plan_parallelism
from engine.pipeline.plan import PipelinePlan
from engine.spmd.plan import Plan
from engine.theory.core import FULL, PARTIAL

from . import optim as O
from .collectives import run_collective
from .duplex import run_halves
from .global_batch import ApiError, flat_batch
from .pipeline_api import PipelineModel, parallelize_pipeline
from .precision import autocast
from .program import shard
from .timing import Pacer
from .train import RankState, factory_device, gathered_grads, gathered_params, setup_rank, sync_gradients
from .zero import optimizer_params


@dataclass
class LocalBatch:
    """This rank's share of one global batch: the program's input slices in argument order (or, under
    overlap duplex, one list per half-batch stream)."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    halves: list[list[torch.Tensor]] = field(default_factory=list)


class _GlobalLoss(torch.autograd.Function):
    """Returns the global loss; its backward scales the rank's local loss by `coef` and queues the
    gradient synchronisation for the end of the backward pass."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, value: torch.Tensor, coef: float, model: "ParallelModel") -> torch.Tensor:
        ctx.coef, ctx.model = coef, model
        return value.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.model._backward_begins(g)
        torch.autograd.Variable._execution_engine.queue_callback(ctx.model._backward_ends)
        return g * ctx.coef, None, None, None


class ParallelModel:
    """One rank of an SPMD plan, as a model object for your own loop (see the module docstring)."""

    def __init__(self, plan: Plan, state: RankState, rank: int, pacer: Pacer | None = None) -> None:
        self.plan, self.state, self.rank = plan, state, rank
        self.pacer = pacer or Pacer()
        self.forwards = 0
        """Forward passes so far: the dropout key of the next one when `forward` is given no `step`."""
        self._held: list[torch.Tensor | None] = []
        self._pending: list[torch.Tensor | None] | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._sync = True
        """False inside `no_sync()`: backward keeps gradients local."""
        self._local = False
        """Whether the replicated weights' gradients hold local addends not yet synchronised (after a backward under no_sync)."""

    # --- what the plan is -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def device(self) -> torch.device:
        return self.state.device

    def names(self) -> list[str]:
        """The model's name of each of this rank's parameters, in `parameters()` order."""
        return [self.plan.graph[node].attrs["target"] for node, _ in self.state.program.params]

    def whole_shapes(self) -> list[tuple[int, ...]]:
        """The whole (single-device) shape of each parameter, in `parameters()` order."""
        return [tuple(self.plan.graph[node].shape) for node, _ in self.state.program.params]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """What this rank's optimiser steps: its shards, and its flat slices of sharded-state weights."""
        return iter(optimizer_params(self.state))

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return zip(self.names(), optimizer_params(self.state))

    def param_groups(self, weight_decay: float = 0.0) -> list[dict[str, Any]]:
        """Parameter groups with weight decay on matrices only (by the whole weight's shape)."""
        return O.param_groups(optimizer_params(self.state), self.whole_shapes(), weight_decay)

    # --- batches ----------------------------------------------------------------------------------
    def local_batch(self, batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> LocalBatch:
        """This rank's share of a global batch (a tuple in the model's input order, or a dict by input name)."""
        flat = self._flat(batch)
        st, plan = self.state, self.plan
        if st.halves:
            return LocalBatch(halves=[half_inputs(h, self.rank, flat, st.device) for h in st.halves])
        return LocalBatch([shard(plan, node, form, self.rank, flat[plan.graph[node].attrs["index"]]).to(st.device)
                           for node, form in st.program.leaves if self._is_input(node)])

    def _is_input(self, node: int) -> bool:
        return not self.state.program.is_param[node] and node not in self.state.buffers

    def _flat(self, batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return flat_batch(self.plan.graph, batch)

    # --- forward and backward ---------------------------------------------------------------------
    def __call__(self, local: LocalBatch, *, step: int | None = None) -> torch.Tensor:
        return self.forward(local, step=step)

    def forward(self, local: LocalBatch, *, step: int | None = None) -> torch.Tensor:
        """The global loss of a local batch; `step` keys the dropout masks (default: the number of forwards so far)."""
        key = self.forwards if step is None else step
        self.forwards += 1
        st = self.state
        partial = st.program.loss_form == PARTIAL
        coef = 1.0 if partial else 1.0 / self.world_size
        if st.halves:
            addend, anchor = self._duplex_forward(local, key, coef)
        else:
            with factory_device(st.device), autocast(st.precision, st.device), \
                    (st.zero.saving() if st.zero else contextlib.nullcontext()):
                anchor = st.program.module(*self._args(local, key))  # gathered stage-3 weights die with the call
            addend = anchor.detach().float().reshape(())
        self.pacer.set_phase("bwd")
        value = addend.clone()
        if partial:  # the addends' sum: every rank reports the global loss
            run_collective("all_reduce", "loss", dist.all_reduce, value)
        if st.scaler:
            coef *= st.scaler.factor()
        return _GlobalLoss.apply(anchor, value, coef, self)

    def _args(self, local: LocalBatch, key: int, train: bool = True) -> list:
        st = self.state
        params = iter(st.params if st.zero is None else st.zero.program_params(st.params))
        inputs = iter(local.inputs)
        rng = [RngKey(st.seed, key, train)] if st.program.uses_rng else []
        return rng + [next(params) if st.program.is_param[node] else st.buffers[node] if node in st.buffers
                      else next(inputs) for node, _ in st.program.leaves]

    def _duplex_forward(self, local: LocalBatch, key: int, coef: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Both half-batch streams, forward and backward at once (runner.duplex): their gradients wait in
        `_pending` for `loss.backward()`, which scales them by the loss's incoming gradient."""
        st = self.state
        rng = [RngKey(st.seed, key)] if st.program.uses_rng else []
        args = [fill_half(h, st.params, rng, inputs) for h, inputs in zip(st.halves, local.halves)]
        pacers = [self.pacer.half(), self.pacer.half()]
        loss, grads = run_halves(st.halves, st.params, args, pacers, coef * (st.scaler.factor() if st.scaler else 1.0),
                                 lambda: factory_device(st.device), lambda: autocast(st.precision, st.device))
        self.pacer.absorb("(duplex halves)", pacers)
        self._pending = grads
        return loss.detach().float().reshape(()), torch.zeros((), requires_grad=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep this rank's gradients local, summed into `.grad`; the first backward
        after it synchronises the sum (DDP's `no_sync`, for gradient accumulation: one synchronisation per
        optimiser step). Weights whose states are sharded at stage 2 or 3 still reduce-scatter as their
        gradients come (their whole gradients are not kept). Use it for the first microsteps of a step."""
        if self.state.grad_sync != "bucket":
            raise ApiError("no_sync() needs the bucket gradient sync: per-parameter sync all-reduces inside backward")
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _backward_begins(self, g: torch.Tensor) -> None:
        """Before any parameter gradient of this backward: set aside the gradients of earlier microsteps
        that this backward's synchronisation would count again, and arm the buckets."""
        st = self.state
        already = [p.grad is not None for p, synced in zip(st.params, st.full_params) if synced]
        if not self._sync and any(already) and not self._local:
            raise ApiError("a backward under no_sync() after a synchronised one in the same step would count the "
                           "synchronised gradients again: use no_sync() for the first microsteps of a step only")
        self._held = []
        for p, synced in zip(st.params, st.full_params):
            hold = synced and self._sync and not self._local  # local addends of no_sync microsteps are synchronised now
            self._held.append(p.grad if hold else None)
            if hold:
                p.grad = None
        if self._pending is not None:  # duplex: the halves' gradients, times the loss's incoming gradient
            scale = float(g)
            for p, grad in zip(st.params, self._pending):
                if grad is not None:
                    grad = grad if scale == 1.0 else grad * scale
                    p.grad = grad if p.grad is None else p.grad + grad
            self._pending = None
        if st.buckets is not None and self._sync:
            st.buckets.arm(None)

    def _backward_ends(self) -> None:
        """After the backward pass: synchronise as the plan says, then add back the held gradients."""
        st = self.state
        self.pacer.set_phase("step")
        if not self._sync:
            self._local = True
            return
        self._local = False
        sync_gradients(st)
        if st.zero:
            st.zero.reduce_gradients()
        for p, held in zip(st.params, self._held):
            if held is not None:
                p.grad = held if p.grad is None else held.add_(p.grad)
        self._held = []

    @torch.no_grad()
    def evaluate(self, local: LocalBatch) -> float:
        """The global loss of a local batch without gradients and without dropout (as `module.eval()`)."""
        st = self.state
        if st.halves:
            raise ApiError("evaluate() runs the plan's one program; under overlap duplex use a plan with overlap "
                           "ddp or none for evaluation")
        with factory_device(st.device), autocast(st.precision, st.device):
            value = st.program.module(*self._args(local, 0, train=False)).detach().float().reshape(()).clone()
        if st.program.loss_form == PARTIAL:
            run_collective("all_reduce", "loss", dist.all_reduce, value)
        return float(value)

    # --- the optimiser ------------------------------------------------------------------------------
    def optimizer(self, cls: type[torch.optim.Optimizer] = torch.optim.AdamW, weight_decay: float | None = None,
                  **kwargs: Any) -> torch.optim.Optimizer:
        """`cls` over this rank's parameters (ZeRO slices included), decay on matrices only; its step()
        does the plan's work around the update (see the module docstring)."""
        st = self.state
        decay = weight_decay or 0.0
        extra = {"weight_decay": weight_decay} if weight_decay is not None else {}

        def build(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
            return _parallel_class(cls, self)(O.param_groups(tensors, self.whole_shapes(), decay), **kwargs, **extra)

        opt = build(optimizer_params(st))
        st.optimizer = opt
        if st.zero:
            st.zero.build_optimizer = lambda tensors: cls(O.param_groups(tensors, self.whole_shapes(), decay),
                                                          **kwargs, **extra)
        self._optimizer = opt
        return opt

    def zero_grad(self) -> None:
        st = self.state
        self._local = False
        for p in list(st.params) + list(optimizer_params(st)):
            p.grad = None
        if st.zero:
            for sp in st.zero.staged:
                if sp.full is not None:
                    sp.full.grad = None

    def _step(self, opt: torch.optim.Optimizer, inner) -> Any:
        st = self.state
        out = None
        if st.scaler:
            st.scaler.step(opt)
        else:
            out = inner()
        if st.zero:
            st.zero.gather_updated()
        return out

    # --- gradients ------------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients (fp16: unscaled first)."""
        st = self.state
        if st.scaler:
            if self._optimizer is None:
                raise ApiError("an fp16 plan's gradients are loss-scaled: build the optimiser with model.optimizer(...) "
                               "before clipping")
            st.scaler.unscale_(self._optimizer)
        replicated, sliced = [], []
        staged = {sp.index for sp in st.zero.staged} if st.zero else set()
        for i, ((_, form), p) in enumerate(zip(st.program.params, optimizer_params(st))):
            if p.grad is None:
                continue
            (replicated if form == FULL and i not in staged else sliced).append(p.grad)
        mine = O.total_norm(sliced).double().square().to(st.device)  # NCCL reduces only tensors on the GPU
        run_collective("all_reduce", "grad_norm", dist.all_reduce, mine)
        return (O.total_norm(replicated).double().square() + mine.cpu()).sqrt().float()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so their global norm is at most `max_norm`; returns the norm before clipping."""
        norm = self.grad_norm()
        O.clip_([p.grad for p in optimizer_params(self.state) if p.grad is not None], norm, max_norm)
        return norm

    # --- whole state ---------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its whole shape, by the model's names (collective: every rank calls it)."""
        return gathered_params(self.plan, self.state)

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient as the optimiser last got it, gathered whole, by the model's names, on
        the CPU (collective; what `--verify` compares step by step: runner.verify)."""
        return gathered_grads(self.plan, self.state)

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set every parameter from whole tensors by the model's names, each rank taking its shard."""
        st = self.state
        by = st.zero.by_index() if st.zero else {}
        for i, ((node, form), name, shape) in enumerate(zip(st.program.params, self.names(), self.whole_shapes())):
            if name not in state:
                raise ApiError(f"load_full_state_dict: no tensor '{name}' in the state given")
            whole = state[name]
            if tuple(whole.shape) != shape:
                raise ApiError(f"load_full_state_dict: '{name}' has shape {list(whole.shape)}, the plan's model "
                               f"{list(shape)}")
            piece = shard(self.plan, node, form, self.rank, whole.to(st.device))
            sp = by.get(i)
            if sp is not None:
                sp.slice.copy_(sp.mine(piece))
                if sp.full is not None:
                    sp.full.copy_(piece)
            else:
                st.params[i].copy_(piece)

    def save_pretrained(self, out_dir: str | Path, tokenizer_dir: str | None = None) -> None:
        """Write the whole model as safetensors (a directory `from_pretrained` loads for transformers
        models) on rank 0; collective."""
        from .weights import module_with_state, save_model

        state = self.full_state_dict()
        if self.rank == 0:
            save_model(out_dir, module_with_state(self.plan, state), tokenizer_dir)
        dist.barrier()


def half_inputs(half: Any, rank: int, batch: tuple[torch.Tensor, ...], device: torch.device) -> list[torch.Tensor]:
    """A half stream's shares of its rows of the global batch, in argument order."""
    out = []
    for node, form in half.program.leaves:
        if not half.program.is_param[node] and node not in half.buffers:
            index = half.plan.graph[node].attrs["index"]
            d, start, count = half.rows[index]
            out.append(shard(half.plan, node, form, rank, batch[index].narrow(d, start, count)).to(device))
    return out


def fill_half(half: Any, params: list[torch.nn.Parameter], rng: list, inputs: list[torch.Tensor]) -> list:
    """A half stream's program arguments from its local input slices."""
    it, ins = iter(params), iter(inputs)
    return list(rng) + [next(it) if half.program.is_param[node] else half.buffers[node] if node in half.buffers
                        else next(ins) for node, _ in half.program.leaves]


def _parallel_class(cls: type[torch.optim.Optimizer], model: ParallelModel) -> type[torch.optim.Optimizer]:
    """`cls` whose step() also does the plan's work around the update (fp16 scaling, ZeRO gathers)."""

    def step(self, closure=None):
        if getattr(self, "_hap_inner", False):  # the loss scaler's own call of step()
            return cls.step(self, closure)
        self._hap_inner = True
        try:
            return model._step(self, lambda: cls.step(self, closure))
        finally:
            self._hap_inner = False

    return type(f"Parallel{cls.__name__}", (cls,), {"step": step, "__module__": __name__})


def parallelize(plan: Plan | PipelinePlan | str | Path, rank: int | None = None, *, seed: int = 0,
                init: Mapping[str, torch.Tensor] | str | Path | None = None, device: torch.device | str | None = None,
                pacer: Pacer | None = None, probes: bool = False, grad_sync: str = "bucket",
                emulate_links: bool = False) -> ParallelModel | PipelineModel:
    """This rank's model for a plan (a Plan, a PipelinePlan or a plan JSON), under an initialised process group.

    The parameters start from the single-device model initialised from `seed`, or from `init` (a state
    dict, or a safetensors file / save_pretrained directory: runner.weights), and are sharded by the plan.
    A pipeline plan gives a `runner.pipeline_api.PipelineModel` (`emulate_links`: its transfers between
    stages take their predicted time; `pacer`, `probes` and `grad_sync` are SPMD settings)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ApiError("runner.parallelize needs a process group: call torch.distributed.init_process_group "
                       "first (under torchrun, or with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set)")
    world = dist.get_world_size()
    if isinstance(plan, PipelinePlan) or (isinstance(plan, (str, Path)) and plan_parallelism(plan) == "pipeline"):
        return parallelize_pipeline(plan, rank, seed=seed, init=init, device=device, emulate_links=emulate_links)
    if not isinstance(plan, Plan):
        from .rank_setup import load_spmd_plan

        plan = load_spmd_plan(str(plan), world)
    elif plan.world_size != world:
        raise ApiError(f"the plan is for {plan.world_size} devices but the process group has {world} ranks")
    rank = dist.get_rank() if rank is None else rank
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    st = setup_rank(plan, rank, seed, device=device, probes=probes, grad_sync=grad_sync, init=init)
    return ParallelModel(plan, st, rank, pacer)
