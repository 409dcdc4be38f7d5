"""The pipeline plan (HAPT): its stages, boundaries and schedule, as JSON (kind "hap.pipeline_plan"), and its validation.

A pipeline plan is self-contained like a plain plan (`engine.spmd.plan.Plan`): it embeds the graph, the
cluster's name, fingerprint and device names, and per stage its device ranks, node range and
warm-up count; per boundary the tensors that cross it, their bytes and the predicted transfer
time; the schedule, the microbatch count and the predicted timeline. Nothing in it is trusted:
`pipeline_plan_from_dict` refuses a bad field with a `PlanError` naming it (its JSON path) and the
fix, and checks that the stages tile the graph's computed nodes in order and that every boundary
lists exactly the tensors that cross it (the runner sends those and only those).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from engine.display import Shows
from engine.errors import ModelError, PlanError
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.pipeline.schedule import SCHEDULES
from engine.pipeline.stages import batch_of
from engine.spmd.plan import Plan
from engine.spmd.program import COMM, LOAD
from engine.spmd.utilisation import DeviceUse, Utilisation, Utilised, of_plan, recorded
from engine.spmd.recompute import describe
from engine.spmd.validate import (RATIO_TOLERANCE, _check_cluster_field, _check_search_options, _fail, _is_int,
                                  _non_negative, _shown, _typed, check_utilisation_fields, plan_from_dict)
from engine.timeline import Schedule

PIPELINE_PLAN_KIND = "hap.pipeline_plan"
PIPELINE_SCHEMA_VERSION = 1
REGENERATE = "regenerate the plan with `hap plan --parallelism pipeline`"


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a pipeline plan."""

    devices: tuple[int, ...]
    """Device ranks (indices in the cluster)."""
    sub_cluster: str
    layers: tuple[int, int]
    """Layers [start, end)."""
    nodes: tuple[int, int]
    """First and last computed node id (topological order)."""
    warmup: int
    forward_s: float
    backward_s: float
    sync_s: float
    peak_memory_bytes: float
    """Per GPU on the fullest device, under the plan's schedule."""
    ratios: tuple[float, ...] = ()
    """Each device's share of every microbatch (data parallelism inside the stage: ~ its FLOP/s; with a
    `plan`, the shares of its first segment)."""
    plan: Plan | None = None
    """HAP's plan of the stage on its devices (`engine.pipeline.stage_plan`): its own graph (the stage at one
    microbatch's size, from the tensors it receives to those it sends), program Q and ratios B. None:
    the stage runs data parallelism at `ratios`."""

    def program_summary(self) -> str:
        """One line on what the stage runs: data parallelism, or its HAP plan (weights sharded, collectives)."""
        plan = self.plan
        if plan is None:
            return "data parallel"
        weights = [ins for ins in plan.program if ins.kind == LOAD and plan.graph[ins.node].op == "parameter"]
        sharded = sum(1 for ins in weights if ins.post >= 0)
        comms = sum(1 for ins in plan.program if ins.kind == COMM and ins.rule != "slice")
        collectives = f", {comms} collective{'s' if comms != 1 else ''}" if comms else ""
        if not sharded:
            return f"HAP: data parallel{collectives}"
        return f"HAP: {sharded} of {len(weights)} weights sharded{collectives}"


@dataclass(frozen=True)
class Boundary:
    """What crosses between two neighbouring stages."""

    cut: int
    tensors: tuple[int, ...]
    forward_bytes: int
    """Per iteration (all microbatches)."""
    backward_bytes: int
    link: str
    transfer_s: float
    """Per microbatch, each way."""


@dataclass(frozen=True)
class ScheduleResult:
    """A schedule of the plan's partition, simulated."""

    iteration_s: float
    warmup: tuple[int, ...]
    peak_memory_bytes: tuple[float, ...]
    fits: bool


@dataclass(frozen=True)
class TimelineBox:
    """One task of the simulated iteration, as the plan records it."""

    name: str
    resource: str
    kind: str
    """forward, backward, transfer or grad_sync."""
    stage: int
    microbatch: int
    """-1 for a stage's gradient sync."""
    start_s: float
    end_s: float


