"""The pipeline plan as JSON (kind "hap.pipeline_plan"), its validation, and a loader for either kind of plan.

A pipeline plan is self-contained like a plain plan (`engine.plan.Plan`): it embeds the graph, the
cluster's name, fingerprint and device names, and per stage its device ranks, node range and
warm-up count; per boundary the tensors that cross it, their bytes and the predicted transfer
time; the schedule, the microbatch count and the predicted timeline. Nothing in it is trusted:
`pipeline_plan_from_dict` refuses a bad field with a `PlanError` naming it (its JSON path) and the
fix, and checks that the stages tile the graph's computed nodes in order and that every boundary
lists exactly the tensors that cross it (the runner sends those and only those).
"""
from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from .errors import ModelError, PlanError
from .graph import Graph
from .plan import Plan
from .partition import Boundary, PipelinePlan, PipelineStage, ScheduleResult, TimelineBox, batch_of
from .schedule import SCHEDULES
from .validate import RATIO_TOLERANCE, _check_cluster_field, _fail, _is_int, _non_negative, _shown, _typed

PIPELINE_PLAN_KIND = "hap.pipeline_plan"
PIPELINE_SCHEMA_VERSION = 1
REGENERATE = "regenerate the plan with `hap plan --parallelism pipeline`"


def pipeline_plan_dict(plan: PipelinePlan) -> dict[str, Any]:
    """The JSON-ready dict of a pipeline plan (one made by `best_pipeline`, which embeds its graph)."""
    if plan.graph is None:
        raise PlanError("pipeline plan has no graph to embed; make it with engine.partition.best_pipeline")
    g = plan.graph
    return {"kind": PIPELINE_PLAN_KIND, "schema_version": PIPELINE_SCHEMA_VERSION,
            "model": {"name": g.name, "fingerprint": g.fingerprint(), "origin": g.origin},
            "cluster": {"name": plan.cluster_name, "fingerprint": plan.cluster_fingerprint,
                        "devices": list(plan.device_names)},
            "schedule": plan.schedule, "microbatches": plan.microbatches, "predicted_time_s": plan.predicted_s,
            "t_max_s": plan.t_max_s, "closed_form_s": plan.closed_form_s, "planning_s": plan.planning_s,
            "stages": [_stage_dict(s) for s in plan.stages],
            "boundaries": [{**asdict(b), "tensors": list(b.tensors)} for b in plan.boundaries],
            "schedules": {k: {**asdict(r), "warmup": list(r.warmup), "peak_memory_bytes": list(r.peak_memory_bytes)}
                          for k, r in plan.schedules.items()},
            "timeline": [asdict(b) for b in plan.timeline], "graph": g.to_dict()}


def _stage_dict(s: PipelineStage) -> dict[str, Any]:
    out = {f.name: getattr(s, f.name) for f in fields(s) if f.name != "plan"}
    return {**out, "devices": list(s.devices), "layers": list(s.layers), "nodes": list(s.nodes),
            "ratios": list(s.ratios), "plan": None if s.plan is None else s.plan.to_dict()}


