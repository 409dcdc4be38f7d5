"""The cost model (HAP §3.2): stages, communication, computation and memory per device.

A program splits into stages at every synchronising collective. The iteration time is

    t(Q, B) = sum over stages i of [ comm_i(B) + max_j comp_ij(B_j) ]

counted for the forward and the backward pass. Backward stages mirror forward ones: each forward
collective has a dual in the backward pass (all-gather <-> reduce-scatter, ...). The gradients of
all Full parameters are all-reduced in one bucket after the backward pass, as the runner (and DDP
with one bucket) does: one latency, the summed bytes. Computation on device j is
flops / flops_j, times the ratio B_j when the instruction runs on a sharded dimension; inside a
virtual device of k GPUs the gradients of its parameters are also all-reduced (k > 1, §3.2).
Communication is `latency + payload / bandwidth` with the payload conventions of
`engine.cluster`: the largest shard (max_j B_j) for sharded collectives.

Memory per GPU (not in the paper, users need it): parameter, gradient and optimizer state of the
local slice of every parameter, plus the activations kept for the backward pass (split over the
k GPUs of a virtual device).

Everything here is linear in B_j (or in max_j B_j), which is what makes the load balancer an LP.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .graph import Graph
from .program import COMM, COMPUTE, LOAD, Instruction
from .theory.core import FULL

STATE_BYTES_PER_PARAM_BYTE = {"adam": 4, "sgd": 3, "none": 2}
"""Bytes kept per byte of parameter: the weight, its gradient, and the optimizer state (Adam: m, v; SGD: momentum)."""

DUAL = {"all_reduce": "all_reduce", "reduce_scatter": "all_gather.padded", "all_gather.padded": "reduce_scatter",
        "all_gather.grouped": "all_gather.grouped", "all_to_all": "all_to_all", "slice": "slice"}
"""The collective that runs in the backward pass for each forward collective (its dual)."""

Acc = tuple[float, float, float, float]
"""Linear work of a stage: (sharded flops, replicated flops, sharded sync bytes, replicated sync bytes)."""
ZERO: Acc = (0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class DeviceClass:
    """Devices that are interchangeable for the cost model (same hardware and ratio)."""

    devices: tuple[int, ...]
    flops: float
    memory_bytes: float
    num_gpus: int
    sync_s_per_byte: float
    """Seconds per gradient byte of the all-reduce inside the virtual device (0 for one GPU)."""
    ratio: float


def device_classes(cluster: Cluster, ratios: list[float] | None) -> tuple[DeviceClass, ...]:
    """Group devices with equal hardware (and equal ratio, when ratios are given)."""
    groups: dict[tuple, list[int]] = {}
    for j, d in enumerate(cluster.devices):
        key = (d.flops, d.memory_bytes_per_gpu, d.num_gpus, d.intra_bandwidth_Bps, None if ratios is None else round(ratios[j], 12))
        groups.setdefault(key, []).append(j)
    out = []
    for (flops, mem, k, intra, _), members in groups.items():
        sync = 2.0 * (k - 1) / k / intra if k > 1 else 0.0  # ring all-reduce inside the box
        out.append(DeviceClass(tuple(members), flops, float(mem), k, sync, 0.0 if ratios is None else ratios[members[0]]))
    return tuple(out)


@dataclass(frozen=True)
class Stage:
    """One stage: a collective that opens it (or none) and the computation that follows (HAP Fig. 6)."""

    direction: str
    """`forward` or `backward`."""
    comm: str
    """Collective key that opens the stage (`` for the first stage), `grad_all_reduce` for the gradient bucket."""
    comm_node: int
    """Reference tensor of the collective (-1 when none, and for the gradient bucket)."""
    comm_const: float
    """Part of the communication time independent of the ratios (latency, whole-tensor payloads)."""
    comm_per_max_ratio: float
    """Part of the communication time proportional to max_j B_j (largest-shard payloads)."""
    work: Acc


@dataclass
class Breakdown:
    """Predicted time of a program under given ratios, per stage and per device."""

    total_s: float
    stages: list[Stage]
    stage_comm_s: list[float]
    stage_comp_s: list[list[float]]
    """Per stage, the computation time of every device."""
    memory_bytes: list[float]
    """Predicted peak memory per GPU of every device."""


class CostModel:
    """Costs of instructions on a given cluster under given ratios B (one ratio per device)."""

    def __init__(self, graph: Graph, cluster: Cluster, ratios: list[float], optimizer: str = "adam") -> None:
        assert len(ratios) == cluster.num_devices, "one ratio per device"
        self.graph, self.cluster, self.ratios = graph, cluster, list(ratios)
        self.classes = device_classes(cluster, self.ratios)
        self.max_ratio = max(ratios)
        self.state_factor = STATE_BYTES_PER_PARAM_BYTE[optimizer]
        self.requires_grad = _requires_grad(graph)
        self.bwd_flops = [_backward_flops(graph, n.id, self.requires_grad) for n in graph.nodes]
        self.total_flops = sum(c.flops * len(c.devices) for c in self.classes)
        intra = [d.intra_bandwidth_Bps for d in cluster.devices if d.num_gpus > 1]
        self.hierarchy_s_per_byte = 2.0 / min(intra) if intra else 0.0  # gather to / broadcast from GPU 0 (§6)
        self.nbytes = [n.nbytes for n in graph.nodes]
        self._comm_cache: dict[tuple[str, int], float] = {}

    # --- communication ---------------------------------------------------------------------
    def comm_terms(self, key: str, node: int) -> tuple[float, float]:
        """(constant, per max-ratio) seconds of collective `key` on reference tensor `node`."""
        nbytes = self.nbytes[node]
        c = self.cluster.collectives
        m = self.cluster.num_devices
        if key == "slice" or m == 1:
            return 0.0, 0.0
        h = self.hierarchy_s_per_byte
        if key == "all_reduce":
            fit = c["all_reduce"]
            return fit.latency_s + nbytes / fit.bandwidth_Bps + nbytes * h, 0.0
        if key == "all_gather.grouped":
            fit = c["broadcast"]
            return m * fit.latency_s + nbytes / fit.bandwidth_Bps + nbytes * h / m, 0.0
        fit = c[{"all_gather.padded": "all_gather", "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all"}[key]]
        return fit.latency_s, nbytes / fit.bandwidth_Bps + nbytes * h

    def grad_bucket_terms(self) -> tuple[float, float]:
        """(latency, seconds per byte) of the one all-reduce of all Full parameters' gradients."""
        if self.cluster.num_devices == 1:
            return 0.0, 0.0
        fit = self.cluster.collectives["all_reduce"]
        return fit.latency_s, 1.0 / fit.bandwidth_Bps + self.hierarchy_s_per_byte

    def comm_time(self, key: str, node: int) -> float:
        t = self._comm_cache.get((key, node))
        if t is None:
            const, per = self.comm_terms(key, node)
            t = self._comm_cache[(key, node)] = const + per * self.max_ratio
        return t

    # --- computation -----------------------------------------------------------------------
    def class_times(self, acc: Acc) -> list[float]:
        s, r, ss, rs = acc
        return [(s * c.ratio + r) / c.flops + (ss * c.ratio + rs) * c.sync_s_per_byte for c in self.classes]

    def stage_time(self, acc: Acc) -> float:
        s, r, ss, rs = acc
        return max((s * c.ratio + r) / c.flops + (ss * c.ratio + rs) * c.sync_s_per_byte for c in self.classes)

    def device_times(self, acc: Acc) -> list[float]:
        out = [0.0] * self.cluster.num_devices
        for c, t in zip(self.classes, self.class_times(acc)):
            for j in c.devices:
                out[j] = t
        return out

    # --- memory ----------------------------------------------------------------------------
    def memory_by_class(self, mem: Acc) -> list[float]:
        """Per-GPU bytes from (sharded state, replicated state, sharded activations, replicated activations)."""
        s, r, sa, ra = mem
        return [s * c.ratio + r + (sa * c.ratio + ra) / c.num_gpus for c in self.classes]

    def fits(self, mem: Acc) -> bool:
        return all(b <= c.memory_bytes for b, c in zip(self.memory_by_class(mem), self.classes))

    # --- per-instruction deltas used by the search and by replay ---------------------------
    def compute_delta(self, node: int, sharded: bool) -> tuple[Acc, Acc, Acc]:
        """(forward work, backward work, memory) added by computing `node`."""
        n = self.graph[node]
        f, b = n.flops, self.bwd_flops[node]
        act = float(self.nbytes[node]) if self.requires_grad[node] and n.op not in ("view", "permute", "identity") else 0.0
        if sharded:
            return (f, 0.0, 0.0, 0.0), (b, 0.0, 0.0, 0.0), (0.0, 0.0, act, 0.0)
        return (0.0, f, 0.0, 0.0), (0.0, b, 0.0, 0.0), (0.0, 0.0, 0.0, act)

    def load_delta(self, node: int, form: int) -> tuple[Acc, Acc]:
        """(backward sync work, memory) of loading a leaf in `form`."""
        n = self.graph[node]
        if n.op != "parameter":
            return ZERO, ZERO
        nbytes = float(n.nbytes)
        state = nbytes * self.state_factor
        if form == FULL:
            return (0.0, 0.0, 0.0, nbytes), (0.0, state, 0.0, 0.0)
        return (0.0, 0.0, nbytes, 0.0), (state, 0.0, 0.0, 0.0)