def timeline_boxes(schedule: Schedule) -> tuple[TimelineBox, ...]:
    """The boxes of a simulated schedule (`engine.timeline.Schedule`)."""
    return tuple(TimelineBox(s.task.name, s.task.resource, s.task.kind, int(s.task.info.get("stage", 0)),
                             int(s.task.info.get("microbatch", -1)), s.start_s, s.end_s) for s in schedule.spans)


@dataclass(frozen=True)
class PipelinePlan(Utilised, Shows):
    """A pipeline plan: stages on device groups, boundaries, schedule and microbatches (HAPT)."""

    stages: tuple[PipelineStage, ...]
    boundaries: tuple[Boundary, ...]
    schedule: str
    microbatches: int
    predicted_s: float
    """Simulated iteration time under `schedule`, gradient syncs included."""
    t_max_s: float
    closed_form_s: float | None
    """HAPT Eq. 13 (syncs excluded), when every transfer is at most t_max."""
    schedules: dict[str, ScheduleResult]
    """The same partition under every schedule of `engine.pipeline.schedule.SCHEDULES`."""
    planning_s: float
    graph: Graph | None = None
    """The captured model the plan was made for (embedded in the plan JSON, as in `engine.spmd.plan.Plan`)."""
    cluster_name: str = ""
    cluster_fingerprint: str = ""
    device_names: tuple[str, ...] = ()
    """Every device of the cluster, in rank order (stage devices index it)."""
    timeline: tuple[TimelineBox, ...] = ()
    """The simulated iteration under `schedule`: one box per forward, backward, transfer and sync."""
    search: dict[str, Any] = field(default_factory=dict, compare=False)
    """What the planner records beside the plan (`engine.plan`: the SPMD plan's time in `parallelism_s`,
    the options it was made with in `options`)."""
    peak_flops: float | None = None
    """Summed FLOP/s of the cluster's devices in the plan's precision (`engine.spmd.utilisation`); None in
    plans written before plans recorded it."""
    parallelism: ClassVar[str] = "pipeline"
    """The kind of plan (`engine.spmd.plan.Plan` says "spmd"): the one attribute callers branch on
    (both kinds implement `engine.planner.AnyPlan`)."""

    def __repr__(self) -> str:
        """One line for logs (the dataclass repr of a pipeline plan ran past 100 000 characters)."""
        model = self.graph.name if self.graph is not None else "?"
        return (f"<PipelinePlan of '{model}' on '{self.cluster_name}': {len(self.stages)} stages, {self.schedule}, "
                f"{self.microbatches} microbatches, {self.predicted_s * 1e3:.4g} ms per iteration>")

    @property
    def world_size(self) -> int:
        return len(self.device_names)

    @property
    def predicted_time_s(self) -> float:
        """The predicted iteration time, by the name `Plan` uses (the plans' shared protocol)."""
        return self.predicted_s

    @property
    def model_fingerprint(self) -> str:
        """The fingerprint of the model the plan was made for (its embedded graph)."""
        return self.graph.fingerprint() if self.graph is not None else ""

    @property
    def utilisation(self) -> Utilisation:
        """Model FLOPs of the whole graph, peak FLOP/s, and the compute bound and MFU of the predicted time."""
        return of_plan(self.graph, self.peak_flops, self.predicted_s)

    @property
    def device_use(self) -> DeviceUse:
        """The devices of some stage; the rest of the cluster sits idle (the DP may leave machines out)."""
        return DeviceUse.of(self.device_names, (j for s in self.stages for j in s.devices))

    @property
    def options(self) -> PlanOptions:
        """The options the plan was made with (`search["options"]`; plans written before `PlanOptions`
        recorded none: the defaults of a pipeline with this plan's microbatches)."""
        recorded = self.search.get("options")
        if isinstance(recorded, dict):
            return PlanOptions.from_dict(recorded)
        return PlanOptions(optimizer=self.search.get("optimizer", "adam"), parallelism="pipeline",
                           microbatches=self.microbatches)

    def to_dict(self) -> dict[str, Any]:
        """The plan JSON (kind "hap.pipeline_plan")."""
        return pipeline_plan_dict(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    def stage_line(self, i: int) -> str:
        """Stage i in one line: its layers, its devices and what it runs."""
        s = self.stages[i]
        names = [self.device_names[d] if d < len(self.device_names) else str(d) for d in s.devices]
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} devices)" if len(names) > 4 else "")
        again = f"; recompute {describe(s.plan.graph, s.plan.recompute)}" if s.plan is not None and s.plan.recompute else ""
        return f"stage {i}: layers {s.layers[0]}..{s.layers[1] - 1} on {shown}: {s.program_summary()}{again}"

    def listing(self) -> str:
        """Every stage's program: a header line per stage, then its HAP plan's listing (data-parallel
        stages say so: every parameter Full, each microbatch split by the stage's ratios)."""
        out = []
        for i, s in enumerate(self.stages):
            out.append(f"# {self.stage_line(i)}")
            if s.plan is not None:
                out.append(s.plan.listing())
            else:
                out.append(f"# data parallel: parameters Full, microbatch rows split {list(round(r, 4) for r in s.ratios)}")
        return "\n".join(out)

    def summary(self) -> str:
        """A few lines for people: the stages, the schedule and the predicted time."""
        name = self.graph.name if self.graph is not None else "?"
        lines = [f"pipeline plan of {name} on {self.cluster_name} ({self.world_size} devices): {len(self.stages)} "
                 f"stages, {self.microbatches} microbatches, schedule {self.schedule}",
                 f"predicted iteration {self.predicted_s * 1e3:.2f} ms (t_max {self.t_max_s * 1e3:.2f} ms)",
                 self.utilisation.detail(self.options.precision), self.device_use.line()]
        lines += [self.stage_line(i) for i in range(len(self.stages))]
        return "\n".join(lines)