def pipeline_plan_from_dict(d: Any) -> PipelinePlan:
    """Parse and validate a pipeline plan dict: the schema, then the stages and boundaries against the graph."""
    if not isinstance(d, dict) or d.get("kind") != PIPELINE_PLAN_KIND:
        raise PlanError(f"not a pipeline plan: missing \"kind\": \"{PIPELINE_PLAN_KIND}\" "
                        "(make one with `hap plan --parallelism pipeline`)")
    version = d.get("schema_version")
    if version != PIPELINE_SCHEMA_VERSION or isinstance(version, bool):
        raise _fail("schema_version", f"{_shown(version)} is not supported (expected {PIPELINE_SCHEMA_VERSION})",
                    REGENERATE)
    _check_top(d)
    try:
        graph = Graph.from_checked_dict(d["graph"], "plan: graph.")
    except ModelError as e:
        raise PlanError(f"{e}; {REGENERATE}") from None
    if graph.fingerprint() != d["model"]["fingerprint"]:
        raise _fail("graph", "was edited: its fingerprint is not the model.fingerprint the plan was made for",
                    REGENERATE)
    plan = PipelinePlan(
        stages=tuple(_stage(s, f"stages[{i}]") for i, s in enumerate(d["stages"])),
        boundaries=tuple(_boundary(b, f"boundaries[{i}]") for i, b in enumerate(d["boundaries"])),
        schedule=d["schedule"], microbatches=d["microbatches"], predicted_s=float(d["predicted_time_s"]),
        t_max_s=float(d["t_max_s"]), closed_form_s=None if d["closed_form_s"] is None else float(d["closed_form_s"]),
        schedules={k: _schedule_result(r, f"schedules[{json.dumps(k)}]") for k, r in d["schedules"].items()},
        planning_s=float(d["planning_s"]), graph=graph, cluster_name=d["cluster"]["name"],
        cluster_fingerprint=d["cluster"]["fingerprint"], device_names=tuple(d["cluster"]["devices"]),
        timeline=tuple(_box(b, f"timeline[{i}]") for i, b in enumerate(d["timeline"])))
    check_pipeline_plan(plan)
    return plan


def _check_top(d: dict[str, Any]) -> None:
    for key, kind in (("model", dict), ("cluster", dict), ("schedule", str), ("stages", list), ("boundaries", list),
                      ("schedules", dict), ("timeline", list), ("graph", dict)):
        _typed(d, key, kind)
    _typed(d["model"], "fingerprint", str, "model.")
    if d["model"].get("origin", {}) != d["graph"].get("origin", {}):
        raise _fail("model.origin", "differs from graph.origin (the runner rebuilds the model from it)", REGENERATE)
    _check_cluster_field(d["cluster"])
    if d["schedule"] not in SCHEDULES:
        raise _fail("schedule", f"{_shown(d['schedule'])} is not a pipeline schedule (one of: {', '.join(SCHEDULES)})")
    if not _is_int(d.get("microbatches")) or d["microbatches"] < 1:
        raise _fail("microbatches", f"{_shown(d.get('microbatches'))} is not a positive integer",
                    "give the number of microbatches per step, e.g. 4")
    for key in ("predicted_time_s", "t_max_s", "planning_s"):
        _non_negative(d.get(key), key)
    if "closed_form_s" not in d:
        raise _fail("closed_form_s", "is missing (null when the closed form does not apply)")
    if d["closed_form_s"] is not None:
        _non_negative(d["closed_form_s"], "closed_form_s")
    if not d["stages"]:
        raise _fail("stages", "is empty: a pipeline has at least one stage")