def add(a: Acc, b: Acc) -> Acc:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


def _requires_grad(graph: Graph) -> list[bool]:
    out: list[bool] = []
    for n in graph.nodes:
        out.append(n.op == "parameter" or (not n.is_leaf and any(out[i] for i in n.inputs)))
    return out


def _backward_flops(graph: Graph, node: int, requires_grad: list[bool]) -> float:
    """About one forward's flops per operand that needs a gradient (2x for a matmul with a weight)."""
    n = graph[node]
    if n.is_leaf or not requires_grad[node]:
        return 0.0
    return n.flops * sum(1 for i in dict.fromkeys(n.inputs) if requires_grad[i])


def is_sharded(ins: Instruction) -> bool:
    return ins.post >= 0 or any(f >= 0 for _, f in ins.pre)


def replay(program: tuple[Instruction, ...], cm: CostModel) -> tuple[list[Stage], Acc]:
    """Split a program into forward and backward stages with linear work terms, and sum its memory terms.

    Backward stages are listed mirroring the forward ones (they run in reverse order); the gradient
    bucket, which runs last, is listed first among them.
    """
    stages: list[Stage] = []
    fwd, bwd, mem = ZERO, ZERO, ZERO
    fwd_open = bwd_open = ("", -1, 0.0, 0.0)
    bucket_bytes = 0.0
    for ins in program:
        if ins.kind == COMPUTE:
            f, b, a = cm.compute_delta(ins.node, is_sharded(ins))
            fwd, bwd, mem = add(fwd, f), add(bwd, b), add(mem, a)
        elif ins.kind == LOAD:
            sync, m = cm.load_delta(ins.node, ins.post)
            mem = add(mem, m)
            if cm.graph[ins.node].op == "parameter" and ins.post == FULL:
                bucket_bytes += cm.nbytes[ins.node]
            bwd = add(bwd, sync)
        elif ins.kind == COMM and ins.rule != "slice":
            stages.append(Stage("forward", *fwd_open, fwd))
            fwd_open, fwd = (ins.rule, ins.node, *cm.comm_terms(ins.rule, ins.node)), ZERO
            if cm.requires_grad[ins.node]:
                stages.append(Stage("backward", *bwd_open, bwd))
                dual = DUAL[ins.rule]
                bwd_open, bwd = (dual, ins.node, *cm.comm_terms(dual, ins.node)), ZERO
    stages.append(Stage("forward", *fwd_open, fwd))
    stages.append(Stage("backward", *bwd_open, bwd))
    if bucket_bytes:
        latency, per_byte = cm.grad_bucket_terms()
        first_bwd = next(i for i, s in enumerate(stages) if s.direction == "backward")
        stages.insert(first_bwd, Stage("backward", "grad_all_reduce", -1, latency + bucket_bytes * per_byte, 0.0, ZERO))
    return [s for s in stages if s.comm or any(s.work)], mem


def evaluate(program: tuple[Instruction, ...], cm: CostModel) -> Breakdown:
    """t(Q, B) with its breakdown per stage and device, and memory per device."""
    stages, mem = replay(program, cm)
    comm = [s.comm_const + s.comm_per_max_ratio * cm.max_ratio for s in stages]
    comp = [cm.device_times(s.work) for s in stages]
    total = sum(comm) + sum(max(c) for c in comp)
    per_class = cm.memory_by_class(mem)
    memory = [0.0] * cm.cluster.num_devices
    for c, b in zip(cm.classes, per_class):
        for j in c.devices:
            memory[j] = b
    return Breakdown(total, stages, comm, comp, memory)
