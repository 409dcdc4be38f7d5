"""The plan: the chosen program Q, ratios B, integer shard sizes and every predicted figure, as JSON.

A plan is self-contained: it embeds the graph IR, so the runner and the UI need nothing else but
the cluster spec (whose fingerprint it records).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from engine.display import Shows
from engine.errors import ModelError, PlanError
from engine.readers import parse_json, read_json
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.spmd.breakdown import Breakdown
from engine.spmd.program import Instruction
from engine.spmd.recompute import describe
from engine.spmd.segments import Segmentation
from engine.spmd.sizes import shard_key
from engine.spmd.utilisation import DeviceUse, Utilisation, Utilised, of_plan, recorded
from engine.spmd.zero import StateSharding, from_record, summary_line

PLAN_KIND = "hap.plan"
PLAN_SCHEMA_VERSION = 1


@dataclass
class StageRecord:
    """Predicted time of one stage: its opening collective and each device's computation."""

    direction: str
    comm: str
    comm_tensor: str
    comm_s: float
    comp_s: list[float]
    segment: int = 0


@dataclass
class Plan(Utilised, Shows):
    """Program Q + ratios B + predictions. `to_json` and `engine.load_plan` round-trip exactly."""

    parallelism: ClassVar[str] = "spmd"
    """The kind of plan (`engine.pipeline.plan.PipelinePlan` says "pipeline"): the one attribute callers branch on
    (both kinds implement `engine.planner.AnyPlan`)."""
    strategy: str
    """`hap`, `dp-even` or `dp-proportional`."""
    graph: Graph
    cluster_name: str
    cluster_fingerprint: str
    device_names: list[str]
    program: tuple[Instruction, ...]
    ratios: dict[str, list[float]]
    """Ratios per segment (`"0"`, `"1"`, ...), one per device."""
    shard_sizes: dict[str, list[int]]
    """`"<tensor>:<dim>"` (or `"<tensor>:<dim>@<segment>"` after a resplit, see `shard_key`) -> integer
    size on every device (sums to the dim's size)."""
    predicted_time_s: float
    stages: list[StageRecord]
    memory_bytes: list[float]
    """Predicted peak memory per GPU of every device."""
    history: list[dict[str, Any]] = field(default_factory=list)
    search: dict[str, Any] = field(default_factory=dict)
    segment_of: list[int] = field(default_factory=list)
    """Segment of every graph node (empty: the whole model is one segment)."""
    machines: list[str] = field(default_factory=list)
    """Machine of every device, in device order (empty in plans written before hierarchical
    collectives); the runner builds the sub-groups of `.hier` collectives from it."""
    overlap: str = "none"
    """How communication overlaps computation (`engine.spmd.overlap.OVERLAP_MODES`): `none`, `ddp`
    (gradient buckets during backward) or `duplex` (two half-batches, HiDup)."""
    shard_states: dict[str, Any] = field(default_factory=dict)
    """Sharded states of Full weights (`engine.spmd.zero.to_record`): `stages` (weight name -> ZeRO stage
    1-3), `shares` (one per device) and `sizes` (weight name -> flattened elements per device); empty
    when every weight is at stage 0 (then absent from the JSON)."""
    schema_version: int = PLAN_SCHEMA_VERSION
    peak_flops: float | None = None
    """Summed FLOP/s of the cluster's devices in the plan's precision (`engine.spmd.utilisation`); None in
    plans written before plans recorded it (their compute bound and MFU are unknown)."""

    @property
    def utilisation(self) -> Utilisation:
        """Model FLOPs, peak FLOP/s, and the compute bound and MFU of the predicted time (`engine.spmd.utilisation`)."""
        return of_plan(self.graph, self.peak_flops, self.predicted_time_s)
    recompute: list[int] = field(default_factory=list)
    """Layers (`Node.segment` ids) whose activations are recomputed in backward (`engine.spmd.recompute`);
    empty, and absent from the JSON, when none are."""

    @property
    def device_use(self) -> DeviceUse:
        """The devices that get a share of some segment's batch (all, unless the balancer gave one none)."""
        return DeviceUse.of(self.device_names, (j for row in self.ratio_rows for j, r in enumerate(row) if r > 0))

    @property
    def states(self) -> StateSharding | None:
        """The plan's sharded states for the cost model (None when none)."""
        return from_record(self.graph, self.shard_states)

    @property
    def segmentation(self) -> Segmentation:
        if not self.segment_of:
            return Segmentation.single(self.graph)
        return Segmentation(tuple(self.segment_of), max(self.segment_of) + 1)

    @property
    def ratio_rows(self) -> list[list[float]]:
        """The ratios as one row per segment, in segment order."""
        return [self.ratios[k] for k in sorted(self.ratios, key=int)]

    def sizes(self, tensor: int, dim: int, segment: int | None = None) -> list[int]:
        """Integer sizes of a sharded dim on every device, inside `segment` (default: the tensor's own)."""
        seg = self.segmentation
        key = shard_key(self.graph, seg, tensor, dim, seg.of_node[tensor] if segment is None else segment)
        if key not in self.shard_sizes:
            raise PlanError(f"plan has no shard sizes for {key}")
        return self.shard_sizes[key]

    def __repr__(self) -> str:
        """One line for logs (the dataclass repr of a 4-layer GPT plan ran to 61 411 characters)."""
        return (f"<Plan {self.strategy} of '{self.graph.name}' on '{self.cluster_name}': {self.world_size} devices, "
                f"overlap {self.overlap}, {self.predicted_time_s * 1e3:.4g} ms per iteration>")

    @property
    def world_size(self) -> int:
        return len(self.device_names)

    @property
    def model_fingerprint(self) -> str:
        return self.graph.fingerprint()

    @property
    def options(self) -> PlanOptions:
        """The options the plan was made with (`search["options"]`; plans written before `PlanOptions`
        recorded only their optimizer)."""
        recorded = self.search.get("options")
        if isinstance(recorded, dict):
            return PlanOptions.from_dict(recorded)
        return PlanOptions(optimizer=self.search.get("optimizer", "adam"))

    def listing(self) -> str:
        """The distributed program, one instruction a line."""
        return "\n".join(ins.render(self.graph) for ins in self.program)

    def summary(self) -> str:
        """A few lines for people: what was planned, the predicted time and its speed-up over data
        parallelism, the ratios and memory per GPU, and how the search went."""
        ratios = [r for row in self.ratio_rows for r in row]
        fullest = max(range(self.world_size), key=lambda j: self.memory_bytes[j], default=0)
        lines = [f"{self.strategy} SPMD plan of {self.graph.name} on {self.cluster_name} ({self.world_size} devices)",
                 f"predicted iteration {self.predicted_time_s * 1e3:.2f} ms, overlap {self.overlap}, "
                 f"{self.segmentation.count} segment{'s' if self.segmentation.count > 1 else ''}",
                 self.utilisation.detail(self.options.precision), self.device_use.line()]
        base = {k: v for k, v in self.search.get("baselines_s", {}).items() if isinstance(v, (int, float)) and v > 0}
        if base and self.predicted_time_s > 0:
            name = min(base, key=base.get)
            lines.append(f"speed-up over the best data-parallel baseline ({name}): {base[name] / self.predicted_time_s:.2f}x")
        if ratios and self.memory_bytes:
            lines.append(f"ratios {min(ratios):.4f} to {max(ratios):.4f}; memory per GPU up to "
                         f"{self.memory_bytes[fullest] / 2**30:.2f} GiB ({self.device_names[fullest]})")
        if self.recompute:
            lines.append(f"recompute: {describe(self.graph, self.recompute)}")
        if self.shard_states:
            lines.append(summary_line(self.shard_states, len(self.graph.parameters)))
        if "expanded" in self.search:
            s = self.search
            lines.append(f"search: {s.get('iterations', 0)} Q<->B iterations, {s['expanded']} states expanded, "
                         f"{s.get('elapsed_s', 0.0):.2f} s, {'optimal' if s.get('optimal') else 'beam-limited'}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": PLAN_KIND, "schema_version": self.schema_version, "strategy": self.strategy,
                "model": {"name": self.graph.name, "fingerprint": self.model_fingerprint, "origin": self.graph.origin},
                "cluster": {"name": self.cluster_name, "fingerprint": self.cluster_fingerprint, "devices": self.device_names,
                            **({"machines": self.machines} if self.machines else {})},
                "predicted_time_s": self.predicted_time_s, "ratios": self.ratios, "shard_sizes": self.shard_sizes,
                "memory_bytes": self.memory_bytes, "stages": [asdict(s) for s in self.stages],
                **recorded(self.utilisation),
                "program": [ins.to_dict() for ins in self.program], "history": self.history, "search": self.search,
                "segments": self.segment_of, "overlap": self.overlap,
                **({"recompute": list(self.recompute)} if self.recompute else {}),
                **({"shard_states": self.shard_states} if self.shard_states else {}), "graph": self.graph.to_dict()}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())