def pipeline_plan_dict(plan: PipelinePlan) -> dict[str, Any]:
    """The JSON-ready dict of a pipeline plan (one made by `best_pipeline`, which embeds its graph)."""
    if plan.graph is None:
        raise PlanError("pipeline plan has no graph to embed; make it with engine.pipeline.partition.best_pipeline")
    g = plan.graph
    return {"kind": PIPELINE_PLAN_KIND, "schema_version": PIPELINE_SCHEMA_VERSION,
            "model": {"name": g.name, "fingerprint": g.fingerprint(), "origin": g.origin},
            "cluster": {"name": plan.cluster_name, "fingerprint": plan.cluster_fingerprint,
                        "devices": list(plan.device_names)},
            "schedule": plan.schedule, "microbatches": plan.microbatches, "predicted_time_s": plan.predicted_s,
            "t_max_s": plan.t_max_s, "closed_form_s": plan.closed_form_s, "planning_s": plan.planning_s,
            **recorded(plan.utilisation),
            "stages": [_stage_dict(s) for s in plan.stages],
            "boundaries": [{**asdict(b), "tensors": list(b.tensors)} for b in plan.boundaries],
            "schedules": {k: {**asdict(r), "warmup": list(r.warmup), "peak_memory_bytes": list(r.peak_memory_bytes)}
                          for k, r in plan.schedules.items()},
            "timeline": [asdict(b) for b in plan.timeline], "search": plan.search, "graph": g.to_dict()}


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
        timeline=tuple(_box(b, f"timeline[{i}]") for i, b in enumerate(d["timeline"])),
        search=dict(d.get("search", {})), peak_flops=None if d.get("peak_flops") is None else float(d["peak_flops"]))
    check_pipeline_plan(plan)
    return plan


def _check_top(d: dict[str, Any]) -> None:
    for key, kind in (("model", dict), ("cluster", dict), ("schedule", str), ("stages", list), ("boundaries", list),
                      ("schedules", dict), ("timeline", list), ("graph", dict)):
        _typed(d, key, kind)
    _check_search_options(_typed(d, "search", dict, required=False) or {})
    check_utilisation_fields(d)
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
        return plan_from_dict(d)
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