def _fields(x: Any, path: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """x as an object with exactly `keys`, and any of `optional`."""
    if not isinstance(x, dict):
        raise _fail(path, f"must be an object, got {type(x).__name__}")
    missing = [k for k in keys if k not in x]
    if missing:
        raise _fail(f"{path}.{missing[0]}", "is missing")
    extra = sorted(set(x) - set(keys) - set(optional))
    if extra:
        raise _fail(path, f"unknown field {extra[0]!r}")
    return x


def _ints(x: Any, path: str, length: int | None = None, low: int = 0) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(_is_int(v) and v >= low for v in x):
        raise _fail(path, f"{_shown(x) if not isinstance(x, list) else x[:8]} is not a list of integers >= {low}")
    if length is not None and len(x) != length:
        raise _fail(path, f"has {len(x)} entries, expected {length}")
    return tuple(x)


def _numbers(x: Any, path: str) -> tuple[float, ...]:
    if not isinstance(x, list):
        raise _fail(path, f"must be a list of numbers, got {type(x).__name__}")
    for j, v in enumerate(x):
        _non_negative(v, f"{path}[{j}]")
    return tuple(float(v) for v in x)


def _stage(s: Any, path: str) -> PipelineStage:
    keys = ("devices", "sub_cluster", "layers", "nodes", "warmup", "forward_s", "backward_s", "sync_s",
            "peak_memory_bytes", "ratios")
    s = _fields(s, path, keys, ("plan",))
    devices = _ints(s["devices"], f"{path}.devices")
    if not devices:
        raise _fail(f"{path}.devices", "is empty: a stage runs on at least one device")
    _typed(s, "sub_cluster", str, f"{path}.")
    if not _is_int(s["warmup"]) or s["warmup"] < 1:
        raise _fail(f"{path}.warmup", f"{_shown(s['warmup'])} is not a positive integer (forwards before the first backward)")
    for key in ("forward_s", "backward_s", "sync_s", "peak_memory_bytes"):
        _non_negative(s[key], f"{path}.{key}")
    ratios = _numbers(s["ratios"], f"{path}.ratios")
    if len(ratios) != len(devices) or abs(sum(ratios) - 1) > RATIO_TOLERANCE:
        raise _fail(f"{path}.ratios", f"{list(ratios)[:8]} must give one share per device ({len(devices)}) summing to 1")
    return PipelineStage(devices, s["sub_cluster"], _ints(s["layers"], f"{path}.layers", 2),
                         _ints(s["nodes"], f"{path}.nodes", 2), s["warmup"], float(s["forward_s"]),
                         float(s["backward_s"]), float(s["sync_s"]), float(s["peak_memory_bytes"]), ratios,
                         _stage_plan(s.get("plan"), f"{path}.plan"))


def _stage_plan(d: Any, path: str) -> Plan | None:
    """A stage's embedded HAP plan, validated as every plan is (schema, program replayed against the theory)."""
    if d is None:
        return None
    try:
        return Plan.from_dict(d)
    except PlanError as e:
        raise PlanError(f"plan: {path}: {e}") from None


def _boundary(b: Any, path: str) -> Boundary:
    b = _fields(b, path, ("cut", "tensors", "forward_bytes", "backward_bytes", "link", "transfer_s"))
    if not _is_int(b["cut"]) or b["cut"] < 1:
        raise _fail(f"{path}.cut", f"{_shown(b['cut'])} is not a layer index >= 1")
    for key in ("forward_bytes", "backward_bytes"):
        if not _is_int(b[key]) or b[key] < 0:
            raise _fail(f"{path}.{key}", f"{_shown(b[key])} is not a non-negative integer")
    _typed(b, "link", str, f"{path}.")
    _non_negative(b["transfer_s"], f"{path}.transfer_s")
    return Boundary(b["cut"], _ints(b["tensors"], f"{path}.tensors"), b["forward_bytes"], b["backward_bytes"],
                    b["link"], float(b["transfer_s"]))


def _schedule_result(r: Any, path: str) -> ScheduleResult:
    r = _fields(r, path, ("iteration_s", "warmup", "peak_memory_bytes", "fits"))
    _non_negative(r["iteration_s"], f"{path}.iteration_s")
    _typed(r, "fits", bool, f"{path}.")
    return ScheduleResult(float(r["iteration_s"]), _ints(r["warmup"], f"{path}.warmup", low=1),
                          _numbers(r["peak_memory_bytes"], f"{path}.peak_memory_bytes"), r["fits"])


def _box(b: Any, path: str) -> TimelineBox:
    b = _fields(b, path, ("name", "resource", "kind", "stage", "microbatch", "start_s", "end_s"))
    for key in ("name", "resource", "kind"):
        _typed(b, key, str, f"{path}.")
    for key in ("stage", "microbatch"):
        if not _is_int(b[key]) or b[key] < -1:
            raise _fail(f"{path}.{key}", f"{_shown(b[key])} is not an index")
    for key in ("start_s", "end_s"):
        _non_negative(b[key], f"{path}.{key}")
    if b["end_s"] < b["start_s"]:
        raise _fail(f"{path}.end_s", f"{b['end_s']} is before start_s {b['start_s']}")
    return TimelineBox(b["name"], b["resource"], b["kind"], b["stage"], b["microbatch"], float(b["start_s"]),
                       float(b["end_s"]))


def check_pipeline_plan(plan: PipelinePlan) -> None:
    """The stages against the cluster and the graph: disjoint device groups, warm-up counts within the
    microbatches, node ranges tiling the computed nodes in order, boundaries listing what crosses."""
    graph, S, B = plan.graph, len(plan.stages), plan.microbatches
    assert graph is not None
    batch = batch_of(graph)
    if batch % B:
        raise _fail("microbatches", f"{B} does not divide the batch of {batch}", "choose a divisor of the batch")
    seen: dict[int, int] = {}
    for i, s in enumerate(plan.stages):
        for d in s.devices:
            if d >= plan.world_size:
                raise _fail(f"stages[{i}].devices", f"rank {d} is outside the cluster's {plan.world_size} devices")
            if d in seen:
                raise _fail(f"stages[{i}].devices", f"rank {d} is also in stages[{seen[d]}]: a device runs one stage")
            seen[d] = i
        if s.warmup > B:
            raise _fail(f"stages[{i}].warmup", f"{s.warmup} exceeds the {B} microbatches")
        if len(s.devices) > batch // B:
            raise _fail(f"stages[{i}].devices", f"{len(s.devices)} devices share microbatches of {batch // B} samples",
                        "use fewer devices per stage or fewer microbatches")
    computed = [n.id for n in graph.nodes if not n.is_leaf]
    position = {nid: k for k, nid in enumerate(computed)}
    expected = 0
    for i, s in enumerate(plan.stages):
        first, last = s.nodes
        if first not in position or last not in position or position[first] != expected or position[last] < position[first]:
            want = computed[expected] if expected < len(computed) else "none (the graph ends)"
            raise _fail(f"stages[{i}].nodes", f"{list(s.nodes)} does not continue the previous stage: its first node "
                        f"must be computed node {want} and its last at or after it")
        expected = position[last] + 1
    if expected != len(computed):
        raise _fail(f"stages[{S - 1}].nodes", f"ends before the graph's last computed node {computed[-1]} (the loss)")
    if len(plan.boundaries) != S - 1:
        raise _fail("boundaries", f"has {len(plan.boundaries)} entries for {S} stages; give one per pair of neighbours")
    for i, b in enumerate(plan.boundaries):
        crossing = crossing_tensors(graph, plan.stages[i].nodes[1])
        if tuple(sorted(b.tensors)) != crossing:
            raise _fail(f"boundaries[{i}].tensors", f"{list(b.tensors)[:8]} is not what crosses after node "
                        f"{plan.stages[i].nodes[1]} ({list(crossing)[:8]})")
    check_stage_plans(plan)
    for key, r in plan.schedules.items():
        if key not in SCHEDULES:
            raise _fail(f"schedules[{json.dumps(key)}]", f"is not a schedule (one of: {', '.join(SCHEDULES)})")
        if len(r.warmup) != S or len(r.peak_memory_bytes) != S:
            raise _fail(f"schedules[{json.dumps(key)}]", f"needs one warm-up count and one memory figure per stage ({S})")


def check_stage_plans(plan: PipelinePlan) -> None:
    """Every stage has a HAP plan or none does; each is the plan of its own stage: its devices, its
    layers, the model's nodes by name and operator, receiving and sending exactly the boundary's
    tensors, each boundary tensor sent in the form the next stage receives it in."""
    planned = [s.plan is not None for s in plan.stages]
    if any(planned) and not all(planned):
        i = planned.index(False)
        raise _fail(f"stages[{i}].plan", "is missing: either every stage has a HAP plan or none has")
    if not any(planned):
        return
    graph = plan.graph
    assert graph is not None
    sent: dict[int, int] = {}
    for i, s in enumerate(plan.stages):
        sp, path = s.plan, f"stages[{i}].plan"
        assert sp is not None
        names = [plan.device_names[d] for d in s.devices]
        if list(sp.device_names) != names:
            raise _fail(f"{path}.cluster.devices", f"{list(sp.device_names)[:8]} are not the stage's devices {names[:8]}")
        meta = sp.graph.origin.get("pipeline_stage", {})
        if meta.get("layers") != list(s.layers) or len(meta.get("model_nodes", [])) != len(sp.graph):
            raise _fail(f"{path}.graph.origin.pipeline_stage", f"does not describe layers {list(s.layers)} node by node")
        received: dict[int, int] = {}
        for node, m in zip(sp.graph.nodes, meta["model_nodes"]):
            if m == -1 and (node.op == "stage_output" or (node.op == "identity" and "cut" in sp.graph[node.inputs[0]].attrs)):
                continue  # what the stage's graph adds: its end, and the copy of a received tensor
            if not _is_int(m) or not 0 <= m < len(graph) or graph[m].name != node.name or \
                    (graph[m].op != node.op and "cut" not in node.attrs):
                raise _fail(f"{path}.graph.nodes[{node.id}]", f"{node.name!r} ({node.op}) is not model node {m}")
            if "cut" in node.attrs:
                received[m] = node.attrs.get("form")
        want_in = set(plan.boundaries[i - 1].tensors) if i else set()
        if set(received) != want_in or any(sent.get(t) != f for t, f in received.items()):
            raise _fail(f"{path}.graph", f"receives {sorted(received)[:8]} in forms the previous stage does not send "
                        f"(boundary: {sorted(want_in)[:8]})")
        sink = sp.graph[sp.graph.loss]
        if i == len(plan.stages) - 1:
            if sink.op == "stage_output" or meta["model_nodes"][sp.graph.loss] != graph.loss:
                raise _fail(f"{path}.graph.loss", "the last stage's plan must end in the model's loss")
            continue
        if sink.op != "stage_output":
            raise _fail(f"{path}.graph.loss", "a stage before the last must end in a stage_output node")
        out = [meta["model_nodes"][t] for t in sink.inputs]
        if sorted(out) != sorted(plan.boundaries[i].tensors):
            raise _fail(f"{path}.graph", f"sends {sorted(out)[:8]}, not the boundary's tensors "
                        f"{sorted(plan.boundaries[i].tensors)[:8]}")
        sent = dict(zip(out, sink.attrs["forms"]))


def crossing_tensors(graph: Graph, last: int) -> tuple[int, ...]:
    """Ids of the computed tensors up to node `last` that nodes after it use (sorted)."""
    before = {n.id for n in graph.nodes if not n.is_leaf and n.id <= last}
    return tuple(sorted({i for n in graph.nodes if not n.is_leaf and n.id > last for i in n.inputs if i in before}))


def load_any(source: str | Path | dict[str, Any]):
    """A plan of either kind from a path, JSON text or a dict: `Plan` ("hap.plan") or `PipelinePlan`
    ("hap.pipeline_plan"), by its "kind"."""
    from .plan import Plan, read_plan_json

    d = source if isinstance(source, dict) else read_plan_json(source)
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == PIPELINE_PLAN_KIND:
        return pipeline_plan_from_dict(d)
    if kind == "hap.plan":
        return Plan.from_dict(d)
    raise PlanError(f"not a plan: \"kind\" is {_shown(kind)}, expected \"hap.plan\" or \"{PIPELINE_PLAN_KIND}\" "
                    "(make one with `hap plan`)")


def save_pipeline_plan(plan: PipelinePlan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(pipeline_plan_dict(plan), indent=1))