def stage_records(b: Breakdown, graph: Graph) -> list[StageRecord]:
    return [StageRecord(s.direction, s.comm, graph[s.comm_node].name if s.comm_node >= 0 else "", c, comp, s.segment)
            for s, c, comp in zip(b.stages, b.stage_comm_s, b.stage_comp_s)]


def read_plan_json(text_or_path: str | Path) -> Any:
    """The JSON value of a plan file (a path) or of a plan's JSON text, refused in one line when
    empty, missing, not a regular file, too large, too deep or not JSON (both kinds of plan are read
    this way; engine.readers sets the bounds)."""
    text = str(text_or_path)
    if not text.strip():
        raise PlanError("plan is empty: give a plan file path or the plan's JSON text")
    if text.lstrip().startswith(("{", "[")):
        return parse_json(text, "plan", PlanError)
    return read_json(text, f"plan file '{text}'", PlanError)


def plan_from_checked_dict(d: dict[str, Any]) -> Plan:
    """The Plan of a dict that passed the schema check (`engine.spmd.validate.check_plan_dict`); no
    consistency checks: load plans with `engine.load_plan`, which runs them all."""
    try:
        graph = Graph.from_checked_dict(d["graph"], "plan: graph.")
    except ModelError as e:
        raise PlanError(f"{e}; regenerate the plan with `hap plan`") from None
    try:
        return Plan(strategy=d["strategy"], graph=graph, cluster_name=d["cluster"]["name"],
                    cluster_fingerprint=d["cluster"]["fingerprint"], device_names=list(d["cluster"]["devices"]),
                    machines=list(d["cluster"].get("machines", [])),
                    program=tuple(Instruction.from_dict(x) for x in d["program"]), ratios=d["ratios"],
                    shard_sizes=d["shard_sizes"], predicted_time_s=float(d["predicted_time_s"]),
                    stages=[StageRecord(**s) for s in d["stages"]], memory_bytes=list(d["memory_bytes"]),
                    history=list(d.get("history", [])), search=dict(d.get("search", {})),
                    segment_of=[int(k) for k in d.get("segments", [])], overlap=d.get("overlap", "none"),
                    peak_flops=None if d.get("peak_flops") is None else float(d["peak_flops"]),
                    recompute=[int(k) for k in d.get("recompute", [])],
                    shard_states=dict(d.get("shard_states", {})))
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise PlanError(f"malformed plan: {type(e).__name__}: {e}") from None
