"""Duplex (HiDup, the plan's `duplex` overlap): each rank runs two half-batch streams at once.

The global batch of B samples splits into two halves, samples [0, B0) and [B0, B) (B0 = B // 2).
Each half is the plan's program run on a batch of its own size: the model is captured again at
that batch size (same nodes, smaller batch dims) and the same program and ratios give the
half's shard sizes (`engine.spmd.plan.shard_sizes`), so every rank holds its share of each half and
every collective of a half sums or gathers that half only. Dropout masks stay the whole batch's:
a half draws its rows of the whole tensor's global index (`runner.program.BatchWindow`).

The two halves run on two threads of the rank, each with a process group of its own (the same
ranks; a backend orders collectives per group, so half 0's all-gather cannot meet half 1's), and
every collective of a half, forward and backward, goes on its group (`runner.collectives.stream`).
Both forwards finish before either backward: each half's loss divides by the count of its own
kept targets, and the halves are reweighed by count_h / (count_0 + count_1) so that the two
gradients add up to the whole batch's (the loss is a mean cross entropy). Gradients come back
from `torch.autograd.grad` per half and are summed in a fixed order; then the gradient buckets
(after both halves) and the optimizer step.

A training-mode batch norm normalises over the batch: half batches change its statistics, so
such models are refused.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.errors import PlanError
from engine.spmd.halves import batch_of, capture_at, half_plan
from engine.spmd.overlap import duplex_run_problem
from engine.spmd.plan import Plan

from .collectives import stream
from .program import BatchWindow, RankProgram, build_rank_program, shard
from .timing import Pacer


def check_duplex(plan: Plan) -> None:
    """Refuse, with a one-line reason, a plan whose model cannot train in two half batches (the
    engine's reasons, which the planner also heeds) or whose program uses hierarchical
    collectives (their machine sub-groups are shared, not one per half-batch stream)."""
    problem = duplex_run_problem(plan.graph)
    if problem:
        raise PlanError(problem.replace("duplex is refused", "duplex refused", 1))
    hier = next((ins for ins in plan.program if ins.rule.endswith(".hier")), None)
    if hier is not None:
        raise PlanError(f"duplex refused: the program runs the hierarchical collective '{hier.rule}' on "
                        f"'{plan.graph[hier.node].name}', whose sub-groups both half-batch streams would share; "
                        "plan with --overlap ddp")


@dataclass
class HalfStream:
    """One half of the batch on one rank: its program, its process group and its inputs' place."""

    plan: Plan
    program: RankProgram
    group: object
    rows: dict[int, tuple[int, int, int]]
    """Input index -> (batch dim, first row, row count) of this half in the global batch tensor."""
    buffers: dict[int, torch.Tensor]


def setup_halves(plan: Plan, rank: int, module: torch.nn.Module, device: torch.device, *,
                 probes: bool = False) -> list[HalfStream]:
    """Both halves of this rank (every rank must call it: it creates two process groups)."""
    check_duplex(plan)
    total = batch_of(plan.graph)
    graphs = [capture_at(plan.graph, b) for b in (total // 2, total - total // 2)]
    named_buffers = dict(module.named_buffers(remove_duplicate=False))
    out = []
    for h, graph in enumerate(graphs):
        hp = half_plan(plan, graph)
        window = BatchWindow(plan.graph, graphs[0] if h else None)
        program = build_rank_program(hp, rank, probes=probes, window=window)
        rows = {}
        for node in plan.graph.placeholders:
            whole, part = plan.graph[node.id].shape, graph[node.id].shape
            dims = [d for d, (w, p) in enumerate(zip(whole, part)) if w != p]
            if len(dims) != 1:
                raise PlanError(f"duplex refused: input '{node.name}' has no single batch dim ({whole} vs {part})")
            d = dims[0]
            rows[node.attrs["index"]] = (d, graphs[0][node.id].shape[d] if h else 0, part[d])
        buffers = {node: shard(hp, node, form, rank, named_buffers[graph[node].attrs["target"]]).to(device)
                   for node, form in program.leaves if graph[node].op == "buffer"}
        out.append(HalfStream(hp, program, dist.new_group(list(range(plan.world_size))), rows, buffers))
    return out


def run_halves(halves: list[HalfStream], params: list[torch.nn.Parameter], args: list[list], pacers: list[Pacer],
               scale: float, factory, forward_context=contextlib.nullcontext) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Forward and backward of both halves on two threads; the rank's loss (its addend for a
    Partial loss) and the summed gradient of every parameter (None where neither half reaches it).
    `scale` multiplies the loss that is backpropagated (1/m for a Full loss, times fp16's loss scale);
    `forward_context` wraps each half's forward (autocast in mixed precision)."""
    counts: list[torch.Tensor | None] = [None, None]
    results: list = [None, None]
    errors: list[BaseException] = []
    both_forward = threading.Barrier(2)
    intra_op = torch.get_num_threads()

    def stream_of(h: int) -> None:
        pacer = pacers[h]
        try:
            torch.set_num_threads(intra_op)  # OpenMP's thread count is per thread: a new one gets the default
            with stream(halves[h].group, pacer), factory():
                pacer.begin_step()
                pacer.hold_device()
                with forward_context():  # autocast in mixed precision (runner.precision), forward only
                    loss, count = halves[h].program.module(*args[h])
                counts[h] = count.detach()
                pacer.pause_device()  # the partner's forward may be waiting for the device
                both_forward.wait()
                pacer.set_phase("bwd")
                pacer.hold_device()
                weight = counts[h] / (counts[0] + counts[1])
                grads = torch.autograd.grad(loss * (weight * scale), params, allow_unused=True)
                results[h] = ((loss * weight).detach(), grads)
                pacer.end_step()
                pacer.release_device()
        except BaseException as e:  # re-raised on the rank's thread; the partner stops at the barrier
            errors.append(e)
            both_forward.abort()
            pacer.release_device()

    threads = [threading.Thread(target=stream_of, args=(h,), name=f"duplex-half{h}") for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    loss = results[0][0] + results[1][0]
    grads = [g0 if g1 is None else g1 if g0 is None else g0 + g1 for g0, g1 in zip(results[0][1], results[1][1])]
    return loss, grads
