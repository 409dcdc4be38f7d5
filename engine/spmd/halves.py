"""Duplex halves (HiDup): the plan's model captured at each half's batch, and the plan's program
and ratios on it. Shared by the planner (which keeps a duplex plan only when its halves exist)
and the runner (which runs them, runner/duplex.py)."""
from __future__ import annotations

import json

from engine.errors import ModelError, PlanError
from engine.model.graph import Graph
from engine.spmd.plan import Plan
from engine.spmd.program import LOAD
from engine.spmd.sizes import ShardKey, shard_classes, shard_key, shard_sizes


def batch_of(graph: Graph) -> int:
    origin = graph.origin
    return int(origin["config"].get("batch", 0) if "zoo" in origin else origin["inputs"].get("batch", 0))


CAPTURES_KEPT = 8
"""Captures at other batch sizes kept per process: the duplex search space, the planner's check of
the chosen plan and the runner's halves each need the same one (seconds each for a Hugging Face model)."""
_captured: dict[tuple[str, int], Graph] = {}


def capture_at(graph: Graph, batch: int) -> Graph:
    """The plan's model captured at another batch size; it must be the same graph but for sizes.
    Kept per (origin, batch) for the process (`CAPTURES_KEPT`): the origin names the model and its config."""
    key = (json.dumps(graph.origin, sort_keys=True, default=str), batch)
    if key not in _captured:
        if len(_captured) >= CAPTURES_KEPT:
            del _captured[next(iter(_captured))]
        _captured[key] = _capture(graph, batch)
    other = _captured[key]
    same = len(other) == len(graph) and all(
        (a.name, a.op, a.inputs) == (b.name, b.op, b.inputs) for a, b in zip(graph.nodes, other.nodes))
    if not same:
        raise PlanError(f"duplex refused: the model's graph changes with the batch size (captured at {batch}); "
                        "use --overlap ddp")
    return other


def _capture(graph: Graph, batch: int) -> Graph:
    """`graph`'s model (zoo or Hugging Face, by its origin) captured at `batch`."""
    from engine.model.source import load_model

    origin = graph.origin
    try:
        if "zoo" in origin:
            other = load_model(f"zoo:{origin['zoo']}", **{**origin["config"], "batch": batch})
        else:
            from engine.model.source import capture_hf, spec_of

            spec = spec_of(origin)
            other = capture_hf(type(spec)(spec.cls, spec.config, spec.task, {**spec.inputs, "batch": batch}))
    except ModelError as e:
        raise PlanError(f"duplex refused: the model cannot be captured at batch {batch}: {e}") from None
    return other


def half_plan(plan: Plan, graph: Graph) -> Plan:
    """The plan's program and ratios on `graph` (the model at a half's batch size)."""
    seg = plan.segmentation
    keyed = {shard_key(graph, seg, t, d, k): v for (t, d, k), v in half_sizes(plan, graph).items()}
    return Plan(plan.strategy, graph, plan.cluster_name, plan.cluster_fingerprint, plan.device_names, plan.program,
                plan.ratios, keyed, plan.predicted_time_s, plan.stages, plan.memory_bytes, segment_of=plan.segment_of,
                overlap=plan.overlap, recompute=plan.recompute)


def half_sizes(plan: Plan, graph: Graph) -> dict[ShardKey, list[int]]:
    """Every sharded dim's sizes in the half `graph`. A class of linked dims whose sizes do not change
    with the batch keeps the plan's sizes (the plan rounds the LP's ratios, which its stored, realised
    ratios need not round to again); one that changes is the plan's ratios rounded on the half's
    dims, and must hold no parameter: the halves share the weights, so their shards cannot differ."""
    seg = plan.segmentation
    rounded = shard_sizes(plan.program, graph, plan.ratio_rows, seg)
    params = {ins.node for ins in plan.program if ins.kind == LOAD and graph[ins.node].op == "parameter"}
    out: dict[ShardKey, list[int]] = {}
    for members in shard_classes(plan.program, graph, seg):
        if all(graph[t].shape[d] == plan.graph[t].shape[d] for t, d, _ in members):
            out.update({(t, d, k): plan.shard_sizes[shard_key(plan.graph, seg, t, d, k)] for t, d, k in members})
            continue
        param = next((t for t, _, _ in members if t in params), None)
        if param is not None:
            raise PlanError(f"duplex refused: the shard of '{graph[param].name}' is linked to the batch, so half "
                            "batches would change it; use --overlap ddp")
        out.update({m: rounded[m] for m in members})
    return out


def halves_problem(plan: Plan) -> str | None:
    """Why the runner could not split `plan` into two half-batch programs (None when it can): the
    model cannot be captured at half the batch, its graph changes with the batch, or a parameter's
    shard is linked to the batch (its size would change with the half)."""
    total = batch_of(plan.graph)
    try:
        for b in (total // 2, total - total // 2):
            half_plan(plan, capture_at(plan.graph, b))
    except PlanError as e:
        return str(e)
    return None
