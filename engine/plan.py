"""The plan: the chosen program Q, ratios B, integer shard sizes and every predicted figure, as JSON.

A plan is self-contained: it embeds the graph IR, so the runner and the UI need nothing else but
the cluster spec (whose fingerprint it records).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .cost import Breakdown
from .errors import ModelError, PlanError
from .graph import Graph
from .program import COMPUTE, Instruction
from .segments import Segmentation, instruction_segments, source_segments

PLAN_SCHEMA_VERSION = 1


def split_sizes(total: int, ratios: list[float]) -> list[int]:
    """Integer sizes proportional to `ratios` summing exactly to `total` (HAP §5.1): round to
    nearest, then move one unit at a time where the rounding error is largest."""
    s = sum(ratios)
    exact = [total * r / s for r in ratios]
    sizes = [round(x) for x in exact]
    while sum(sizes) > total:
        j = max((i for i in range(len(sizes)) if sizes[i] > 0), key=lambda i: (sizes[i] - exact[i], -i))
        sizes[j] -= 1
    while sum(sizes) < total:
        j = max(range(len(sizes)), key=lambda i: (exact[i] - sizes[i], -i))
        sizes[j] += 1
    return sizes


ShardKey = tuple[int, int, int]
"""(tensor, dim, segment): a sharded dim as seen inside one segment (§5.2: segments have their own sizes)."""


def shard_units(program: tuple[Instruction, ...], graph: Graph, seg: Segmentation | None = None) -> dict[ShardKey, int]:
    """For every sharded (tensor, dim, segment) of the program, its number of units.

    A rule links the dims it shards (a view's shard on C=768 and on heads=12, a linear's output
    features and its weight rows). Linked dims must split into the same number of pieces, so each
    linked class shares `units = gcd(sizes)`; a dim of size s then moves in steps of s / units.
    A collective links nothing: its result is a new layout (a resplit's in the next segment).
    """
    units: dict[ShardKey, int] = {}
    for members in shard_classes(program, graph, seg):
        g = math.gcd(*[graph[t].shape[d] for t, d, _ in members])
        units.update({m: g for m in members})
    return units


def shard_classes(program: tuple[Instruction, ...], graph: Graph, seg: Segmentation | None = None) -> list[list[ShardKey]]:
    """The sharded (tensor, dim, segment)s of the program grouped into classes of linked dims (see `shard_units`)."""
    seg = seg or Segmentation.single(graph)
    parent: dict[ShardKey, ShardKey] = {}

    def find(x: ShardKey) -> ShardKey:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for ins, k, src in zip(program, instruction_segments(program, seg), source_segments(program, seg)):
        dims = [(t, f, src) for t, f in ins.pre if f >= 0]
        if ins.post >= 0:
            dims.append((ins.node, ins.post, k))
        linked = dims if ins.kind == COMPUTE else dims[-1:]
        for d in linked:
            find(d)
        for a, b in zip(linked, linked[1:]):
            parent[find(a)] = find(b)
    classes: dict[ShardKey, list[ShardKey]] = {}
    for d in list(parent):
        classes.setdefault(find(d), []).append(d)
    return list(classes.values())


def shard_sizes(program: tuple[Instruction, ...], graph: Graph, ratios: list[list[float]],
                seg: Segmentation | None = None) -> dict[ShardKey, list[int]]:
    """Integer size of every sharded (tensor, dim, segment) on every device; linked dims split alike."""
    out = {}
    for (t, d, k), units in shard_units(program, graph, seg).items():
        step = graph[t].shape[d] // units
        out[(t, d, k)] = [u * step for u in split_sizes(units, ratios[k])]
    return out


def realized_ratios(graph: Graph, sizes: dict[ShardKey, list[int]], ratios: list[list[float]]) -> list[list[float]]:
    """Each device's share of the work as the integer sizes split it, per segment: its size over the
    dim's size, averaged over the segment's sharded tensors weighted by their bytes (whole units
    round the LP's ratios, e.g. 16 samples at 0.654/0.346 become 10/6). A segment with no sharded
    tensor keeps its ratios."""
    out = []
    for k, row in enumerate(ratios):
        shares, weight = [0.0] * len(row), 0.0
        for (t, d, seg), split in sizes.items():
            if seg == k:
                w = float(graph[t].nbytes)
                shares = [a + w * s / graph[t].shape[d] for a, s in zip(shares, split)]
                weight += w
        out.append([a / weight for a in shares] if weight > 0 else list(row))
    return out


def shard_key(graph: Graph, seg: Segmentation, tensor: int, dim: int, segment: int) -> str:
    """The plan JSON key of a sharded dim: `name:dim` in the tensor's own segment, `name:dim@k` after a resplit into k."""
    base = f"{graph[tensor].name}:{dim}"
    return base if segment == seg.of_node[tensor] else f"{base}@{segment}"


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
class Plan:
    """Program Q + ratios B + predictions. `to_json`/`from_json` round-trip exactly."""

    parallelism: ClassVar[str] = "spmd"
    """The kind of plan (`engine.partition.PipelinePlan` says "pipeline"): the one attribute callers branch on."""
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
    """How communication overlaps computation (`engine.overlap.OVERLAP_MODES`): `none`, `ddp`
    (gradient buckets during backward) or `duplex` (two half-batches, HiDup)."""
    schema_version: int = PLAN_SCHEMA_VERSION

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

    @property
    def world_size(self) -> int:
        return len(self.device_names)

    @property
    def model_fingerprint(self) -> str:
        return self.graph.fingerprint()

    def listing(self) -> str:
        """The distributed program, one instruction a line."""
        return "\n".join(ins.render(self.graph) for ins in self.program)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "hap.plan", "schema_version": self.schema_version, "strategy": self.strategy,
                "model": {"name": self.graph.name, "fingerprint": self.model_fingerprint, "origin": self.graph.origin},
                "cluster": {"name": self.cluster_name, "fingerprint": self.cluster_fingerprint, "devices": self.device_names,
                            **({"machines": self.machines} if self.machines else {})},
                "predicted_time_s": self.predicted_time_s, "ratios": self.ratios, "shard_sizes": self.shard_sizes,
                "memory_bytes": self.memory_bytes, "stages": [asdict(s) for s in self.stages],
                "program": [ins.to_dict() for ins in self.program], "history": self.history, "search": self.search,
                "segments": self.segment_of, "overlap": self.overlap, "graph": self.graph.to_dict()}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        """Parse and validate a plan dict (engine.validate, checks 1-4); PlanError naming the first problem."""
        if not isinstance(d, dict) or d.get("kind") != "hap.plan":
            raise PlanError("not a plan: missing \"kind\": \"hap.plan\" (make one with `hap plan`)")
        if d.get("schema_version") != PLAN_SCHEMA_VERSION or isinstance(d.get("schema_version"), bool):
            raise PlanError(f"plan schema_version {d.get('schema_version')!r} is not supported (expected {PLAN_SCHEMA_VERSION})")
        from .validate import check_plan, check_plan_dict  # the validator reads plans: imported when used

        check_plan_dict(d)
        plan = Plan._build(d)
        check_plan(plan, d["model"]["fingerprint"])
        return plan

    @staticmethod
    def _build(d: dict[str, Any]) -> "Plan":
        """The Plan of a dict that passed `check_plan_dict` (no consistency checks)."""
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
                        segment_of=[int(k) for k in d.get("segments", [])], overlap=d.get("overlap", "none"))
        except (KeyError, TypeError, ValueError, AssertionError) as e:
            raise PlanError(f"malformed plan: {type(e).__name__}: {e}") from None

    @staticmethod
    def from_json(text_or_path: str | Path) -> "Plan":
        """Parse a plan from JSON text or a file path."""
        return Plan.from_dict(read_plan_json(text_or_path))


def stage_records(b: Breakdown, graph: Graph) -> list[StageRecord]:
    return [StageRecord(s.direction, s.comm, graph[s.comm_node].name if s.comm_node >= 0 else "", c, comp, s.segment)
            for s, c, comp in zip(b.stages, b.stage_comm_s, b.stage_comp_s)]


def read_plan_json(text_or_path: str | Path) -> Any:
    """The JSON value of a plan file (a path) or of a plan's JSON text, refused in one line when
    empty, missing, unreadable or not JSON (both kinds of plan are read this way)."""
    text = str(text_or_path)
    if not text.strip():
        raise PlanError("plan is empty: give a plan file path or the plan's JSON text")
    if not text.lstrip().startswith(("{", "[")):
        p = Path(text)
        if not p.is_file():
            raise PlanError(f"plan file '{p}' not found" if not p.exists() else f"'{p}' is not a plan file")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"plan file '{p}' cannot be read: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"plan is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
