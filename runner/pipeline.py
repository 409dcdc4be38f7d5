"""Run a pipeline plan (`engine.pipeline.plan.PipelinePlan`): stages on device groups, microbatches in the planned order.

Every rank builds the single-device model from the seed and keeps the parameters of its stage.

With stage plans (`PipelineStage.plan`, HAP inside every stage; the planner's default where the
model can be captured at a microbatch's size), each microbatch is one SPMD step of the stage's own
program on the stage's process group: `runner.stage_program` says how.

Without them (a model file or graph JSON, whose batch is fixed), a stage runs the piece of the
graph's data-parallel program (`data_parallel_program`)
between its cuts (`runner.program.ProgramPiece`). Data parallelism inside a stage is expressed with
*virtual ranks*: the stage's plan splits the batch over B x g virtual ranks, microbatch m's rows
going to virtual ranks m g .. m g + g - 1 in the stage's ratios, so stage rank r runs microbatch m
as virtual rank m g + r, with shapes localised by the plan's integer sizes. The program's mean
losses divide by the whole batch's count, so each microbatch's loss addend is already scaled and
the summed gradients equal the full batch's; after the pipeline drains each stage all-reduces its
gradients inside its own process group and steps its optimizer.

Between stages the cut tensors go by `isend`/`irecv`, tagged by microbatch and direction: a tensor
split over the batch is re-sliced so each receiver gets exactly the rows it needs from each sender
(`overlaps` of the two stages' rows: over virtual ranks, or the two stage plans' shard sizes of one
microbatch); a replicated one comes whole from one sender, and its gradient addend goes back to
that sender. `link_s` emulates slow links: each transfer also carries its send time, and the
receiver waits until send time (or the link's previous arrival) plus the boundary's transfer time.

A launch bundle of a pipeline plan (`hap export`) runs here too: each rank checks it against its
manifest and joins as the rank its bundle node gives it (`pipeline_inputs`; runner.launch hands pipeline
plans to runner.pipeline_run).

Devices: NCCL on each rank's GPU when CUDA is present (`runner.rank_setup.pick_device`), gloo on the CPU
otherwise; tensors the ranks send and receive, and those the programs create, live on that device.

The library API (`runner.parallelize(pipeline_plan)`, runner.pipeline_api) and `hap run`'s rank entry
(runner.pipeline_run) are built on `setup_stage_rank` and `schedule_pass`; `pipeline_step` is one plain
step of both with the stage's own optimiser.

Limits (issue 15): the NCCL path has not run on a GPU yet; no dropout; a weight used by two stages
(tied embeddings) is refused, not summed; no hierarchical collectives inside a stage; no checkpoints,
timing (`hap run` options a pipeline does not take are refused, PIPELINE_OPTIONS).

Emulated speeds (`hap run --speeds`, runner.timing): the rank's pacer, installed as the collectives'
observer, stretches the computation between two of its sends, receives or collectives by 1/speed before
the next one starts, as for SPMD plans.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from engine.errors import PlanError
from engine.pipeline.plan import PipelinePlan
from engine.pipeline.schedule import stage_order
from engine.pipeline.stage_plan import data_parallel_program
from engine.spmd.plan import Plan
from engine.spmd.program import LOAD, Instruction
from engine.spmd.segments import Segmentation
from engine.spmd.sizes import shard_key, shard_units, split_sizes
from engine.theory.core import FULL, PARTIAL
from runner import collectives as C
from runner.config import DistEnv
from runner.program import NO_SITES_IN_PIPELINES, ProgramPiece, RankProgram, build_rank_program, shard
from runner.rank_setup import bundle_rank, open_source
from runner.timing import parse_speeds
from runner.stage_program import (StageParams, boundary_rows, check_untied, gathered_stage_params, has_stage_plans,
                                  loss_weights, microbatch_leaves, stage_inputs, stage_outputs, stage_params,
                                  stage_rank_program, sync_stage_gradients, tied_weight_error)
from runner.precision import autocast, precision_of, wire_dtype
from runner.batches import Batches
from runner import optim as O
from runner.optim import OptimConfig
from runner.train import factory_device, initial_module, make_batch, make_optimizer


def stage_plan(plan: PipelinePlan, program: tuple[Instruction, ...], stage: int) -> Plan:
    """The plan a stage's ranks run: `program` over B x g virtual ranks (see the module docstring)."""
    graph, B = plan.graph, plan.microbatches
    ratios = plan.stages[stage].ratios or tuple(1 / len(plan.stages[stage].devices) for _ in plan.stages[stage].devices)
    seg = Segmentation.single(graph)
    sizes = {}
    for (t, d, k), units in shard_units(program, graph, seg).items():
        if units % B:
            raise PlanError(f"pipeline: {B} microbatches do not split {graph[t].name} dim {d} ({units} units) evenly; "
                            "choose a microbatch count that divides the batch")
        step = graph[t].shape[d] // units
        sizes[shard_key(graph, seg, t, d, k)] = [x * step for _ in range(B) for x in split_sizes(units // B, list(ratios))]
    W = B * len(ratios)
    return Plan("pipeline-stage", graph, plan.cluster_name, plan.cluster_fingerprint, [f"v{v}" for v in range(W)],
                program, {"0": [r / B for _ in range(B) for r in ratios]}, sizes, 0.0, [], [0.0] * W)


def program_pieces(plan: PipelinePlan, program: tuple[Instruction, ...]) -> list[ProgramPiece]:
    """Each stage's instructions, the (tensor, form)s it receives and those it sends on."""
    graph, S = plan.graph, len(plan.stages)
    stage_of = {}
    for i, s in enumerate(plan.stages):
        for n in graph.nodes:
            if not n.is_leaf and s.nodes[0] <= n.id <= s.nodes[1]:
                stage_of[n.id] = i
    produced: dict[tuple[int, int], int] = {}
    used: dict[tuple[int, int], set[int]] = {}
    own: list[set[int]] = [set() for _ in range(S)]
    for k, ins in enumerate(program):
        if graph[ins.node].is_leaf:
            continue
        i = stage_of[ins.node]
        own[i].add(k)
        produced[(ins.node, ins.post)] = i
        for pair in ins.pre:
            used.setdefault(pair, set()).add(i)
    for k in reversed(range(len(program))):  # loads (and slices of loaded leaves) go where they are used
        ins = program[k]
        if not graph[ins.node].is_leaf:
            continue
        stages = used.get((ins.node, ins.post), set())
        if ins.kind == LOAD and graph[ins.node].op == "parameter" and len(stages) > 1:
            raise tied_weight_error(graph[ins.node].name, str(sorted(stages)))
        for i in stages:
            own[i].add(k)
        for pair in ins.pre:
            used.setdefault(pair, set()).update(stages)
    after = [tuple(sorted(p for p, i in produced.items() if i <= b and any(j > b for j in used.get(p, ()))))
             for b in range(S - 1)]
    return [ProgramPiece(frozenset(own[i]), after[i - 1] if i else (), after[i] if i < S - 1 else ())
            for i in range(S)]


def row_pieces(send: list[int], recv: list[int], m: int, g_send: int, g_recv: int) -> list[tuple[int, int, int, int]]:
    """(sender, receiver, first row, end row) in the global tensor for microbatch m: the overlaps of
    the senders' and receivers' row ranges (the sizes are over virtual ranks m g + r)."""
    return overlaps(virtual_rows(send, m, g_send), virtual_rows(recv, m, g_recv))


def virtual_rows(sizes: list[int], m: int, g: int) -> list[tuple[int, int]]:
    """[first, end) rows of each of a stage's g ranks in microbatch m, from sizes over virtual ranks m g + r."""
    start, out = sum(sizes[:m * g]), []
    for r in range(g):
        out.append((start, start + sizes[m * g + r]))
        start += sizes[m * g + r]
    return out


def overlaps(send: list[tuple[int, int]], recv: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """(sender, receiver, first row, end row) wherever a sender's rows meet a receiver's."""
    pieces = []
    for b, (lo_b, hi_b) in enumerate(recv):
        for a, (lo_a, hi_a) in enumerate(send):
            lo, hi = max(lo_a, lo_b), min(hi_a, hi_b)
            if lo < hi:
                pieces.append((a, b, lo, hi))
    return pieces


@dataclass
class Route:
    """How one cut (tensor, form) goes from stage s's ranks to stage s+1's for one microbatch."""

    pair: tuple[int, int]
    pieces: list[tuple[int, int, int, int]]
    """(sender, receiver, global first row, end row); rows -1 for a whole (replicated) tensor."""
    send_starts: list[int]
    """Each sender's first global row (to narrow its local tensor)."""
    recv_starts: list[int]


@dataclass
class StageRank:
    """What one rank holds: its stage, its program per microbatch, parameters and optimizer."""

    stage: int
    index: int
    """This rank's position in its stage's group."""
    plans: list[Plan]
    pieces: list[ProgramPiece]
    programs: list[RankProgram]
    """One per microbatch (virtual rank m g + index)."""
    params: list[torch.nn.Parameter]
    buffers: dict[int, torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    """None on an idle rank (`IDLE`), which holds no parameters."""
    groups: list[Any]
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    held: StageParams | None = None
    """With stage plans (runner.stage_program): the parameters as the stage's program loads them;
    `plans` are then the stages' own plans and every microbatch runs the same program."""
    device: torch.device = torch.device("cpu")
    """Where this rank's parameters, batches and messages live (its GPU under NCCL)."""
    grad_sync: str = "bucket"
    """A stage synchronises its gradients in one bucket after the drain (runner.loop reads it: no_sync applies)."""

    @property
    def hap(self) -> bool:
        return self.held is not None


IDLE = -1
"""The stage (and index) of a rank the partition left without a stage."""

Init = Mapping[str, torch.Tensor] | str | Path | None
"""Whole weights a run starts from: a state dict, a safetensors file or a save_pretrained directory."""


def setup_stage_rank(plan: PipelinePlan, rank: int, seed: int, optimizer: str = "sgd", lr: float = 0.05,
                     device: torch.device | str = "cpu", init: Init = None) -> StageRank:
    """Every rank calls this (process groups are made collectively): its stage's programs and parameters,
    from the seeded single-device model or from `init` (whole weights, runner.train.initial_module)."""
    device = torch.device(device)
    if has_stage_plans(plan):
        return setup_planned_stage_rank(plan, rank, seed, optimizer, lr, device, init)
    program = data_parallel_program(plan.graph)
    plans = [stage_plan(plan, program, i) for i in range(len(plan.stages))]
    pieces = program_pieces(plan, program)
    groups = [dist.new_group(list(s.devices)) for s in plan.stages]
    stage = next((i for i, s in enumerate(plan.stages) if rank in s.devices), None)
    if stage is None:  # a device the partition left idle: it only joins the step's loss sum and the final gather
        return StageRank(IDLE, IDLE, plans, pieces, [], [], {}, None, groups, device=device)
    index = plan.stages[stage].devices.index(rank)
    g = len(plan.stages[stage].devices)
    programs = [build_rank_program(plans[stage], m * g + index, piece=pieces[stage]) for m in range(plan.microbatches)]
    module = initial_module(plans[stage], seed, init)
    named = dict(module.named_parameters(remove_duplicate=False))
    named_buffers = dict(module.named_buffers(remove_duplicate=False))
    graph, first = plan.graph, programs[0]
    params = [torch.nn.Parameter(named[graph[n].attrs["target"]].detach().clone().to(device)) for n, _ in first.params]
    buffers = {n: named_buffers[graph[n].attrs["target"]].detach().clone().to(device) for n, f in first.leaves
               if graph[n].op == "buffer"}
    return StageRank(stage, index, plans, pieces, programs, params, buffers, make_optimizer(params, optimizer, lr),
                     groups, device=device)


def setup_planned_stage_rank(plan: PipelinePlan, rank: int, seed: int, optimizer: str, lr: float,
                             device: torch.device, init: Init = None) -> StageRank:
    """`setup_stage_rank` for stages with their own HAP plans (runner.stage_program)."""
    plans = [s.plan for s in plan.stages]
    check_untied(plans)  # type: ignore[arg-type]
    pieces = [ProgramPiece(frozenset(), stage_inputs(sp), stage_outputs(sp)) for sp in plans]
    groups = [dist.new_group(list(s.devices)) for s in plan.stages]
    stage = next((i for i, s in enumerate(plan.stages) if rank in s.devices), None)
    if stage is None:
        return StageRank(IDLE, IDLE, plans, pieces, [], [], {}, None, groups, device=device)
    index = plan.stages[stage].devices.index(rank)
    program = stage_rank_program(plans[stage], index)
    held = stage_params(plans[stage], program, index, initial_module(plan, seed, init), device)  # type: ignore[arg-type]
    return StageRank(stage, index, plans, pieces, [program] * plan.microbatches, held.params, held.buffers,
                     make_optimizer(held.params, optimizer, lr), groups, held=held, device=device)


def boundary_ranges(plan: PipelinePlan, sr: StageRank, stage: int, pair: tuple[int, int], m: int) -> list[tuple[int, int]]:
    """Each rank of `stage`: its [first, end) rows of boundary tensor `pair` in microbatch m's rows of the
    whole batch (data-parallel stages, virtual ranks) or in the microbatch itself (stage plans)."""
    t, f = pair
    if sr.hap:
        return boundary_rows(sr.plans[stage], t, f)
    return virtual_rows(sr.plans[stage].sizes(t, f), m, len(plan.stages[stage].devices))


def routes(plan: PipelinePlan, sr: StageRank, boundary: int, m: int) -> list[Route]:
    """The routes of every cut tensor between stages `boundary` and `boundary` + 1 for microbatch m."""
    gs, gr = len(plan.stages[boundary].devices), len(plan.stages[boundary + 1].devices)
    out = []
    for t, f in sr.pieces[boundary].outputs:
        if f == PARTIAL:
            raise PlanError(f"pipeline: {plan.graph[t].name} crosses a cut as a Partial sum; cut elsewhere")
        if f == FULL:
            out.append(Route((t, f), [(b % gs, b, -1, -1) for b in range(gr)], [0] * gs, [0] * gr))
            continue
        send, recv = boundary_ranges(plan, sr, boundary, (t, f), m), boundary_ranges(plan, sr, boundary + 1, (t, f), m)
        out.append(Route((t, f), overlaps(send, recv), [lo for lo, _ in send], [lo for lo, _ in recv]))
    return out


def _tag(m: int, direction: int, k: int) -> int:
    return (m * 2 + direction) * 4096 + k


class Links:
    """Sends and receives of one step, with emulated link times (`link_s[boundary]`, 0: none)."""

    def __init__(self, plan: PipelinePlan, sr: StageRank, link_s: Sequence[float] | None) -> None:
        self.plan, self.sr = plan, sr
        self.link_s = list(link_s) if link_s else [0.0] * (len(plan.stages) - 1)
        self.pending: list[Any] = []
        self.free_at: dict[tuple[int, int], float] = {}

    def send(self, boundary: int, m: int, direction: int, tensors: dict[tuple[int, int], torch.Tensor]) -> None:
        """Forward (direction 0): this stage's outputs to stage boundary+1; backward (1): input grads to stage
        boundary. A slowed rank (`hap run --speeds`) sends once its computation has lasted its emulated time."""
        with C.observed("send", f"boundary {boundary}"):
            self._send(boundary, m, direction, tensors)

    def _send(self, boundary: int, m: int, direction: int, tensors: dict[tuple[int, int], torch.Tensor]) -> None:
        plan, me = self.plan, self.sr.index
        dst_stage = boundary + 1 if direction == 0 else boundary
        peers = set()
        for k, route in enumerate(routes(plan, self.sr, boundary, m)):
            x = tensors[route.pair]
            for a, b, lo, hi in route.pieces:
                mine, peer = (a, b) if direction == 0 else (b, a)
                if mine != me:
                    continue
                piece = x.to(wire_dtype(plan, route.pair[0]))  # what the receiver allocates (runner.precision)
                if lo >= 0:
                    start = route.send_starts[a] if direction == 0 else route.recv_starts[b]
                    piece = piece.narrow(route.pair[1], lo - start, hi - lo)
                dst = plan.stages[dst_stage].devices[peer]
                self.pending.append(dist.isend(piece.detach().contiguous(), dst, tag=_tag(m, direction, k)))
                peers.add(dst)
        stamp = torch.tensor([time.time()], dtype=torch.float64, device=self.sr.device)
        for dst in sorted(peers):
            self.pending.append(dist.isend(stamp, dst, tag=_tag(m, direction, 4095)))

    def recv(self, boundary: int, m: int, direction: int) -> dict[tuple[int, int], torch.Tensor]:
        """The whole local tensors this rank needs (forward: cut inputs; backward: output grads)."""
        plan, me, graph = self.plan, self.sr.index, self.plan.graph
        src_stage = boundary if direction == 0 else boundary + 1
        out: dict[tuple[int, int], torch.Tensor] = {}
        waits: list[tuple[Any, torch.Tensor]] = []
        peers = set()
        assembled: dict[tuple[int, int], list[torch.Tensor]] = {}
        for k, route in enumerate(routes(plan, self.sr, boundary, m)):
            t, f = route.pair
            dtype = wire_dtype(plan, t)
            for a, b, lo, hi in route.pieces:
                mine, peer = (b, a) if direction == 0 else (a, b)
                if mine != me:
                    continue
                shape = list(graph[t].shape)
                if lo >= 0:
                    shape[f] = hi - lo
                buf = torch.empty(shape, dtype=dtype, device=self.sr.device)
                src = plan.stages[src_stage].devices[peer]
                waits.append((dist.irecv(buf, src, tag=_tag(m, direction, k)), buf))
                assembled.setdefault(route.pair, []).append(buf)
                peers.add(src)
        stamps = []
        for src in sorted(peers):
            s = torch.empty(1, dtype=torch.float64, device=self.sr.device)
            waits.append((dist.irecv(s, src, tag=_tag(m, direction, 4095)), s))
            stamps.append(s)
        with C.observed("recv", f"boundary {boundary}"):
            for w, _ in waits:
                w.wait()
            self._emulate(boundary, direction, max((float(s) for s in stamps), default=time.time()))
        for pair, parts in assembled.items():
            if pair[1] == FULL and direction == 1:
                out[pair] = torch.stack(parts).sum(0)  # gradient addends of a replicated tensor
            else:
                out[pair] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=pair[1])
        return out

    def _emulate(self, boundary: int, direction: int, sent_at: float) -> None:
        c = self.link_s[boundary]
        if c <= 0:
            return
        arrival = max(sent_at, self.free_at.get((boundary, direction), 0.0)) + c
        self.free_at[(boundary, direction)] = arrival
        delay = arrival - time.time()
        if delay > 0:
            time.sleep(delay)

    def drain(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending.clear()


def microbatch_args(plan: PipelinePlan, sr: StageRank, m: int, batch: tuple[torch.Tensor, ...],
                    cut: dict[tuple[int, int], torch.Tensor]) -> list:
    """Arguments of the stage program for microbatch m: cut inputs, then parameters, buffers and input rows
    (with a stage plan: its leaves in its order, the cut inputs among them)."""
    prog, sp = sr.programs[m], sr.plans[sr.stage]
    if sr.hap:
        return microbatch_leaves(sp, prog, sr.index, sr.held, m, plan.microbatches, batch, cut)  # type: ignore[arg-type]
    v = m * len(plan.stages[sr.stage].devices) + sr.index
    params = iter(sr.params)
    if prog.uses_rng:
        raise PlanError(NO_SITES_IN_PIPELINES)
    leaves = [next(params) if prog.is_param[n] else sr.buffers[n] if n in sr.buffers
              else shard(sp, n, f, v, batch[plan.graph[n].attrs["index"]]) for n, f in prog.leaves]
    return [cut[p] for p in sr.pieces[sr.stage].inputs] + leaves


def pipeline_step(plan: PipelinePlan, sr: StageRank, batch: tuple[torch.Tensor, ...],
                  link_s: Sequence[float] | None = None) -> float:
    """One step in the planned order (this stage's warm-up count); returns the global loss."""
    start = time.perf_counter()
    if sr.stage == IDLE:
        return _idle_step(sr, start)
    sr.optimizer.zero_grad(set_to_none=True)
    loss_sum = schedule_pass(plan, sr, batch, link_s)
    sync_stage(sr, len(plan.stages[sr.stage].devices))
    sr.optimizer.step()
    dist.all_reduce(loss_sum)  # only the last stage's ranks hold addends
    sr.losses.append(float(loss_sum))
    sr.step_times.append(time.perf_counter() - start)
    return sr.losses[-1]


def schedule_pass(plan: PipelinePlan, sr: StageRank, batch: tuple[torch.Tensor, ...],
                  link_s: Sequence[float] | None = None) -> torch.Tensor:
    """Forward and backward of every microbatch in the planned order, gradients summed into the stage's
    parameters (not yet synchronised inside the stage); this rank's addend of the global loss (fp64)."""
    S, B, i = len(plan.stages), plan.microbatches, sr.stage
    links, piece = Links(plan, sr, link_s), sr.pieces[i]
    held: dict[int, tuple[dict, Any]] = {}
    loss_sum = torch.zeros(1, dtype=torch.float64, device=sr.device)
    weights = loss_scales(plan, sr, batch)
    stage_group = sr.groups[i] if sr.hap else None  # a stage plan's collectives go on the stage's group
    for kind, m in stage_order(plan.stages[i].warmup, B):
        if kind == "F":
            cut = links.recv(i - 1, m, 0) if i > 0 else {}
            for x in cut.values():
                if x.is_floating_point():
                    x.requires_grad_(True)
            with C.stream(stage_group), factory_device(sr.device), autocast(precision_of(plan), sr.device):
                out = sr.programs[m].module(*microbatch_args(plan, sr, m, batch, cut))
            if i == S - 1:
                loss = out * weights[m]
                loss_sum += float(loss.detach())
                held[m] = (cut, loss)
            else:
                outs = dict(zip(piece.outputs, out))
                links.send(i, m, 0, outs)
                held[m] = (cut, outs)
        else:
            cut, out = held.pop(m)
            if i == S - 1:
                with C.stream(stage_group):
                    out.backward()
            else:
                grads = links.recv(i, m, 1)
                pairs = [p for p in piece.outputs if out[p].requires_grad]
                with C.stream(stage_group):
                    torch.autograd.backward([out[p] for p in pairs],
                                            [grads[p].to(out[p].dtype) if p in grads else torch.zeros_like(out[p])
                                             for p in pairs])
            if i > 0:
                links.send(i - 1, m, 1, {p: (x.grad if x.grad is not None else torch.zeros_like(x))
                                         for p, x in cut.items()})
    links.drain()
    return loss_sum


def loss_scales(plan: PipelinePlan, sr: StageRank, batch: tuple[torch.Tensor, ...]) -> list[float]:
    """What the last stage multiplies each microbatch's loss by so their sum is the batch's loss on every
    rank summed: data-parallel stages already divide by the whole batch's count (a Full loss by the
    B x g virtual ranks holding it); a stage plan's loss is its microbatch's mean, weighed by its share
    of the batch (`loss_weights`), a Full one split over the g ranks holding it."""
    B, g = plan.microbatches, len(plan.stages[sr.stage].devices)
    full = sr.programs[0].loss_form != PARTIAL
    if not sr.hap:
        return [1.0 / (B * g) if full else 1.0] * B
    if sr.stage != len(plan.stages) - 1:
        return [1.0] * B
    return [w / g if full else w for w in loss_weights(sr.plans[sr.stage], batch, B)]


def sync_stage(sr: StageRank, g: int) -> None:
    """After the drain, every gradient complete on every rank of the stage: a stage plan all-reduces its
    Full parameters' addends; data parallelism inside a stage all-reduces every gradient."""
    if sr.hap:
        sync_stage_gradients(sr.held, sr.groups[sr.stage])  # type: ignore[arg-type]
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in sr.params]
    for p, gr in zip(sr.params, grads):
        p.grad = gr
    if g > 1 and grads:
        flat = torch.cat([x.reshape(-1) for x in grads])
        C.run_collective("all_reduce", "gradients", lambda: dist.all_reduce(flat, group=sr.groups[sr.stage]))
        for x, part in zip(grads, torch.split(flat, [x.numel() for x in grads])):
            x.copy_(part.view_as(x))


def _idle_step(sr: StageRank, start: float) -> float:
    """A step of a rank in no stage (the partition found the model faster without its device):
    it adds nothing to the loss sum every rank takes part in."""
    loss_sum = torch.zeros(1, dtype=torch.float64, device=sr.device)
    dist.all_reduce(loss_sum)
    sr.losses.append(float(loss_sum))
    sr.step_times.append(time.perf_counter() - start)
    return sr.losses[-1]


def held_params(plan: PipelinePlan, sr: StageRank) -> dict[str, torch.Tensor]:
    """This rank's parameters by model name (every rank of a stage holds the same)."""
    return {plan.graph[n].attrs["target"]: p.detach().cpu().clone() for (n, _), p in zip(sr.programs[0].params, sr.params)}


def gathered_params(plan: PipelinePlan, sr: StageRank) -> dict[str, torch.Tensor]:
    """Every parameter of the model, from the first rank of each stage (all ranks take part)."""
    if sr.hap and sr.stage != IDLE:  # shards of the stage's program: reassembled inside the stage first
        whole = gathered_stage_params(sr.plans[sr.stage], sr.programs[0], sr.held, sr.groups[sr.stage])  # type: ignore[arg-type]
        mine = {k: v.cpu() for k, v in whole.items()} if sr.index == 0 else {}
    else:
        mine = held_params(plan, sr) if sr.index == 0 else {}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def microbatch_reference(plan: PipelinePlan, steps: int, seed: int, optimizer: str = "sgd", lr: float = 0.05,
                         device: torch.device | str = "cpu", batches: Batches | None = None, *,
                         optim: OptimConfig | None = None, init: Init = None):
    """Single-device training on `device` that accumulates the plan's microbatches in order (loss / B each),
    with the run's optimiser settings (`optim`: decay on matrices, schedule, clipping, K microsteps a step,
    each loss / K; else `optimizer` at a fixed `lr`), from the seeded model or `init`."""
    optim = optim or OptimConfig(name=optimizer, lr=lr)
    module = initial_module(plan, seed, init).to(device)  # type: ignore[arg-type]  # reads plan.graph.origin only
    params = list(module.parameters())
    opt = O.build(optim, params, [tuple(p.shape) for p in params])
    B, K, losses = plan.microbatches, optim.grad_accum, []
    for step in range(steps):
        O.set_lr(opt, optim.lr_at(step))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(K):
            index = step * K + j
            batch = (tuple(t.to(device) for t in batches(index)) if batches
                     else make_batch(plan, index, seed, device))  # type: ignore[arg-type]
            for m in range(B):
                with autocast(precision_of(plan), device):  # the stages' autocast (runner.precision)
                    loss = module(*(x.chunk(B, 0)[m] for x in batch)) / B
                (loss if K == 1 else loss / K).backward()
                total += float(loss.detach())
        if optim.clip_grad_norm:
            grads = [p.grad for p in params if p.grad is not None]
            O.clip_(grads, O.total_norm(grads), optim.clip_grad_norm)
        opt.step()
        losses.append(total / K)
    return losses, {k: v.detach() for k, v in module.named_parameters(remove_duplicate=False)}


# ----------------------------------------------------------------------------- `hap run` on a pipeline plan


PIPELINE_OPTIONS = ("plan", "steps", "verify", "seed", "optimizer", "lr", "weight_decay", "lr_schedule", "warmup",
                    "min_lr", "clip_grad_norm", "grad_accum", "data", "eval_data", "eval_every", "eval_batches",
                    "init_from", "save_model", "metrics", "save_params", "timeout_s", "emulate_links", "digest",
                    "speeds")
"""The `hap run` options (runner.config.RunConfig fields) a pipeline run uses (runner.pipeline_run); it refuses
the others: checkpoints and resume (so --elastic), timing, --grad-sync, --device-check."""


def option_flag(name: str) -> str:
    """The command-line flag of a RunConfig field."""
    return {"timeout_s": "--timeout"}.get(name, "--" + name.replace("_", "-"))


def check_pipeline_options(cfg: Any, world_size: int | None = None) -> None:
    """PlanError naming the first `hap run` option a pipeline run would ignore (checkpoints, timing, ...); with
    the plan's `world_size`, ValueError for --speeds that do not give each of its ranks a factor in (0, 1]."""
    if world_size is not None and cfg.speeds:
        parse_speeds(cfg.speeds, world_size)
    for f in fields(cfg):
        if f.name not in PIPELINE_OPTIONS and getattr(cfg, f.name) != f.default:
            taken = ", ".join(option_flag(n) for n in PIPELINE_OPTIONS if n != "plan")
            raise PlanError(f"{option_flag(f.name)} is not supported for pipeline plans yet (they take {taken}); "
                            "leave it out")


def load_pipeline_plan(path: str | Path, world_size: int, model_file: str | Path | None = None) -> PipelinePlan:
    """The pipeline plan of a plan file or a bundle's plan.json, refused unless made for `world_size` ranks;
    `model_file` is a bundle's copy of the plan's model file (its origin is pointed at it)."""
    from engine.model import source
    from engine.planner import load_plan

    plan = load_plan(str(path))
    if not isinstance(plan, PipelinePlan):
        raise PlanError("runner.pipeline runs pipeline plans; run a plain plan with `hap run`")
    if plan.world_size != world_size:
        raise PlanError(f"the plan needs {plan.world_size} ranks, torchrun started {world_size}")
    if precision_of(plan) == "fp16":
        raise PlanError("a pipeline plan runs in fp32 or bf16: fp16's loss scaler would have to span the stages; "
                        "plan it with --precision bf16 (or fp32)")
    if model_file is not None:
        origin = source.with_model_file(plan.graph.origin, model_file)  # type: ignore[union-attr]
        plan = replace(plan, graph=replace(plan.graph, origin=origin))  # type: ignore[arg-type]
    source.check_rebuildable(plan.graph.origin)  # type: ignore[union-attr]
    return plan


def pipeline_inputs(cfg: Any) -> tuple[PipelinePlan, Any, str | None]:
    """(plan, this rank's DistEnv, scratch folder of an extracted zip) of a plan file or a bundle, checked
    before any process group starts: the options, the bundle against its manifest, the rank the bundle
    node gives this process (HAP_NODE_RANK), the plan's world size and its model file."""
    from engine.bundle import archive as bundle

    check_pipeline_options(cfg)
    plan_path, opened, scratch = open_source(cfg.plan, "hap-pipeline-", cfg.digest)
    try:
        env = bundle_rank(DistEnv.from_environ(), opened)
        plan = load_pipeline_plan(plan_path, env.world_size, bundle.model_file_of(opened) if opened else None)
        check_pipeline_options(cfg, env.world_size)
    except BaseException:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    return plan, env, scratch
