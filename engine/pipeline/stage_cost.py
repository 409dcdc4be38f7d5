"""What a pipeline stage costs on a device group, and what a transfer between two groups costs (HAPT §5.2).

Sub-clusters (HAPT's DeviceMesh_A, DeviceMesh_B): devices of the same hardware in the same link
group (`Device.group`; '' for none), in cluster order. A stage runs on a group of devices of one
sub-cluster, HAPT's submeshes: 1, 2, 4, ... devices inside one machine, or whole machines
(`SubCluster.group_sizes`), placed at aligned offsets (`SubCluster.offsets`), so sharding stays off
the slow links between sub-clusters.

The time of a stage on a group comes from a pluggable *pricer* (`StagePricer`). The default,
`DataParallelPricer`, is HAP's per-stage cost for the data-parallel program of the stage: the cost
model (`engine.spmd.cost.CostModel`) on the group alone, ratios proportional to the devices' flops, every
batch-derived operator split over the group and parameter-only ones replicated, the gradients of
all the stage's parameters all-reduced inside the group after the pipeline drains, then the
optimizer step. `engine.pipeline.stage_plan.HapLayerPricer` is the other pricer: it also prices a stage by
its layers' HAP plans (tensor sharding inside a stage), and the planner repartitions with it.

Transfers: one microbatch's boundary tensors (the larger of the activations forward and their
gradients back, both ways) go point to point over the slowest link level between the two stages'
sub-clusters (`transfer_level`), `latency + bytes / bandwidth`. A pair of stages in
one sub-cluster that spans machines is priced as crossing machines (the DP does not track which
machine a group lands on).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from engine.cluster.spec import Cluster
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.pipeline.stages import StageGraph
from engine.spmd.cost import MEM_ZERO, ZERO, CostModel, add
from engine.theory.core import FULL


@dataclass(frozen=True)
class SubCluster:
    """Devices of one hardware kind in one link group: where a stage's group of devices comes from."""

    name: str
    devices: tuple[int, ...]
    """Device indices in the cluster, in order."""
    per_machine: int
    """Devices per machine (the fewest, when machines differ)."""

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """HAPT's submeshes: powers of two below a machine, then 1, 2, ... whole machines."""
        small = [1 << p for p in range(self.per_machine.bit_length()) if (1 << p) < self.per_machine]
        whole = [k * self.per_machine for k in range(1, self.size // self.per_machine + 1)]
        return tuple(sorted(set(small + whole + ([self.size] if not whole else []))))

    def offsets(self, size: int) -> list[int]:
        """Aligned places of a group of `size` devices: inside one machine, or from a machine boundary."""
        M = self.per_machine
        if size > M:
            return list(range(0, self.size - size + 1, M))
        return [m + j * size for m in range(0, self.size - M + 1, M) for j in range(M // size)]


def sub_clusters(cluster: Cluster) -> tuple[SubCluster, ...]:
    """The cluster's sub-clusters, in order of their first device."""
    members: dict[tuple, list[int]] = {}
    for j, d in enumerate(cluster.devices):
        key = (d.group, *_hardware(d))
        members.setdefault(key, []).append(j)
    out = []
    for key, devs in members.items():
        per_machine: dict[str, int] = {}
        for j in devs:
            per_machine[cluster.devices[j].machine] = per_machine.get(cluster.devices[j].machine, 0) + 1
        name = key[1] + (f"@{key[0]}" if key[0] else "")
        name += f"#{len(out)}" if any(o.name == name for o in out) else ""  # same model, other figures
        out.append(SubCluster(name, tuple(devs), min(per_machine.values())))
    return tuple(out)


def pair_level(cluster: Cluster, i: int, j: int) -> str:
    """The link level between devices i and j (the levels of `engine.cluster`)."""
    a, b = cluster.devices[i], cluster.devices[j]
    if a.group and b.group and a.group != b.group:
        return "inter_group"
    return "intra_machine" if a.machine == b.machine else "inter_machine"


LEVEL_ORDER = ("intra_machine", "inter_machine", "inter_group")


def transfer_level(cluster: Cluster, a: SubCluster, b: SubCluster) -> str:
    """The slowest level between any device of `a` and any of `b` (within `a` when they are the same)."""
    levels = {pair_level(cluster, i, j) for i in a.devices for j in b.devices if i != j} or {"intra_machine"}
    return max(levels, key=LEVEL_ORDER.index)


def transfer_s(cluster: Cluster, level: str, nbytes: float) -> float:
    """Seconds to send `nbytes` point to point over `level`. A cluster with no links at all (one device, as
    `hap profile` on one rank describes it) sends nothing over any: its stages share the device."""
    if nbytes <= 0 or not cluster.network.bandwidth_Bps:
        return 0.0
    bandwidth = cluster.network.bandwidth_Bps.get(level) or min(cluster.network.bandwidth_Bps.values())
    return cluster.network.latency_s + nbytes / bandwidth


@dataclass(frozen=True)
class StagePrice:
    """One stage on one device group, for B microbatches."""

    forward_s: float
    """Per microbatch."""
    backward_s: float
    """Per microbatch."""
    sync_s: float
    """Once per iteration, after the stage's last backward: gradient all-reduce in the group and optimizer step."""
    state_bytes: tuple[float, ...]
    """Per GPU of each device of the group: parameters, gradients and optimizer state."""
    activation_bytes: tuple[float, ...]
    """Per GPU of each device of the group: activations kept per microbatch in flight."""
    capacity_bytes: tuple[float, ...]
    """Memory per GPU of each device of the group."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def memory_bytes(self, held: int) -> float:
        """Peak bytes per GPU on the fullest device with `held` microbatches in flight."""
        return max(s + held * a for s, a in zip(self.state_bytes, self.activation_bytes))

    @property
    def max_held(self) -> int:
        """Most microbatches in flight that fit every device's memory (-1: not even the state fits)."""
        most = math.inf
        for s, a, cap in zip(self.state_bytes, self.activation_bytes, self.capacity_bytes):
            if s > cap:
                return -1
            most = min(most, math.inf if a <= 0 else (cap - s) // a)
        return int(min(most, 1 << 30))


class StagePricer(Protocol):
    """Prices layers [start, end) of `stages` on cluster devices `devices` for `microbatches` microbatches."""

    def __call__(self, stages: StageGraph, start: int, end: int, devices: tuple[int, ...],
                 microbatches: int) -> StagePrice: ...


class DataParallelPricer:
    """HAP's cost model pricing a stage's data-parallel program on its group (see the module docstring)."""

    def __init__(self, cluster: Cluster, options: PlanOptions = PlanOptions()) -> None:
        self.cluster, self.options = cluster, options
        self._tables: dict[tuple, _GroupTable] = {}

    def __call__(self, stages: StageGraph, start: int, end: int, devices: tuple[int, ...],
                 microbatches: int) -> StagePrice:
        key = (id(stages), device_signature(self.cluster, devices))
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _GroupTable(stages, group_cluster(self.cluster, devices), self.options)
        return table.price(start, end, microbatches)


def device_signature(cluster: Cluster, devices: tuple[int, ...]) -> tuple:
    """What a group's costs depend on: each device's hardware and which devices share a machine or group."""
    machines = {m: k for k, m in enumerate(dict.fromkeys(cluster.devices[j].machine for j in devices))}
    groups = {g: k for k, g in enumerate(dict.fromkeys(cluster.devices[j].group for j in devices))}
    return tuple((_hardware(cluster.devices[j]), machines[cluster.devices[j].machine], groups[cluster.devices[j].group])
                 for j in devices)


def _hardware(d) -> tuple:
    return (d.gpu_model, d.flops_per_gpu, d.flops_by_dtype, d.memory_bytes_per_gpu, d.num_gpus, d.intra_bandwidth_Bps,
            d.memory_bandwidth_Bps, d.activation_bandwidth_Bps, d.op_overhead_s, d.overlap_slowdown)


def group_cluster(cluster: Cluster, devices: tuple[int, ...]) -> Cluster:
    """The cluster of `devices` alone (nominal collective fits for their own layout)."""
    d = cluster.to_dict()
    d["devices"] = [d["devices"][j] for j in devices]
    d["network"] = {**d["network"], "collectives": {}}
    return Cluster.from_dict(d)


class _GroupTable:
    """Per-layer prefix sums of the cost model's work and memory terms on one device group."""

    def __init__(self, stages: StageGraph, group: Cluster, options: PlanOptions) -> None:
        graph = stages.graph
        total = sum(group.flops)
        self.cm = CostModel(graph, group, [f / total for f in group.flops], options)  # ratios ~ flops
        derived = batch_derived(graph)
        rows = [[ZERO, ZERO, ZERO, MEM_ZERO, MEM_ZERO, 0.0] for _ in range(stages.num_layers)]
        for k, ids in enumerate(stages.layers):
            for i in ids:
                f, b, mem = self.cm.compute_delta(i, derived[i])
                row = rows[k]
                row[0], row[1], row[4] = add(row[0], f), add(row[1], b), add(row[4], mem)
        for p, k in first_layers(stages).items():
            sync, mem = self.cm.load_delta(p, FULL)
            row = rows[k]
            row[2], row[3], row[5] = add(row[2], sync), add(row[3], mem), row[5] + graph[p].nbytes
        self.prefix = [tuple(ZERO if j < 3 else (MEM_ZERO if j < 5 else 0.0) for j in range(6))]
        for row in rows:
            self.prefix.append(tuple(_plus(a, b) for a, b in zip(self.prefix[-1], row)))

    def price(self, start: int, end: int, microbatches: int) -> StagePrice:
        fwd, bwd, sync, state, act, param_bytes = (_minus(a, b) for a, b in zip(self.prefix[end], self.prefix[start]))
        cm, B = self.cm, microbatches
        per_mb = lambda w: (w[0] / B, w[1], 0.0, 0.0, w[4] / B, w[5], w[6])  # noqa: E731  sharded work splits in B
        all_reduce = cm.bucket_seconds(param_bytes)
        states = cm.memory_by_class(state)
        acts = cm.memory_by_class((0.0, 0.0, act[2] / B, act[3], 0.0))
        by_device = {j: k for k, c in enumerate(cm.classes) for j in c.devices}
        order = [by_device[j] for j in range(cm.cluster.num_devices)]
        return StagePrice(cm.stage_time(per_mb(fwd)), cm.stage_time(per_mb(bwd)), all_reduce + cm.stage_time(sync),
                          tuple(states[k] for k in order), tuple(acts[k] for k in order),
                          tuple(float(cm.classes[k].memory_bytes) for k in order))


def _plus(a, b):
    return a + b if isinstance(a, float) else add(a, b)


def _minus(a, b):
    return a - b if isinstance(a, float) else tuple(x - y for x, y in zip(a, b))


def batch_derived(graph: Graph) -> list[bool]:
    """Whether each node depends on a model input (it splits over the batch in data parallelism)."""
    out: list[bool] = []
    for n in graph.nodes:
        out.append(n.op == "placeholder" or (not n.is_leaf and any(out[i] for i in n.inputs)))
    return out


def first_layers(stages: StageGraph) -> dict[int, int]:
    """The layer of the first node that uses each parameter (the stage that holds it)."""
    out: dict[int, int] = {}
    for n in stages.order:
        for i in n.inputs:
            if stages.graph[i].op == "parameter" and i not in out:
                out[i] = stages.layer_of[n.id]
    return out
