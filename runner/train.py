"""The training loop of one rank, and the single-device reference it must match (verify mode).

Every rank builds the single-device model from the same seed, keeps its slices of sharded
parameters, runs its `RankProgram`, all-reduces the gradients of Full parameters (their local
gradients are addends) and steps its optimizer on local tensors only.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.model import source, zoo
from engine.model.dropout import RngKey, SiteKeyedDropout
from engine.spmd.plan import Plan
from engine.theory.core import FULL, PARTIAL

from .collectives import FlatBuffer, all_reduce_coalesced, gather_padded, run_collective
from .duplex import HalfStream, half_args, run_halves, setup_halves
from .overlap import GradBuckets
from .precision import RankScaler, autocast, bucket_dtype, precision_of
from .program import RankProgram, build_rank_program, shard, sizes_of
from .timing import Pacer
from .zero import RankStates, apply_states


def build_module(plan: Plan, seed: int) -> torch.nn.Module:
    """The single-device model the plan was made for, initialised from `seed` on the CPU.

    Zoo models are called with the positional batch; file and Hugging Face models (engine.model.source)
    come back with a forward that takes the flat batch of `make_batch` and returns the loss. Every
    rank builds the whole model once (its memory cost) and then keeps only its slices."""
    origin = plan.graph.origin
    if "zoo" not in origin:
        return source.build_module(origin, seed)
    entry = zoo.entry(origin["zoo"])
    torch.manual_seed(seed)
    return entry.build(source.zoo_config(origin))


def make_batch(plan: Plan, step: int, seed: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """The global batch of one step, a function of (seed, step): the same on every rank and in the reference."""
    origin = plan.graph.origin
    if "zoo" not in origin:
        return tuple(t.to(device) for t in source.make_batch(origin, seed, step))
    entry = zoo.entry(origin["zoo"])
    batch = entry.example_inputs(source.zoo_config(origin), "cpu", seed=seed * source.BATCH_SEED + step)
    return tuple(t.to(device) for t in batch)


def make_optimizer(params: list[torch.Tensor], name: str, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"unknown optimizer '{name}' (choose sgd or adam)")


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


GRAD_SYNC = ("bucket", "per-param")
"""How Full parameters' gradients are all-reduced: `bucket`, one flat all-reduce after backward (as
DDP does with one bucket), which is what the engine's cost model predicts (`grad_all_reduce`);
`per-param`, one all-reduce per parameter as soon as its gradient is ready during backward."""


def setup_rank(plan: Plan, rank: int, seed: int, optimizer: str = "sgd", lr: float = 0.05, *,
               device: torch.device | str = "cpu", probes: bool = False, grad_sync: str = "bucket") -> RankState:
    """Build the rank's program and its local parameter slices from the seeded single-device model."""
    if grad_sync not in GRAD_SYNC:
        raise ValueError(f"unknown gradient sync '{grad_sync}' (choose {' or '.join(GRAD_SYNC)})")
    if grad_sync != "bucket" and plan.overlap != "none":
        raise ValueError(f"--grad-sync {grad_sync} is for plans without overlap; this plan's overlap is "
                         f"'{plan.overlap}', which sets how gradients are all-reduced")
    device = torch.device(device)
    program = build_rank_program(plan, rank, probes=probes)
    module = build_module(plan, seed)
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
    st = RankState(program, params, full, make_optimizer(params, optimizer, lr), device, grad_sync, buffers=buffers,
                   seed=seed, precision=precision_of(plan), bucket_dtype=bucket_dtype(plan))
    st.scaler = RankScaler(device) if st.precision == "fp16" else None
    st.zero = apply_states(plan, st, lambda tensors: make_optimizer(tensors, optimizer, lr))
    if plan.overlap != "none":  # every rank creates the same groups in the same order
        st.halves = setup_halves(plan, rank, module, device, probes=probes) if plan.overlap == "duplex" else []
        group = dist.new_group(list(range(plan.world_size)))
        st.buckets = GradBuckets.of(plan, program, params, group, hooks=plan.overlap == "ddp")
    return st


def _grad_all_reduce_hook(name: str):
    # every rank runs the same program, so autograd reaches the parameters in the same order
    def hook(p: torch.Tensor) -> None:
        run_collective("all_reduce", name, dist.all_reduce, p.grad)
    return hook


