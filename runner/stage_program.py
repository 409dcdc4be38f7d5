"""A pipeline stage that runs HAP's plan of it (`PipelineStage.plan`, engine/pipeline/stage_plan.py) on its group.

Each microbatch is one SPMD step of the stage's own program over the stage's ranks: the stage plan's
graph is the stage at one microbatch's size, its devices are the stage's, and its collectives go on
the stage's process group (`runner.collectives.stream`), so two stages never share a collective. The
tensors received from the previous stage are the program's `cut` placeholders, loaded in their
boundary form; the program ends where the stage sends its tensors on (the `stage_output` node is not
run: its operands are returned), or in the loss for the last stage.

Parameters are sharded as the stage's program loads them. After the pipeline drains, the gradients
of Full parameters (addends, one per rank) are all-reduced inside the group; a sharded parameter's
gradient is already complete. A microbatch's loss is the mean over its own samples, so the last stage
weighs it by its share of the batch's count (`loss_weights`: kept targets of a cross-entropy with an
ignore index, else 1 / B), which makes the summed gradients those of the whole batch's mean loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.cluster.hierarchy import HIER_KEYS
from engine.errors import PlanError
from engine.model.graph import Graph
from engine.model.ops import run_node
from engine.pipeline.plan import PipelinePlan
from engine.spmd.plan import Plan
from engine.spmd.program import COMM, COMPUTE
from engine.theory.core import FULL

from . import collectives as C
from .program import NO_SITES_IN_PIPELINES, ProgramPiece, RankProgram, build_rank_program, shard, sizes_of


def has_stage_plans(plan: PipelinePlan) -> bool:
    """Whether the stages run their HAP plans (else data parallelism over virtual ranks, runner.pipeline)."""
    return all(s.plan is not None for s in plan.stages)


def tied_weight_error(name: str, stages: str) -> PlanError:
    """The refusal of a parameter used by several stages (a tied weight): each would train its own copy."""
    return PlanError(f"pipeline: parameter {name} is used by stages {stages} (a tied weight); the runner does not "
                     "sum a tied weight's gradients across stages yet: cut elsewhere")


def check_untied(plans: list[Plan]) -> None:
    """`tied_weight_error` when two stages' plans load the same parameter."""
    seen: dict[str, int] = {}
    for i, sp in enumerate(plans):
        for n in sp.graph.parameters:
            target = n.attrs["target"]
            if seen.setdefault(target, i) != i:
                raise tied_weight_error(target, f"{seen[target]} and {i}")


def model_nodes(sp: Plan) -> list[int]:
    """The model graph's node of every node of a stage plan's graph (-1 for its `stage_output`)."""
    return list(sp.graph.origin["pipeline_stage"]["model_nodes"])


def stage_inputs(sp: Plan) -> tuple[tuple[int, int], ...]:
    """The (model tensor, form)s the stage receives: its `cut` placeholders."""
    return tuple((int(n.attrs["cut"]), int(n.attrs["form"])) for n in sp.graph.nodes if "cut" in n.attrs)


def stage_outputs(sp: Plan) -> tuple[tuple[int, int], ...]:
    """The (model tensor, form)s the stage sends on (none for the last stage), in the program's output order."""
    sink = sp.graph[sp.graph.loss]
    if sink.op != "stage_output":
        return ()
    nodes = model_nodes(sp)
    return tuple((nodes[t], int(f)) for t, f in zip(sink.inputs, sink.attrs["forms"]))


def stage_rank_program(sp: Plan, index: int) -> RankProgram:
    """Rank `index` of the stage's program: every instruction but the `stage_output`, returning its operands."""
    if any(ins.kind == COMM and ins.rule in HIER_KEYS for ins in sp.program):
        raise PlanError("pipeline: a stage plan with hierarchical collectives cannot run inside a stage's process "
                        "group; plan it again (stages are planned without them)")
    sink = sp.graph[sp.graph.loss]
    if sink.op != "stage_output":
        return build_rank_program(sp, index)
    keep = frozenset(k for k, ins in enumerate(sp.program) if not (ins.kind == COMPUTE and ins.node == sink.id))
    outputs = tuple(zip(sink.inputs, (int(f) for f in sink.attrs["forms"])))
    return build_rank_program(sp, index, piece=ProgramPiece(keep, (), outputs))


def boundary_rows(sp: Plan, tensor: int, form: int) -> list[tuple[int, int]]:
    """Each stage rank's [first, end) rows of a boundary tensor (model id) along `form` in one microbatch."""
    sub = model_nodes(sp).index(tensor)
    start, out = 0, []
    for size in sizes_of(sp, sub, form):
        out.append((start, start + size))
        start += size
    return out


