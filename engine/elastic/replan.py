"""Re-planning on a changed cluster (issue 16, Hetu v2 §4.3): the same model, new devices.

`replan(old_plan, new_cluster)` plans the model embedded in the old plan on the new cluster twice
and keeps the faster: a fresh search (engine.planner.plan), and the old program Q re-balanced on
the new devices (the LP, engine.spmd.balance) then used as the incumbent of a search at those ratios
(engine.spmd.synthesis.synthesize(incumbent=Q)), re-balanced again, both priced in the fresh plan's
overlap mode. A program Q names no device, so it is valid on any world size (only its ratios
change), unless it runs hierarchical collectives and the new cluster has no machines of equal size. The report says what changed (devices added
and removed, ratios, the sharding of every parameter, predicted time before and after) and what the
switch moves: the bytes every device sends and receives under the resharding table
(engine.elastic.reshard), parameters and optimizer state alike, a device keeping its name counting as local.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Any

from engine.cluster.spec import Cluster, load_cluster
from engine.elastic.reshard import FULL_DIM, Layout, Link, ReshardTable, TensorMove, reshard_table, switch_seconds
from engine.errors import InfeasibleError, PlanError
from engine.options import PlanOptions
from engine.planner import plan as plan_model
from engine.spmd.balance import balance
from engine.spmd.cost import CostModel, evaluate
from engine.spmd.halves import halves_problem
from engine.spmd.iteration import plan_of
from engine.spmd.plan import Plan
from engine.spmd.program import LOAD
from engine.spmd.synthesis import synthesize

STATE_TENSORS = {"adam": 2, "sgd": 0, "none": 0}
"""Optimizer state tensors shaped like each parameter that a switch moves with it (Adam's two
moments; the runner's SGD has no momentum). Scalar state (Adam's step) is copied on every device."""


@dataclass
class ShardingChange:
    """How one parameter is held before and after: `Full` or `Shard(d)` with its sizes per device."""

    name: str
    before: str
    after: str


@dataclass
class ReplanReport:
    """What a switch from the old plan to the new one changes, and what it moves."""

    removed: list[str]
    added: list[str]
    ratios_before: dict[str, list[float]]
    """Per device name, its ratio in every segment (old plan)."""
    ratios_after: dict[str, list[float]]
    shardings: list[ShardingChange]
    """Every parameter whose layout changes (form or sizes)."""
    time_before_s: float
    """The old plan's predicted step time on its own cluster."""
    time_after_s: float
    old_program_s: float | None
    """The old program Q re-balanced on the new cluster (None: it does not fit)."""
    chosen: str
    """`fresh search` or `old program Q as incumbent`."""
    sent_bytes: dict[str, int] = field(default_factory=dict)
    received_bytes: dict[str, int] = field(default_factory=dict)
    switch_s: float = 0.0
    """Predicted seconds to move the state (engine.elastic.reshard.switch_seconds on the new cluster's links)."""

    @property
    def moved_bytes(self) -> int:
        return sum(self.sent_bytes.values())

    def render(self) -> str:
        lines = [f"devices removed: {', '.join(self.removed) or '-'}; added: {', '.join(self.added) or '-'}",
                 f"predicted step time: {self.time_before_s * 1e3:.3f} ms before, {self.time_after_s * 1e3:.3f} ms after "
                 f"({self.chosen}; old program Q re-balanced: "
                 f"{'does not fit' if self.old_program_s is None else f'{self.old_program_s * 1e3:.3f} ms'})",
                 "ratios (per segment):"]
        for name in dict.fromkeys([*self.ratios_before, *self.ratios_after]):
            before, after = _show(self.ratios_before.get(name)), _show(self.ratios_after.get(name))
            lines.append(f"  {name:<16} {before:>20} -> {after}")
        lines.append(f"shardings changed: {len(self.shardings)}")
        lines += [f"  {c.name}: {c.before} -> {c.after}" for c in self.shardings]
        lines.append(f"state to move: {self.moved_bytes} bytes over links, about {self.switch_s * 1e3:.3f} ms "
                     "(the busiest device; latencies ignored)")
        for name in dict.fromkeys([*self.sent_bytes, *self.received_bytes]):
            sent, received = self.sent_bytes.get(name, 0), self.received_bytes.get(name, 0)
            lines.append(f"  {name:<16} sends {sent:>12}  receives {received:>12}")
        return "\n".join(lines)