def train_step(plan: Plan, st: RankState, rank: int, batch: tuple[torch.Tensor, ...],
               pacer: Pacer | None = None, *, step: int = 0) -> float:
    """One synchronous step (number `step`, which keys its dropout masks); returns the global loss.

    Forward, backward (each device backpropagates its addend of a Partial loss; a Full loss is
    scaled by 1/m), the all-reduce of the gradients of Full parameters (their local gradients
    are addends, DESIGN: semantics) carrying the loss addend along, then the optimizer step.
    Overlap `ddp` launches the gradient buckets during backward; `duplex` runs forward and
    backward as two half-batch streams (runner.duplex) and the buckets after both.
    """
    start = time.perf_counter()
    pacer = pacer or Pacer()
    pacer.begin_step()
    st.optimizer.zero_grad(set_to_none=True)
    partial = st.program.loss_form == PARTIAL
    if st.halves:
        value = duplex_pass(plan, st, rank, batch, step, pacer, 1.0 if partial else 1.0 / dist.get_world_size())
    else:
        args = program_args(plan, st, rank, batch, step)
        with factory_device(st.device), autocast(st.precision, st.device), \
                (st.zero.saving() if st.zero else contextlib.nullcontext()):
            loss = st.program.module(*args)  # gathered stage-3 weights die with the call
        pacer.set_phase("bwd")
        value = loss.detach().float().reshape(1).clone()
        if st.buckets is not None:
            st.buckets.arm(value if partial else None)
        scaled = loss if partial else loss / dist.get_world_size()
        (st.scaler.scale(scaled) if st.scaler else scaled).backward()
    pacer.set_phase("step")
    sync_gradients(st, value if partial else None)
    if st.zero:
        st.zero.reduce_gradients()
    if st.scaler:
        st.scaler.step(st.optimizer)
    else:
        st.optimizer.step()
    if st.zero:
        st.zero.gather_updated()
    pacer.end_step()
    st.losses.append(float(value))
    st.step_times.append(time.perf_counter() - start)
    return st.losses[-1]


def duplex_pass(plan: Plan, st: RankState, rank: int, batch: tuple[torch.Tensor, ...], step: int, pacer: Pacer,
                scale: float) -> torch.Tensor:
    """Forward and backward of the two half batches (runner.duplex); sets the summed gradients,
    arms the buckets and returns the rank's loss (its addend for a Partial loss)."""
    rng = [RngKey(st.seed, step)] if st.program.uses_rng else []
    args = [half_args(h, st.params, rank, batch, rng) for h in st.halves]
    pacer.set_phase("duplex")
    pacers = [pacer.half(), pacer.half()]
    scale *= st.scaler.factor() if st.scaler else 1.0
    loss, grads = run_halves(st.halves, st.params, args, pacers, scale, lambda: factory_device(st.device),
                             lambda: autocast(st.precision, st.device))
    pacer.absorb("(duplex halves)", pacers)
    for p, g in zip(st.params, grads):
        p.grad = g
    value = loss.float().reshape(1).clone()
    st.buckets.arm(value if st.program.loss_form == PARTIAL else None)
    return value


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


def sync_gradients(st: RankState, loss_addend: torch.Tensor | None) -> None:
    """All-reduce the gradients of Full parameters (and the loss addend): the plan's buckets when it
    overlaps (`runner.overlap`, launched during backward under `ddp`), else one flat collective."""
    if st.buckets is not None:
        st.buckets.finish()
        return
    grads = []
    for p, is_full in zip(st.params, st.full_params):
        if is_full and st.grad_sync == "bucket":
            if p.grad is None:  # unused on this rank: its addend is zero
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    if loss_addend is not None and st.bucket_dtype is None:
        grads.append(loss_addend)
    elif loss_addend is not None:  # the loss keeps its fp32 digits: not in a bf16 bucket
        run_collective("all_reduce", "loss", dist.all_reduce, loss_addend)
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


def reference_run(plan: Plan, steps: int, seed: int, optimizer: str = "sgd", lr: float = 0.05,
                  device: torch.device | str = "cpu"):
    """Single-device training of the same model on the same batches and dropout masks: losses and
    final parameters."""
    module = build_module(plan, seed).to(device)
    opt = make_optimizer(list(module.parameters()), optimizer, lr)
    precision = precision_of(plan)
    scaler = torch.amp.GradScaler(torch.device(device).type) if precision == "fp16" else None
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with SiteKeyedDropout(RngKey(seed, step)), autocast(precision, device):  # the ranks' masks and autocast
            loss = module(*make_batch(plan, step, seed, device))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach() for k, v in module.named_parameters(remove_duplicate=False)}