@dataclass
class StageParams:
    """A stage rank's parameters as its program loads them, and which are Full (their gradients are addends)."""

    params: list[torch.nn.Parameter]
    full: list[bool]
    buffers: dict[int, torch.Tensor]
    bucket: C.FlatBuffer = field(default_factory=C.FlatBuffer)
    """Where the stage's gradient bucket is built, kept across steps."""


def stage_params(sp: Plan, program: RankProgram, index: int, module: torch.nn.Module,
                 device: torch.device | str = "cpu") -> StageParams:
    """This rank's slices of the stage's parameters and buffers, from the seeded single-device model, on `device`."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named_buffers = dict(module.named_buffers(remove_duplicate=False))
    graph = sp.graph
    params = [torch.nn.Parameter(shard(sp, n, f, index, named[graph[n].attrs["target"]].detach()).clone().to(device))
              for n, f in program.params]
    buffers = {n: shard(sp, n, f, index, named_buffers[graph[n].attrs["target"]].detach()).clone().to(device)
               for n, f in program.leaves if graph[n].op == "buffer"}
    return StageParams(params, [f == FULL for _, f in program.params], buffers)


def microbatch_leaves(sp: Plan, program: RankProgram, index: int, held: StageParams, m: int, microbatches: int,
                      batch: tuple[torch.Tensor, ...], cut: dict[tuple[int, int], torch.Tensor]) -> list:
    """The program's arguments for microbatch m: parameters, buffers, received tensors and this rank's
    part of the microbatch's inputs, in the program's order."""
    if program.uses_rng:
        raise PlanError(NO_SITES_IN_PIPELINES)
    params = iter(held.params)
    out = []
    for n, f in program.leaves:
        node = sp.graph[n]
        if program.is_param[n]:
            out.append(next(params))
        elif n in held.buffers:
            out.append(held.buffers[n])
        elif "cut" in node.attrs:
            out.append(cut[(int(node.attrs["cut"]), f)])
        else:
            out.append(shard(sp, n, f, index, batch[node.attrs["index"]].chunk(microbatches, 0)[m]))
    return out


def loss_weights(sp: Plan, batch: tuple[torch.Tensor, ...], microbatches: int) -> list[float]:
    """Each microbatch's share of the batch's mean loss: its count of kept targets over the batch's,
    for a cross-entropy whose count is an operand (computed here on each microbatch's inputs), else
    1 / B (a mean over a fixed count, the same for every microbatch)."""
    graph = sp.graph
    loss = graph[graph.loss]
    if loss.op != "cross_entropy" or len(loss.inputs) < 3:
        return [1.0 / microbatches] * microbatches
    counts = [float(_evaluate(graph, loss.inputs[2], batch, m, microbatches)) for m in range(microbatches)]
    total = sum(counts)
    return [c / total if total else 1.0 / microbatches for c in counts]


def _evaluate(graph: Graph, node: int, batch: tuple[torch.Tensor, ...], m: int, microbatches: int) -> torch.Tensor:
    """Node `node` of a stage plan's graph computed whole on microbatch m's inputs (inputs and constants only)."""
    values: dict[int, torch.Tensor] = {}

    def value(i: int) -> torch.Tensor:
        if i not in values:
            n = graph[i]
            if n.op == "placeholder" and "index" in n.attrs:
                values[i] = batch[n.attrs["index"]].chunk(microbatches, 0)[m]
            elif n.is_leaf:
                raise PlanError(f"pipeline: the loss's count depends on {n.op} '{n.name}', not only on the inputs")
            else:
                values[i] = run_node(n, graph, [value(j) for j in n.inputs], n.shape)
        return values[i]

    return value(node)


def sync_stage_gradients(held: StageParams, group) -> None:
    """All-reduce the Full parameters' gradient addends inside the stage's group (after the drain)."""
    grads = []
    for p, full in zip(held.params, held.full):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if full:
            grads.append(p.grad)
    with C.stream(group):
        C.all_reduce_coalesced(grads, buffer=held.bucket)


def gathered_stage_params(sp: Plan, program: RankProgram, held: StageParams, group) -> dict[str, torch.Tensor]:
    """The stage's parameters reassembled to their full shapes (every rank of the stage takes part)."""
    out = {}
    with C.stream(group):
        for (n, f), p in zip(program.params, held.params):
            t = p.detach()
            if f >= 0:
                t = C.gather_padded(t.contiguous(), f, sizes_of(sp, n, f))
            out[sp.graph[n].attrs["target"]] = t
    return out