def _show(ratios: list[float] | None) -> str:
    return "-" if ratios is None else "/".join(f"{x:.3f}" for x in ratios)


@dataclass
class Replan:
    plan: Plan
    report: ReplanReport
    table: ReshardTable


def replan(old: Plan, cluster: Any, *, time_budget_s: float | None = None, optimizer: str | None = None) -> Replan:
    """Plan `old`'s model on `cluster` with the options `old` was made with (its time budget and,
    when given, its optimizer replaced), seeded with `old`'s program; the new plan and what changes."""
    cluster = load_cluster(cluster)
    graph, seg = old.graph, old.segmentation
    options = replace(old.options, time_budget_s=time_budget_s, optimizer=optimizer or old.options.optimizer,
                      segments=seg.count, parallelism="spmd", microbatches=None)
    optimizer = options.optimizer
    fresh = plan_model(graph, cluster, options=options)
    seeded, old_q_s = _seeded(old, cluster, options, fresh.overlap)
    chosen, new = ("old program Q as incumbent", seeded) if seeded is not None and \
        seeded.predicted_time_s < fresh.predicted_time_s * (1 - 1e-12) else ("fresh search", fresh)
    new = dataclasses.replace(new, search={**new.search, "optimizer": optimizer, "replan": {
        "from_cluster": old.cluster_name, "from_fingerprint": old.cluster_fingerprint, "chosen": chosen}})
    link = device_link(old.device_names, new.device_names, cluster)
    table = switch_table(old, new, optimizer, link)
    report = ReplanReport(
        removed=[d for d in old.device_names if d not in new.device_names],
        added=[d for d in new.device_names if d not in old.device_names],
        ratios_before=_ratios_by_device(old), ratios_after=_ratios_by_device(new),
        shardings=sharding_changes(old, new), time_before_s=old.predicted_time_s, time_after_s=new.predicted_time_s,
        old_program_s=old_q_s, chosen=chosen,
        sent_bytes={old.device_names[r]: b for r, b in enumerate(table.sent_bytes)},
        received_bytes={new.device_names[r]: b for r, b in enumerate(table.received_bytes)},
        switch_s=switch_seconds(table, link))
    return Replan(new, report, table)


def _seeded(old: Plan, cluster: Cluster, options: PlanOptions, overlap: str) -> tuple[Plan | None, float | None]:
    """(the search seeded with the old Q at its re-balanced ratios, the old Q's own time there),
    priced in `overlap` (the fresh plan's mode, so the two compare like for like); None where
    nothing fits, or where Q cannot run here at all (a hierarchical collective on a cluster
    without machines of equal size prices as infinite)."""
    graph, seg = old.graph, old.segmentation
    even = [1.0 / cluster.num_devices] * cluster.num_devices
    if not math.isfinite(evaluate(old.program, CostModel(graph, cluster, even, options, seg, overlap)).total_s):
        return None, None
    try:
        ratios = balance(old.program, graph, cluster, options=options, segmentation=seg, overlap=overlap).by_segment
    except InfeasibleError:
        return None, None
    old_q = plan_of(old.program, graph, cluster, ratios, options=options, segmentation=seg, overlap=overlap)
    try:
        res = synthesize(graph, CostModel(graph, cluster, ratios, options, seg, overlap),
                         time_budget_s=options.time_budget_s, beam_width=options.beam_width, incumbent=old.program)
        ratios = balance(res.program, graph, cluster, options=options, segmentation=seg, overlap=overlap).by_segment
    except InfeasibleError:
        return _runnable(old_q, cluster), old_q.predicted_time_s
    best = min([old_q, plan_of(res.program, graph, cluster, ratios, options=options, segmentation=seg,
                               overlap=overlap)], key=lambda p: p.predicted_time_s)
    return _runnable(best, cluster), old_q.predicted_time_s


def _runnable(p: Plan, cluster: Cluster) -> Plan | None:
    """`p` if it fits in memory at whole units and, in duplex, its halves can run (engine.spmd.halves)."""
    if p.overlap == "duplex" and halves_problem(p) is not None:
        return None
    return _fits(p, cluster)


