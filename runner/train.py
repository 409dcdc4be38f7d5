"""The training loop of one rank, and the single-device reference it must match (verify mode).

Every rank builds the single-device model from the same seed, keeps its slices of sharded
parameters, runs its `RankProgram`, all-reduces the gradients of Full parameters (their local
gradients are addends) and steps its optimizer on local tensors only.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from engine.model.dropout import RngKey, SiteKeyedDropout
from engine.spmd.plan import Plan
from engine.theory.core import FULL

from . import optim as O
from .batches import Batches, drawn_batch
from .collectives import FlatBuffer, all_reduce_coalesced, gather_padded, run_collective
from .duplex import HalfStream, setup_halves
from .overlap import GradBuckets
from .optim import OptimConfig
from .precision import RankScaler, autocast, bucket_dtype, precision_of
from .program import RankProgram, build_rank_program, shard, sizes_of
from .rebuild import build_module
from .weights import load_pretrained, load_state
from .zero import RankStates, apply_states


def make_batch(plan: Plan, step: int, seed: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """The drawn global batch of one step, a function of (seed, step): the same on every rank and in the
    reference (runner.batches: the run's batches when it has data)."""
    return tuple(t.to(device) for t in drawn_batch(plan.graph.origin, step, seed))


def make_optimizer(params: list[torch.Tensor], name: str, lr: float) -> torch.optim.Optimizer:
    """`name` (sgd, adam, adamw) at rate `lr` over `params` (runner.optim for the other settings)."""
    try:
        return O.build(OptimConfig(name=name, lr=lr), params, [tuple(p.shape) for p in params])
    except ValueError as e:
        raise ValueError(f"unknown optimizer '{name}' (choose sgd, adam or adamw)") from e


@dataclass
class RankState:
    program: RankProgram
    params: list[torch.nn.Parameter]
    full_params: list[bool]
    optimizer: torch.optim.Optimizer
    device: torch.device
    grad_sync: str = "bucket"
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    """Local pieces of the model's buffers (untrained state such as position ids), by leaf node."""
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    seed: int = 0
    """The run's seed: with the step number, it keys the dropout masks (engine/model/dropout.py)."""
    buckets: GradBuckets | None = None
    """The plan's gradient buckets on a group of their own (overlap `ddp` and `duplex`, runner.overlap)."""
    halves: list[HalfStream] = field(default_factory=list)
    """The two half-batch streams of overlap `duplex` (runner.duplex); empty otherwise."""
    bucket: FlatBuffer = field(default_factory=FlatBuffer)
    """Where the one gradient bucket of overlap `none` is built, kept across steps."""
    precision: str = "fp32"
    """The plan's precision: forward runs under autocast in bf16 or fp16 (runner.precision)."""
    scaler: RankScaler | None = None
    """fp16's loss scaler, agreed on by every rank (None in fp32 and bf16)."""
    bucket_dtype: torch.dtype | None = None
    """The dtype gradients are all-reduced in (None: fp32; bf16 under the plan's grad_dtype bf16)."""
    zero: RankStates | None = None
    """The plan's sharded states of Full weights on this rank (runner.zero); None when it has none."""
    trace: "Trace | None" = None
    """Verify mode, rank 0: each step's parameters and gradients, whole (runner.verify checks them)."""


@dataclass
class Trace:
    """The distributed run as verify mode records it (runner.verify), whole tensors on rank 0, one entry per step."""

    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """The parameters before each step, by the names the plan holds (`gathered_params`)."""
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """The gradients each step's optimiser got: synchronised, unscaled, clipped (`gathered_grads`)."""


GRAD_SYNC = ("bucket", "per-param")
"""How Full parameters' gradients are all-reduced: `bucket`, one flat all-reduce after backward (as
DDP does with one bucket), which is what the engine's cost model predicts (`grad_all_reduce`);
`per-param`, one all-reduce per parameter as soon as its gradient is ready during backward."""


def setup_rank(plan: Plan, rank: int, seed: int, optimizer: str | OptimConfig = "sgd", lr: float = 0.05, *,
               device: torch.device | str = "cpu", probes: bool = False, grad_sync: str = "bucket",
               init: Mapping[str, torch.Tensor] | str | Path | None = None) -> RankState:
    """Build the rank's program and its local parameter slices from the seeded single-device model, or
    from `init` (whole weights: a state dict, a safetensors file or a save_pretrained directory)."""
    optim = optimizer if isinstance(optimizer, OptimConfig) else OptimConfig(name=optimizer, lr=lr)
    if grad_sync not in GRAD_SYNC:
        raise ValueError(f"unknown gradient sync '{grad_sync}' (choose {' or '.join(GRAD_SYNC)})")
    if grad_sync != "bucket" and plan.overlap != "none":
        raise ValueError(f"--grad-sync {grad_sync} is for plans without overlap; this plan's overlap is "
                         f"'{plan.overlap}', which sets how gradients are all-reduced")
    device = torch.device(device)
    program = build_rank_program(plan, rank, probes=probes)
    module = initial_module(plan, seed, init)
    named = dict(module.named_parameters(remove_duplicate=False))
    params, full = [], []
    for node, form in program.params:
        full_tensor = named[plan.graph[node].attrs["target"]].detach()
        params.append(torch.nn.Parameter(shard(plan, node, form, rank, full_tensor).clone().to(device)))
        full.append(form == FULL)
        if form == FULL and grad_sync == "per-param":
            params[-1].register_post_accumulate_grad_hook(_grad_all_reduce_hook(plan.graph[node].name))
    named_buffers = dict(module.named_buffers(remove_duplicate=False))
    buffers = {node: shard(plan, node, form, rank, named_buffers[plan.graph[node].attrs["target"]]).to(device)
               for node, form in program.leaves if plan.graph[node].op == "buffer"}
    shapes = [tuple(plan.graph[node].shape) for node, _ in program.params]
    st = RankState(program, params, full, O.build(optim, params, shapes), device, grad_sync, buffers=buffers,
                   seed=seed, precision=precision_of(plan), bucket_dtype=bucket_dtype(plan))
    st.scaler = RankScaler(device) if st.precision == "fp16" else None
    st.zero = apply_states(plan, st, lambda tensors: O.build(optim, tensors, shapes))
    if plan.overlap != "none":  # every rank creates the same groups in the same order
        st.halves = setup_halves(plan, rank, module, device, probes=probes) if plan.overlap == "duplex" else []
        group = dist.new_group(list(range(plan.world_size)))
        st.buckets = GradBuckets.of(plan, program, params, group, hooks=plan.overlap == "ddp")
    return st


def initial_module(plan: Plan, seed: int, init: Mapping[str, torch.Tensor] | str | Path | None = None) -> torch.nn.Module:
    """The single-device model a run starts from: seeded, then filled from `init` when given (checked by
    name, shape and dtype: runner.weights)."""
    module = build_module(plan, seed)
    if init is None:
        return module
    if isinstance(init, Mapping):
        load_state(module, init, "the state given")
    else:
        load_pretrained(module, init)
    return module


def _grad_all_reduce_hook(name: str):
    # every rank runs the same program, so autograd reaches the parameters in the same order
    def hook(p: torch.Tensor) -> None:
        run_collective("all_reduce", name, dist.all_reduce, p.grad)
    return hook


def factory_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Where tensors the program creates itself (masks, `full`, `arange`, graph constants) are made:
    the rank's GPU under NCCL. On the CPU nothing is set, since the device mode costs every op."""
    return contextlib.nullcontext() if device.type == "cpu" else torch.device(device)


def program_args(plan: Plan, st: RankState, rank: int, batch: tuple[torch.Tensor, ...], step: int = 0) -> list:
    """The rank program's arguments in call order: the dropout key of `step` (when the plan has
    dropout sites), then local parameters, buffers and this rank's input slices."""
    params = iter(st.params if st.zero is None else st.zero.program_params(st.params))
    rng = [RngKey(st.seed, step)] if st.program.uses_rng else []
    return rng + [next(params) if st.program.is_param[node] else st.buffers[node] if node in st.buffers
            else shard(plan, node, form, rank, batch[plan.graph[node].attrs["index"]]) for node, form in st.program.leaves]


def sync_gradients(st: RankState) -> None:
    """All-reduce the gradients of Full parameters: the plan's buckets when it overlaps (`runner.overlap`,
    launched during backward under `ddp`), else one flat collective."""
    if st.buckets is not None:
        st.buckets.finish()
        return
    grads = []
    for p, is_full in zip(st.params, st.full_params):
        if is_full and st.grad_sync == "bucket":
            if p.grad is None:  # unused on this rank: its addend is zero
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    all_reduce_coalesced(grads, buffer=st.bucket, dtype=st.bucket_dtype)


def gathered_params(plan: Plan, st: RankState) -> dict[str, torch.Tensor]:
    """Every parameter of the plan, reassembled to its full shape (for verify mode)."""
    out = {}
    for i, ((node, form), p) in enumerate(zip(st.program.params, st.params)):
        t = p.detach() if st.zero is None else st.zero.whole(i, p)
        if form >= 0:
            t = gather_padded(t.contiguous(), form, sizes_of(plan, node, form))
        out[plan.graph[node].attrs["target"]] = t
    return out


def gathered_grads(plan: Plan, st: RankState) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the optimiser last received it (synchronised, unscaled, clipped),
    reassembled to its full shape (verify mode checks the program on these). Collective: every rank
    calls it; a parameter without a gradient on a rank contributes zeros there."""
    from .zero import optimizer_params

    staged = st.zero.by_index() if st.zero is not None else {}
    out = {}
    for i, ((node, form), p) in enumerate(zip(st.program.params, optimizer_params(st))):
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
        if i in staged:  # the optimiser steps a ZeRO slice: its gradient is the slice's
            g = staged[i].gather(g)
        elif form >= 0:
            g = gather_padded(g.contiguous(), form, sizes_of(plan, node, form))
        out[plan.graph[node].attrs["target"]] = _copy(g)
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A detached fp32 copy on the CPU (a gradient may be a view of a bucket the next step overwrites)."""
    return t.detach().float().cpu().clone()


def single_device_backward(module: torch.nn.Module, draw: Batches, step: int, k: int, seed: int, precision: str,
                           device: torch.device | str, scaler: torch.amp.GradScaler | None,
                           dtype: torch.dtype | None = None) -> float:
    """One device's forward and backward of step `step`'s `k` accumulated batches, under the ranks' dropout masks
    and autocast, gradients added into `.grad` (scaled when `scaler` is given); `dtype` casts the float inputs.
    Returns the step's mean loss. The reference run and verify's forced steps both go through it."""
    total = 0.0
    for j in range(k):
        index = step * k + j
        inputs = [t.to(device) for t in draw(index)]  # drawn outside the mode: a file's torch.randn is no site
        if dtype is not None:
            inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
        with SiteKeyedDropout(RngKey(seed, index)), autocast(precision, device):
            loss = module(*inputs)
        scaled = loss if k == 1 else loss / k
        (scaler.scale(scaled) if scaler else scaled).backward()
        total += float(loss.detach())
    return total / k


def reference_run(plan: Plan, steps: int, seed: int, optimizer: str = "sgd", lr: float = 0.05,
                  device: torch.device | str = "cpu", *, optim: OptimConfig | None = None,
                  batches: Batches | None = None, init: Mapping[str, torch.Tensor] | str | Path | None = None):
    """Single-device training of the same model on the same batches and dropout masks, with the same
    optimiser, schedule, clipping and accumulation (`optim`; else `optimizer` at a fixed `lr`): losses
    and final parameters."""
    optim = optim or OptimConfig(name=optimizer, lr=lr)
    module = initial_module(plan, seed, init).to(device)
    params = list(module.parameters())
    opt = O.build(optim, params, [tuple(p.shape) for p in params])
    precision = precision_of(plan)
    scaler = torch.amp.GradScaler(torch.device(device).type) if precision == "fp16" else None
    draw = batches or Batches(lambda index: make_batch(plan, index, seed))
    k = optim.grad_accum
    losses: list[float] = []
    for step in range(steps):
        O.set_lr(opt, optim.lr_at(step))
        opt.zero_grad(set_to_none=True)
        losses.append(single_device_backward(module, draw, step, k, seed, precision, device, scaler))
        if scaler is not None:
            scaler.unscale_(opt)
        if optim.clip_grad_norm:
            grads = [p.grad for p in params if p.grad is not None]
            O.clip_(grads, O.total_norm(grads), optim.clip_grad_norm)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return losses, {k_: v.detach() for k_, v in module.named_parameters(remove_duplicate=False)}