def _fits(p: Plan, cluster: Cluster) -> Plan | None:
    """`p` unless whole units push a device past its memory."""
    return None if any(m > d.memory_bytes_per_gpu for m, d in zip(p.memory_bytes, cluster.devices)) else p


def param_layouts(p: Plan) -> dict[str, tuple[tuple[int, ...], Layout, int]]:
    """(shape, layout, item size) of every parameter of a plan, by its target name."""
    out = {}
    for ins in p.program:
        node = p.graph[ins.node]
        if ins.kind == LOAD and node.op == "parameter":
            sizes = tuple(p.sizes(ins.node, ins.post)) if ins.post >= 0 else ()
            out[node.attrs.get("target", node.name)] = (tuple(node.shape), Layout(p.world_size, ins.post, sizes),
                                                        max(1, node.nbytes // max(1, math.prod(node.shape))))
    return out


def _describe(lay: Layout) -> str:
    return "Full" if lay.dim == FULL_DIM else f"Shard({lay.dim}) {list(lay.sizes)}"


def sharding_changes(old: Plan, new: Plan) -> list[ShardingChange]:
    a, b = param_layouts(old), param_layouts(new)
    return [ShardingChange(k, _describe(a[k][1]), _describe(b[k][1])) for k in a
            if k in b and (_describe(a[k][1]) != _describe(b[k][1]))]


def switch_table(old: Plan, new: Plan, optimizer: str, link: Link | None = None) -> ReshardTable:
    """The resharding table of parameters and optimizer state from `old` to `new` (same model);
    `link` defaults to `device_link` without a cluster (a device keeping its name copies locally)."""
    if old.model_fingerprint != new.model_fingerprint:
        raise PlanError("the two plans are of different models (their fingerprints differ): a switch keeps the model")
    a, b = param_layouts(old), param_layouts(new)
    moves = [TensorMove(f"{name}#{k}" if k else name, shape, lay, b[name][1], itemsize)
             for name, (shape, lay, itemsize) in a.items()
             for k in ["", *(f"state{j}" for j in range(STATE_TENSORS.get(optimizer, 0)))]]
    return reshard_table(moves, link or device_link(old.device_names, new.device_names, None))


def device_link(old_names: list[str], new_names: list[str], cluster: Cluster | None):
    """Bytes/s from old rank s to new rank r: a device keeping its name copies locally; between devices
    of `cluster` the bandwidth of their link level; otherwise the cluster's slowest level."""
    devices = {d.name: d for d in cluster.devices} if cluster is not None else {}
    levels = cluster.network.bandwidth_Bps if cluster is not None else {}
    slowest = cluster.bottleneck_bandwidth_Bps if cluster is not None else 1.0

    def link(s: int, r: int) -> float:
        a, b = old_names[s], new_names[r]
        if a == b:
            return math.inf
        da, db = devices.get(a), devices.get(b)
        if da is None or db is None:
            return slowest
        level = "intra_machine" if da.machine == db.machine else \
            "inter_machine" if da.group == db.group or not (da.group and db.group) else "inter_group"
        return levels.get(level, slowest)
    return link


def _ratios_by_device(p: Plan) -> dict[str, list[float]]:
    rows = p.ratio_rows
    return {name: [row[j] for row in rows] for j, name in enumerate(p.device_names)}


def without_devices(cluster: Any, names: list[str]) -> Cluster:
    """`cluster` less the named devices (a failed GPU, a machine taken away), validated again."""
    cluster = load_cluster(cluster)
    unknown = [n for n in names if n not in {d.name for d in cluster.devices}]
    if unknown:
        raise PlanError(f"cluster '{cluster.name}' has no device {', '.join(map(repr, unknown))}; "
                        f"its devices are {', '.join(d.name for d in cluster.devices)}")
    if len(set(names)) >= cluster.num_devices:
        raise PlanError(f"removing {', '.join(names)} leaves cluster '{cluster.name}' without devices")
    d = cluster.to_dict()
    d["devices"] = [dev for dev in d["devices"] if dev["name"] not in names]
    return Cluster.from_dict(d)


def with_device(cluster: Any, device: dict[str, Any]) -> Cluster:
    """`cluster` with one more device (a dict in the cluster JSON's device form), validated again."""
    cluster = load_cluster(cluster)
    d = cluster.to_dict()
    d["devices"] = [*d["devices"], dict(device)]
    return Cluster.from_dict(d)
