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
`engine.cluster`: the largest shard (max_j B_j) for sharded collectives. Where the spec's fit has
profiled points, every collective is read off them (`CollectiveFit.time`): an all-reduce (and a grouped
all-gather) at its payload, which does not depend on B; a sharded collective at max_j B_j times its
tensor (the search and `evaluate` look it up at the ratios they price; the LP takes the lower convex
hull of the points with one epigraph variable, `CostModel.comm_lines`, which is the same curve where
the points are convex and below it across a bump); a gradient bucket on the chord of the points from
the latency to its slot's whole size (`CostModel.bucket_line`: exact for a data-parallel bucket, and
additive per parameter as the search needs).

Memory-bound work per parameter byte (not in the paper; measured to matter on small models):
after the backward pass every device updates its local slice of every parameter (the optimizer
step, `UPDATE_TRAFFIC` bytes moved per parameter byte) and copies the Full parameters' gradients
into the bucket and the sum back out (`BUCKET_TRAFFIC`), at the device's `memory_bandwidth_Bps` (not priced
when the cluster spec leaves it out). Like the sync inside a virtual device, this work is linear
in the local parameter bytes and is counted in the backward stage that holds the parameter.

Roofline split (not in the paper; optional): when every device gives `activation_bandwidth_Bps`,
only the matmul-class operators (`FLOPS_BOUND_OPS`) are priced by flops at `flops_per_gpu`; every
other operator (element-wise ops, norms, softmax, losses, copies) by the bytes it reads and
writes (`BACKWARD_TRAFFIC` times as many in the backward pass) at that bandwidth. One FLOP/s
figure over-prices wide models when it was measured on a narrow one (the memory-bound share of
a step shrinks as the matmuls grow); `hap profile` fits both figures. A matmul-class operator
also moves the bytes of the weights it reads (and, backward, reads again and writes as gradients,
`WEIGHT_BACKWARD_TRAFFIC`): these do not shrink with a device's share of the batch, so a small
local batch is not priced as if its matmuls read a fraction of the weight. Bytes, like flops, scale
with B_j when the operator runs sharded, except the weights of a batch-parallel rule, which every
device reads whole; the model stays linear.

Fixed cost per operator run (not in the paper; `Device.op_overhead_s`, fitted by `hap profile`): every
node costs each device that much per run on top of its flops and bytes (framework dispatch, kernel
launch), one run forward and one backward when its result needs a gradient (`fwd_ops`, `bwd_ops`; two
each in duplex, whose halves both run it; a recomputed node runs forward again in backward). It does
not scale with the ratios: a device's slice of a sharded operator pays it whole. A run costs a CPU rank
about 4 us; on a GPU, a kernel launch of several, which a small model's many small operators are bound by.

Memory per GPU (not in the paper, users need it): parameter, gradient and optimizer state of the
local slice of every parameter, plus the activations kept for the backward pass (split over the
k GPUs of a virtual device): the tensors autograd saves, each in the form its saving instruction
receives it (`engine.spmd.saved`), not every operator's output.

Segments (§5.2): with several segments every segment k has its own ratios B_k; a stage lies
inside one segment and its work scales with that segment's ratios, and a tensor sharded across a
boundary is re-split by an all-to-all (`resplit`) whose payload is the larger of the two
segments' largest shards. Memory sums the segments' terms.

Options (`CostModel(..., options=)`, `engine.options.PlanOptions`): the optimizer sets the state kept
per parameter byte and the update traffic; every later concern of the options is one term here.

Mixed precision (`precision` bf16 or fp16, `grad_dtype`; the rules and their reasons in
`engine.spmd.precision`):
- matmul-class operators (`precision.AUTOCAST_OPS`) are priced at the dtype's rate (`DeviceClass.flops`);
  without the roofline split the other operators' flops keep the fp32 rate: they go in the work's
  activation slots, priced per flop at `DeviceClass.activation_s_per_byte` = 1 / fp32 rate;
- activations (non-leaf float32 tensors) take 2 bytes an element: kept memory, roofline traffic and the
  payloads of the collectives that move them (and of their duals) halve (`CostModel.nbytes`);
- parameters, gradients and optimizer state stay fp32 (`STATE_BYTES_PER_PARAM_BYTE`: Adam 16 bytes a
  parameter); autocast's cast cache adds 2 bytes per parameter an autocast op reads (`load_delta`);
- gradients are all-reduced in fp32, or with `grad_dtype` bf16 in a bf16 bucket: half the bytes on the
  wire (`bucket_line`, and the sync inside a virtual device), 3/4 of the bucket copies.

Overlap (`CostModel(..., overlap=)`, `engine.spmd.overlap`): mode `none` is the model above. In the
modes `ddp` and `duplex` the per-parameter-byte work (update, bucket copies, sync inside a virtual
device) is a tail after every gradient all-reduce, U = max over devices of its work, and the Full
parameters' gradients go in DDP's buckets (`engine.spmd.overlap.bucket_slots`), one latency each:

- ddp: forward as above (F). Backward stages run in reverse forward order, each its compute then
  its dual collective: a chain of W seconds. Bucket k is ready when the backward stage that loaded
  its earliest-used Full parameter has computed, r_k = W - w_k (w_k: the chain after that point),
  and the buckets queue on the link: T = F + max(W, max_k (r_k + sum_{j>=k} d_j)) + U.
- duplex (HiDup): each device's share runs as two half-batches. Per pass, the chain
  x = (m_0, c_0, m_1, c_1, ...) of per-half collectives m_i (a batch-derived tensor moves half its
  payload, a parameter-only one all of it) and half computations c_i = max_j comp_ij / 2 costs
  psi = x_0 + sum_k max(x_k, x_{k+1}) + x_last (Eq. 5 telescoped); T = psi_f + psi_b + sum_k d_k + U.

Activation collectives and gradient buckets are not modelled as contending for the link.

Everything here is linear in B_j (or in max_j B_j) or a max of such terms, which is what makes the
load balancer an LP; the one exception, the measured points of a sharded collective, enters the LP as
their convex hull (above), and every plan is priced by `evaluate` on the points themselves.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from engine.cluster.hierarchy import HIER_KEYS, hierarchy_of
from engine.cluster.spec import Cluster
from engine.errors import PlanError
from engine.model.graph import Graph
from engine.options import OVERLAP_MODES, PlanOptions
from engine.spmd import precision as mixed
from engine.spmd.breakdown import MEM_ZERO, ZERO, Acc, Breakdown, BucketRecord, Mem, Stage
from engine.spmd.overlap import batch_derived, bucket_slots, duplex_problem
from engine.spmd.overlap import price as overlap_price
from engine.spmd.program import COMM, COMPUTE, LOAD, Instruction
from engine.spmd.recompute import instruction_layers, layer_outputs, recomputed_nodes, search_reserve, transient_peak
from engine.spmd.saved import kept_split, requires_grad, saves_by_node
from engine.spmd.segments import RESPLIT, Segmentation, instruction_segments, source_segments
from engine.spmd.zero import StateSharding, StatesTerms, comm_terms, state_memory, states_terms, transient_bytes
from engine.theory.core import FULL

DEFAULT_OPTIONS = PlanOptions()
STATE_BYTES_PER_PARAM_BYTE = {"adam": 4, "sgd": 3, "none": 2}
"""Bytes kept per byte of parameter: the weight, its gradient, and the optimizer state (Adam: m, v; SGD:
a momentum buffer, kept in the count so that a plan stays valid with momentum)."""
UPDATE_TRAFFIC = {"adam": 16.0, "sgd": 3.0, "none": 0.0}
"""Bytes read and written per parameter byte by one optimizer step, as PyTorch's multi-tensor
implementations run it: SGD reads w and g and writes w; Adam's passes over g, m, v and w move
about 16 (these are the runner's optimizers, `runner.train.make_optimizer`)."""
BACKWARD_TRAFFIC = 2.0
"""Backward bytes of a memory-bound operator per forward byte: it reads the output's gradient and
what it saved, and writes its inputs' gradients (about twice the forward's reads and writes)."""
WEIGHT_BACKWARD_TRAFFIC = 2.0
"""Backward bytes of a matmul-class operator's weights per forward byte: it reads them again for its
input's gradient and writes their gradient."""
BUCKET_TRAFFIC = 4.0
"""Bytes moved per gradient byte of a Full parameter by the device around its gradient all-reduce:
building the bucket (read the gradients, write the flat bucket) and copying the sum back (read +
write). The runner does both on the device outside the collective (`runner.collectives.all_reduce_coalesced`,
`runner.overlap`), so a slower device takes longer over them, as `hap profile`'s update measurement
shows. (The all-reduce fit, timed on a fresh copy, also holds one copy: a small overlap, since the
network moves the bytes far more slowly than the device copies them.)"""

_FIT = {"all_gather.padded": "all_gather", "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all",
        RESPLIT: "all_to_all"}
"""The cluster's fitted collective that prices each collective key (all-reduce and the grouped
all-gather, priced from `all_reduce` and `broadcast`, are spelled out in `CostModel.comm_terms`)."""

DUAL = {"all_reduce": "all_reduce", "reduce_scatter": "all_gather.padded", "all_gather.padded": "reduce_scatter",
        "all_gather.grouped": "reduce_scatter", "all_to_all": "all_to_all", "slice": "slice", RESPLIT: RESPLIT,
        "all_reduce.hier": "all_reduce.hier", "all_gather.hier": "reduce_scatter.hier",
        "reduce_scatter.hier": "all_gather.hier"}
"""The collective that runs in the backward pass for each forward collective (its dual), as the runner
runs it: both flat all-gathers reduce-scatter their gradient (`runner.collectives.AllGather`). A grouped
all-gather's backward is not priced as m reduces: on gloo those are no faster than one reduce-scatter.
A hierarchical collective's dual is hierarchical too (`engine.cluster.hierarchy`)."""

FLOPS_BOUND_OPS = frozenset({"linear", "matmul", "einsum", "conv", "sdpa", "opaque"})
"""Operators priced by their flops at flops_per_gpu even under the roofline split (matmul-class;
`opaque` ops, whose bytes are unknown, keep their flops estimate)."""
ZERO_COPY_OPS = frozenset({"view", "permute", "expand", "narrow", "select", "identity", "stage_output"})
"""Operators that return a view: no bytes moved under the roofline split. (What each operator keeps
for backward is `engine.spmd.saved`'s.)"""
GATHER_OPS = frozenset({"embedding", "gather"})
"""Operators that read only the rows they return from their table (not the whole table)."""


@dataclass(frozen=True)
class DeviceClass:
    """Devices that are interchangeable for the cost model (same hardware and ratios in every segment)."""

    devices: tuple[int, ...]
    flops: float
    memory_bytes: float
    num_gpus: int
    sharded_param_s_per_byte: float
    """Seconds per byte of a sharded parameter's local slice: the gradient all-reduce inside the
    virtual device (0 for one GPU) and the optimizer update."""
    full_param_s_per_byte: float
    """Seconds per byte of a Full parameter: the same, plus the copies into and out of the gradient bucket."""
    activation_s_per_byte: float
    """Seconds per byte moved by a memory-bound operator (0 without the roofline split)."""
    ratios: tuple[float, ...]
    """The ratio of each of its devices in every segment (empty when grouping by hardware only)."""
    op_s: float = 0.0
    """Seconds of each operator run besides its work (`Device.op_overhead_s`, slowed in the overlap mode)."""


def device_classes(cluster: Cluster, ratios: list[list[float]] | None, optimizer: str = "adam",
                   overlap: str = "none", precision: str = "fp32", grad_dtype: str = "fp32") -> tuple[DeviceClass, ...]:
    """Group devices with equal hardware (and equal ratios per segment, when `ratios[segment][device]` are given).
    Their compute rates are those of overlap mode `overlap` (`Device.overlap_slowdown`) in `precision`."""
    groups: dict[tuple, list[int]] = {}
    roofline = all(d.activation_bandwidth_Bps for d in cluster.devices)
    for j, d in enumerate(cluster.devices):
        mine = () if ratios is None else tuple(round(row[j], 12) for row in ratios)
        key = (mixed.device_flops(d, precision) / d.slowdown(overlap), d.memory_bytes_per_gpu, d.num_gpus,
               d.intra_bandwidth_Bps, d.memory_bandwidth_Bps,
               d.activation_bandwidth_Bps and d.activation_bandwidth_Bps / d.slowdown(overlap),
               mine, d.flops / d.slowdown(overlap), d.op_overhead_s * d.slowdown(overlap))
        groups.setdefault(key, []).append(j)
    out = []
    for (flops, mem, k, intra, mem_bw, act_bw, _, fp32_flops, op_s), members in groups.items():
        sync = 2.0 * (k - 1) / k / intra * mixed.GRAD_WIRE[grad_dtype] if k > 1 else 0.0  # ring all-reduce inside the box
        update = UPDATE_TRAFFIC[optimizer] / mem_bw if mem_bw else 0.0
        bucket = BUCKET_TRAFFIC * mixed.GRAD_BUCKET_TRAFFIC[grad_dtype] / mem_bw \
            if mem_bw and cluster.num_devices > 1 else 0.0
        mine = () if ratios is None else tuple(row[members[0]] for row in ratios)
        act = 1.0 / (k * act_bw) if act_bw else 0.0  # the k GPUs of a virtual device split its activations
        if mixed.is_mixed(precision) and not roofline:
            act = 1.0 / fp32_flops  # the activation slots hold the non-matmul flops, at the fp32 rate
        out.append(DeviceClass(tuple(members), flops, float(mem), k, sync + update, sync + update + bucket, act, mine,
                               op_s))
    return tuple(out)


def ratio_rows(ratios: list[float] | list[list[float]], segments: int, devices: int) -> list[list[float]]:
    """Ratios as one row per segment: a flat list (one segment's worth) is shared by every segment."""
    rows = [list(r) for r in ratios] if ratios and isinstance(ratios[0], (list, tuple)) else [list(ratios)] * segments
    assert len(rows) == segments and all(len(r) == devices for r in rows), "one ratio per device and segment"
    return rows


class CostModel:
    """Costs of instructions on a given cluster under given ratios B (one ratio per device)."""

    def __init__(self, graph: Graph, cluster: Cluster, ratios: list[float] | list[list[float]],
                 options: PlanOptions = DEFAULT_OPTIONS, segmentation: Segmentation | None = None,
                 overlap: str = "none", recompute: frozenset[int] = frozenset(),
                 states: StateSharding | None = None) -> None:
        if overlap not in OVERLAP_MODES:
            raise PlanError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, got {overlap!r}")
        if overlap == "duplex" and (why := duplex_problem(graph)):
            raise PlanError(why)
        self.overlap = overlap
        self.graph, self.cluster = graph, cluster
        self.segmentation = segmentation or Segmentation.single(graph)
        self.ratios = ratio_rows(ratios, self.segmentation.count, cluster.num_devices)
        self.options = options
        """The plan's options; each concern they carry (the optimizer's state and update) is one term here."""
        mixed.check_rates(cluster, options.precision)
        shares = [list(states.shares)] if states else []  # a trailing row: devices of one class share a share too
        self.classes = device_classes(cluster, self.ratios + shares, options.optimizer, overlap, options.precision,
                                      options.grad_dtype)
        self.max_ratios = [max(r) for r in self.ratios]
        self.state_factor = STATE_BYTES_PER_PARAM_BYTE[options.optimizer]
        self.activation_scale = mixed.ACTIVATION_BYTES[options.precision]
        self.requires_grad = requires_grad(graph)
        self.roofline = all(d.activation_bandwidth_Bps for d in cluster.devices)
        priced = mixed.priced_bytes(graph, options.precision)
        self.saves = saves_by_node(graph, self.requires_grad, priced)
        """What each instruction keeps for backward (`engine.spmd.saved.saves_by_node`), in the plan's bytes."""
        self.traffic = [_traffic(graph, n.id, priced) if self.roofline and _memory_bound(n) else 0.0 for n in graph.nodes]
        """Forward bytes moved by each memory-bound operator (all zero without the roofline split)."""
        self.fwd_flops = [0.0 if self.traffic[n.id] else n.flops for n in graph.nodes]
        """Forward flops priced at flops_per_gpu: every operator's, or only the flops-bound ones' under the split."""
        self.bwd_flops = [0.0 if self.traffic[n.id] else _backward_flops(graph, n.id, self.requires_grad)
                          for n in graph.nodes]
        self.bwd_traffic = [BACKWARD_TRAFFIC * b if self.requires_grad[i] else 0.0 for i, b in enumerate(self.traffic)]
        self.weight_traffic = [_weight_traffic(graph, n.id) if self.roofline and n.op in WEIGHT_READ_OPS else 0.0
                               for n in graph.nodes]
        """Forward bytes of the parameters a matmul-class operator reads (under the roofline split): they do
        not shrink with the local batch, so a device with a small share of it is not priced too cheaply."""
        self.bwd_weight_traffic = [WEIGHT_BACKWARD_TRAFFIC * b if self.requires_grad[i] else 0.0
                                   for i, b in enumerate(self.weight_traffic)]
        runs = 2.0 if overlap == "duplex" else 1.0  # each duplex half runs every operator
        self.fwd_ops = [0.0 if n.is_leaf else runs for n in graph.nodes]
        """Forward runs of each operator per step, priced at `Device.op_overhead_s` each."""
        self.bwd_ops = [runs if self.requires_grad[n.id] and not n.is_leaf else 0.0 for n in graph.nodes]
        """Backward runs: one per operator whose result needs a gradient (autograd runs its backward)."""
        self.total_flops = sum(c.flops * len(c.devices) for c in self.classes)
        intra = [d.intra_bandwidth_Bps for d in cluster.devices if d.num_gpus > 1]
        self.hierarchy_s_per_byte = 2.0 / min(intra) if intra else 0.0  # gather to / broadcast from GPU 0 (§6)
        self.levels = hierarchy_of(cluster) if overlap != "duplex" else None  # duplex streams own no machine sub-groups
        """Machine and peer link levels for the `.hier` collectives (None: not offered on this cluster)."""
        self.nbytes = priced
        """Bytes of every tensor as the plan runs it (activations at 2 bytes an element under mixed precision)."""
        self.cast_params = mixed.cast_parameters(graph) if mixed.is_mixed(options.precision) else frozenset()
        """Parameters whose low-precision copy autocast caches (`engine.spmd.precision.CAST_CACHE_BYTES`)."""
        if mixed.is_mixed(options.precision) and not self.roofline:
            self._flops_at_fp32_rate()
        self._comm_cache: dict[tuple[str, int], float] = {}
        self.batch_derived = batch_derived(graph) if overlap == "duplex" else []
        """Duplex: whether each tensor splits with the batch (each half moves half of it)."""
        self._slots: list[list[int]] | None = None
        self._bucket_lines: dict[int | None, tuple[float, float]] = {}
        self.states = states
        """Stages and shares of the Full weights' states (`engine.spmd.zero`); None: all at stage 0."""
        self.shares = [states.shares[c.devices[0]] for c in self.classes] if states else [0.0] * len(self.classes)
        self.transient_bytes = transient_bytes(graph, states)
        """Transient bytes per GPU of the staged weights (gathered stage-3 weights, a stage-2 gradient)."""
        self.recompute = frozenset(recompute)
        """Layers whose activations are recomputed in backward (`engine.spmd.recompute`): empty by default."""
        if self.recompute:
            self._recompute_terms()

    def _recompute_terms(self) -> None:
        """Recomputation's terms (`engine.spmd.recompute`): a recomputed node's forward work joins its
        backward work; it keeps its activation only when another layer consumes it."""
        self.recomputed = recomputed_nodes(self.graph, self.recompute)
        self.full_activation = [sum(b for _, b in self.saves[n.id]) + _attention_probs_bytes(self.graph, n.id) *
                                self.activation_scale if self.requires_grad[n.id] else 0.0 for n in self.graph.nodes]
        """What each node keeps for backward when it is not recomputed: a recomputed layer holds it again
        while its backward runs (`engine.spmd.recompute.transient_peak`)."""
        self.kept = [not r or o for r, o in zip(self.recomputed, layer_outputs(self.graph))]
        for i, again in enumerate(self.recomputed):
            if again:
                self.bwd_flops[i] += self.fwd_flops[i]
                self.bwd_traffic[i] += self.traffic[i]
                self.bwd_weight_traffic[i] += self.weight_traffic[i]
                self.bwd_ops[i] += self.fwd_ops[i]
        self.reserve = search_reserve(self)

    def _flops_at_fp32_rate(self) -> None:
        """Mixed precision without the roofline split: the flops of operators autocast leaves in fp32 move
        to the activation slots, which `DeviceClass.activation_s_per_byte` prices at the fp32 rate."""
        for n in self.graph.nodes:
            if not n.is_leaf and n.op not in mixed.AUTOCAST_OPS:
                self.traffic[n.id], self.bwd_traffic[n.id] = self.fwd_flops[n.id], self.bwd_flops[n.id]
                self.fwd_flops[n.id] = self.bwd_flops[n.id] = 0.0

    @property
    def slots(self) -> list[list[int]]:
        """DDP's bucket slots of the graph (`engine.spmd.overlap.bucket_slots`), computed once."""
        if self._slots is None:
            self._slots = bucket_slots(self.graph)
        return self._slots

    # --- communication ---------------------------------------------------------------------
    def comm_terms(self, key: str, node: int) -> tuple[float, float]:
        """(constant, per max-ratio) seconds of collective `key` on reference tensor `node`."""
        return self._terms(key, float(self.nbytes[node]))

    def _terms(self, key: str, nbytes: float) -> tuple[float, float]:
        """`comm_terms` of a tensor of `nbytes` on the fitted line. The payload of an all-reduce and of a
        grouped all-gather does not depend on the ratios, so they are read off the fit's measured points
        where it has them (`CollectiveFit.time`); a sharded collective's payload is max_j B_j times the
        tensor: its line here, its measured points in `_seconds` and `_lines`."""
        c = self.cluster.collectives
        m = self.cluster.num_devices
        if key == "slice" or m == 1:
            return 0.0, 0.0
        h = self.hierarchy_s_per_byte
        if key in HIER_KEYS:  # not offered: never cheaper than the flat collective the search also sees
            if self.levels is None:
                return math.inf, 0.0
            const, per = self.levels.terms(key, nbytes)
            return (const + nbytes * h, per) if key == "all_reduce.hier" else (const, per + nbytes * h)
        if key == "all_reduce":
            return c["all_reduce"].time(nbytes) + nbytes * h, 0.0
        if key == "all_gather.grouped":  # m broadcasts of a 1/m share each
            return m * c["broadcast"].time(nbytes / m) + nbytes * h / m, 0.0
        fit = c[_FIT[key]]
        return fit.latency_s, nbytes / fit.bandwidth_Bps + nbytes * h

    def _sharded_fit(self, key: str):
        """The fit of a sharded collective `key` when it has measured points to read (else None)."""
        fit = self.cluster.collectives[_FIT[key]] if key in _FIT and self.cluster.num_devices > 1 else None
        return fit if fit is not None and fit.points else None

    def _seconds(self, key: str, nbytes: float, top: float) -> float:
        """Seconds of collective `key` on a tensor of `nbytes` when the largest ratio is `top`: a sharded
        collective with measured points reads its payload top * nbytes off them (`CollectiveFit.time`)."""
        fit = self._sharded_fit(key)
        if fit is None:
            const, per = self._terms(key, nbytes)
            return const + per * top
        return fit.time(top * nbytes) + top * nbytes * self.hierarchy_s_per_byte

    def _lines(self, key: str, nbytes: float) -> tuple[tuple[float, float], ...]:
        """(constant, per max-ratio) lines whose maximum over top in 0..1 is the lower convex hull of
        `_seconds` (the LP's form of it; `CollectiveFit.lines`): the one line of `_terms` without points."""
        fit = self._sharded_fit(key)
        if fit is None:
            return (self._terms(key, nbytes),)
        h = self.hierarchy_s_per_byte
        return tuple((const, (per + h) * nbytes) for const, per in fit.lines(nbytes))

    def comm_lines(self, key: str, node: int, half: bool = False) -> tuple[tuple[float, float], ...]:
        """`_lines` of collective `key` on `node`, for one duplex half when `half` (`half_comm_seconds`)."""
        return self._lines(key, self._half_bytes(key, node) if half else float(self.nbytes[node]))

    def _half_bytes(self, key: str, node: int) -> float:
        """Bytes of `node` one duplex half moves by `key`: half a batch-derived tensor, all of another."""
        halved = self.batch_derived[node] and key != "slice" and self.cluster.num_devices > 1
        return self.nbytes[node] / 2 if halved else float(self.nbytes[node])

    def half_comm_seconds(self, key: str, node: int, top: float) -> float:
        """Seconds of collective `key` on `node` for one duplex half when the largest ratio is `top`: the
        latency and half the payload of a batch-derived tensor, all of a parameter-only one's
        (`engine.spmd.overlap.batch_derived`), off the measured points where they are (`_seconds`)."""
        if not key or node < 0:
            return 0.0
        return self._seconds(key, self._half_bytes(key, node), top)

    def stage_comm_lines(self, st: Stage, half: bool = False) -> tuple[tuple[float, float], ...]:
        """`comm_lines` of stage `st`'s collective (for one duplex half when `half`); the one gradient
        bucket of mode none (node -1) keeps the price replay gave it."""
        if st.comm_node < 0 or not st.comm:
            return ((0.0, 0.0),) if half else ((st.comm_const, st.comm_per_max_ratio),)
        return self.comm_lines(st.comm, st.comm_node, half)

    def stage_comm_s(self, st: Stage, top: float) -> float:
        """Seconds of stage `st`'s collective when the largest ratio of its segments is `top`."""
        if st.comm_node < 0 or not st.comm:  # the one gradient bucket (its price fixed by replay), or none
            return st.comm_const + st.comm_per_max_ratio * top
        return self._seconds(st.comm, float(self.nbytes[st.comm_node]), top)

    def bucket_line(self, slot: int | None) -> tuple[float, float]:
        """(latency, seconds per parameter byte) of the gradient all-reduce of bucket `slot` of `slots`
        (None: mode none's one bucket): the chord of the all-reduce's measured points from the latency
        to the slot's whole size (`CollectiveFit.chord_s_per_byte`), exact when every parameter of the
        slot is Full, as in data parallelism. A chord keeps the price additive per parameter, which the
        search needs (a state does not carry its bucket's bytes)."""
        if self.cluster.num_devices == 1:
            return 0.0, 0.0
        got = self._bucket_lines.get(slot)
        if got is None:
            members = [p for s in self.slots for p in s] if slot is None else self.slots[slot]
            wire = mixed.GRAD_WIRE[self.options.grad_dtype]
            fit = self.cluster.collectives["all_reduce"]
            per = fit.chord_s_per_byte(sum(self.nbytes[p] for p in members) * wire)
            got = self._bucket_lines[slot] = (fit.latency_s, (per + self.hierarchy_s_per_byte) * wire)
        return got

    def bucket_seconds(self, param_bytes: float) -> float:
        """Seconds of one gradient all-reduce of `param_bytes` of parameters, read off the measured points
        (a pipeline stage's bucket, whose bytes are known): `bucket_line`'s wire bytes at their point."""
        if self.cluster.num_devices == 1 or not param_bytes:
            return 0.0
        wire_bytes = param_bytes * mixed.GRAD_WIRE[self.options.grad_dtype]
        return self.cluster.collectives["all_reduce"].time(wire_bytes) + wire_bytes * self.hierarchy_s_per_byte

    def comm_time(self, key: str, node: int, segments: tuple[int, ...] = (0,)) -> float:
        """Seconds of collective `key` on `node` while `segments`' ratios bound its payload."""
        t = self._comm_cache.get((key, node, segments))
        if t is None:
            top = max(self.max_ratios[k] for k in segments)
            t = self._comm_cache[(key, node, segments)] = self._seconds(key, float(self.nbytes[node]), top)
        return t

    # --- computation -----------------------------------------------------------------------
    def class_times(self, acc: Acc, segment: int = 0) -> list[float]:
        """`class_work` of every class, inlined (the search's hottest call; the same arithmetic, term for term)."""
        s, r, ss, rs, ts, tr, o = acc
        return [((s * q + r) / c.flops + ss * q * c.sharded_param_s_per_byte + rs * c.full_param_s_per_byte
                 + (ts * q + tr) * c.activation_s_per_byte + o * c.op_s) for c in self.classes for q in (c.ratios[segment],)]

    def stage_time(self, acc: Acc, segment: int = 0) -> float:
        return max(self.class_times(acc, segment))

    def device_times(self, acc: Acc, segment: int = 0) -> list[float]:
        out = [0.0] * self.cluster.num_devices
        for c, t in zip(self.classes, self.class_times(acc, segment)):
            for j in c.devices:
                out[j] = t
        return out

    # --- memory ----------------------------------------------------------------------------
    def memory_by_class(self, mem: Mem, segment: int = 0) -> tuple[float, ...]:
        """Per-GPU bytes from (sharded state, replicated state, sharded activations, replicated activations)."""
        s, r, sa, ra, zs = mem
        return tuple(s * c.ratios[segment] + r + (sa * c.ratios[segment] + ra) / c.num_gpus + zs * z
                     for c, z in zip(self.classes, self.shares))

    def class_memory(self, mems: list[Mem]) -> tuple[float, ...]:
        """Per-GPU bytes of every class, summed over the segments' memory terms."""
        out = (0.0,) * len(self.classes)
        for k, mem in enumerate(mems):
            out = add(out, self.memory_by_class(mem, k))
        return out

    def fits(self, class_bytes: tuple[float, ...]) -> bool:
        reserve = self.reserve if self.recompute else (0.0,) * len(self.classes)  # engine.spmd.recompute
        return all(b + t + self.transient_bytes <= c.memory_bytes for b, t, c in zip(class_bytes, reserve, self.classes))

    # --- per-instruction deltas used by the search and by replay ---------------------------
    def compute_delta(self, node: int, sharded: bool, weights_whole: bool = True,
                      forms: tuple[tuple[int, ...], int] | None = None) -> tuple[Acc, Acc, Mem]:
        """(forward work, backward work, memory) added by computing `node`. A sharded rule's work scales
        with the device's ratio, but the weights it reads only where they are sharded too
        (`weights_whole` False): a batch-parallel matmul reads the whole weight on every device.
        The memory is what the instruction keeps for backward in its rule's `forms` (operand forms,
        result form; `activation_memory`), or with every form sharded or not as `sharded` says."""
        f, b = self.fwd_flops[node], self.bwd_flops[node]
        tf, tb = self.traffic[node], self.bwd_traffic[node]
        wf, wb = self.weight_traffic[node], self.bwd_weight_traffic[node]
        of, ob = self.fwd_ops[node], self.bwd_ops[node]
        if forms is None:
            form = 0 if sharded else FULL
            forms = ((form,) * len(self.graph[node].inputs), form)
        mem = self.activation_memory(node, *forms)
        if self.recompute and self.recomputed[node]:
            mem = self.checkpoint_memory(node, forms[1])  # recomputed in backward (engine.spmd.recompute)
        if sharded and weights_whole:
            return (f, 0.0, 0.0, 0.0, tf, wf, of), (b, 0.0, 0.0, 0.0, tb, wb, ob), mem
        if sharded:
            return (f, 0.0, 0.0, 0.0, tf + wf, 0.0, of), (b, 0.0, 0.0, 0.0, tb + wb, 0.0, ob), mem
        return (0.0, f, 0.0, 0.0, 0.0, tf + wf, of), (0.0, b, 0.0, 0.0, 0.0, tb + wb, ob), mem

    def checkpoint_memory(self, node: int, output: int) -> Mem:
        """What a recomputed node keeps: its result when another layer consumes it (the next
        checkpoint's input, which autograd keeps), nothing otherwise (`engine.spmd.recompute`)."""
        if not self.kept[node]:
            return MEM_ZERO
        out = float(self.nbytes[node])
        return (0.0, 0.0, out, 0.0, 0.0) if output >= 0 else (0.0, 0.0, 0.0, out, 0.0)

    def activation_memory(self, node: int, inputs: tuple[int, ...], output: int) -> Mem:
        """Memory terms of what computing `node` keeps for backward with operands in forms `inputs` and
        its result in form `output` (`engine.spmd.saved`), plus attention's dropout probabilities."""
        sharded, replicated = kept_split(self.saves[node], inputs, output)
        probs = _attention_probs_bytes(self.graph, node) * self.activation_scale if self.requires_grad[node] else 0.0
        if output >= 0 or any(f >= 0 for f in inputs):
            return 0.0, 0.0, sharded + probs, replicated, 0.0
        return 0.0, 0.0, sharded, replicated + probs, 0.0

    def weights_whole(self, node: int, forms: tuple[int, ...]) -> bool:
        """Whether a rule with operand `forms` reads every parameter operand of `node` whole."""
        return all(f == FULL for t, f in zip(self.graph[node].inputs, forms) if self.graph[t].op == "parameter")

    def load_delta(self, node: int, form: int) -> tuple[Acc, Mem]:
        """(backward per-parameter-byte work, memory) of loading a leaf in `form`."""
        n = self.graph[node]
        if n.op != "parameter":
            return ZERO, MEM_ZERO
        nbytes = float(n.nbytes)
        state = nbytes * self.state_factor
        cache = nbytes * mixed.CAST_CACHE_BYTES[self.options.precision] if node in self.cast_params else 0.0
        if form == FULL and self.states is not None and self.states.stage(node):  # its work: `states_time`
            whole, split = state_memory(self.states.stage(node), nbytes, self.state_factor)
            return ZERO, (0.0, whole + cache, 0.0, 0.0, split)  # autocast caches the whole weight's copy
        state += cache
        if form == FULL:
            return (0.0, 0.0, 0.0, nbytes, 0.0, 0.0, 0.0), (0.0, state, 0.0, 0.0, 0.0)
        return (0.0, 0.0, nbytes, 0.0, 0.0, 0.0, 0.0), (state, 0.0, 0.0, 0.0, 0.0)

    def states_terms(self, program: tuple[Instruction, ...]) -> StatesTerms:
        """The program's staged weights (`engine.spmd.zero.states_terms`)."""
        return states_terms(program, self.graph, self.states)

    def states_comm_terms(self, t: StatesTerms) -> tuple[float, float]:
        """(constant, per largest share) seconds of the staged weights' reduce-scatters and all-gathers."""
        if self.cluster.num_devices == 1:
            return 0.0, 0.0
        return comm_terms(t, self._terms("reduce_scatter", 1.0), self._terms("all_gather.padded", 1.0))

    def states_work(self, t: StatesTerms, c: DeviceClass, share) -> float:
        """Seconds of the staged weights' per-byte work on class `c` holding `share` of their state: the
        bucket copies and the sync inside a virtual device on all of them, the optimizer update on its
        share (`share` may be an LP variable)."""
        whole = c.full_param_s_per_byte - c.sharded_param_s_per_byte + self.sync_s_per_byte(c)
        return t.staged_bytes * (whole + (c.sharded_param_s_per_byte - self.sync_s_per_byte(c)) * share)

    def sync_s_per_byte(self, c: DeviceClass) -> float:
        """Seconds per byte of the gradient all-reduce inside a virtual device of class `c` (0 for one GPU)."""
        d = self.cluster.devices[c.devices[0]]
        return 2.0 * (c.num_gpus - 1) / c.num_gpus / d.intra_bandwidth_Bps if c.num_gpus > 1 else 0.0

    def states_time(self, t: StatesTerms) -> float:
        """Seconds the staged weights add after backward at this model's shares."""
        if not t.any:
            return 0.0
        const, per = self.states_comm_terms(t)
        return const + per * max(self.shares) + max(self.states_work(t, c, z) for c, z in zip(self.classes, self.shares))


def class_work(acc: Acc, c: DeviceClass, ratio) -> float:
    """Seconds of a stage's linear work on one device of class `c` holding `ratio` of the sharded work
    (`ratio` may be an LP variable: the expression stays linear in it)."""
    s, r, ss, rs, ts, tr, o = acc
    return ((s * ratio + r) / c.flops + ss * ratio * c.sharded_param_s_per_byte + rs * c.full_param_s_per_byte
            + (ts * ratio + tr) * c.activation_s_per_byte + o * c.op_s)


def _attention_probs_bytes(graph: Graph, node: int) -> float:
    """Attention with dropout also keeps, for backward, its probabilities (..., Tq, Tk) before and
    after dropout and the boolean mask: it runs in math form (engine/model/dropout.py); without dropout,
    attention keeps none of them."""
    n = graph[node]
    if n.op != "sdpa" or "rng_site" not in n.attrs:
        return 0.0
    from engine.model.dropout import \
        attention_weights_shape  # here, not at the top: it imports torch, which the CLI's checks must not wait for

    q, k = graph[n.inputs[0]], graph[n.inputs[1]]
    numel = math.prod(attention_weights_shape(q.shape, k.shape, n.attrs.get("enable_gqa", False)))
    return float(numel * (2 * (n.nbytes // max(n.numel, 1)) + 1))


def _memory_bound(n) -> bool:
    """Priced by the bytes it moves under the roofline split: neither matmul-class nor a view."""
    return not n.is_leaf and n.op not in FLOPS_BOUND_OPS and n.op not in ZERO_COPY_OPS


WEIGHT_READ_OPS = FLOPS_BOUND_OPS - {"opaque"}
"""Matmul-class operators whose parameter operands' bytes are priced (an opaque op's bytes are unknown)."""


def _weight_traffic(graph: Graph, node: int) -> float:
    """Bytes of the parameters a matmul-class operator reads in the forward pass."""
    return float(sum(graph[i].nbytes for i in dict.fromkeys(graph[node].inputs) if graph[i].op == "parameter"))


def _traffic(graph: Graph, node: int, size: list) -> float:
    """Bytes a memory-bound operator reads and writes in the forward pass: its output and each
    distinct input (of a table lookup, only the rows it returns); `size`: bytes per tensor (`CostModel.nbytes`)."""
    n = graph[node]
    read = 0.0
    for i in dict.fromkeys(n.inputs):
        read += min(size[i], size[node]) if n.op in GATHER_OPS and graph[i].op == "parameter" else size[i]
    return float(size[node]) + read


def add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(map(operator.add, a, b))


def _backward_flops(graph: Graph, node: int, requires_grad: list[bool]) -> float:
    """About one forward's flops per operand that needs a gradient (2x for a matmul with a weight)."""
    n = graph[node]
    if n.is_leaf or not requires_grad[node]:
        return 0.0
    return n.flops * sum(1 for i in dict.fromkeys(n.inputs) if requires_grad[i])


def is_sharded(ins: Instruction) -> bool:
    return ins.post >= 0 or any(f >= 0 for _, f in ins.pre)


@dataclass
class Replayed:
    """A program's linear terms: its stages, memory per segment, and in the overlap modes its tail
    work per segment and its gradient buckets."""

    stages: list[Stage]
    mems: list[Mem]
    tails: list[Acc]
    """Per segment, the per-parameter-byte work run after the last all-reduce (ddp, duplex; zero in none)."""
    buckets: list[tuple[tuple[int, ...], float, int, Acc, float]]
    """Per bucket, in launch order (ddp, duplex; empty in none, which lists its one bucket as a stage):
    its parameters, its bytes, the index in `stages` of the backward stage that readies it, that stage's
    work before the bucket's earliest-used parameter, and its all-reduce's seconds (`CostModel.bucket_line`).
    Backward runs the stage's work in reverse, so the bucket is ready once the stage's work *from* that
    parameter's first consumer on is done."""


def replay(program: tuple[Instruction, ...], cm: CostModel) -> tuple[list[Stage], list[Mem]]:
    """Split a program into forward and backward stages with linear work terms, and sum its memory
    terms per segment (`replay_terms` for the overlap modes' tail and buckets)."""
    r = replay_terms(program, cm)
    return r.stages, r.mems


def replay_terms(program: tuple[Instruction, ...], cm: CostModel) -> Replayed:
    """The stages, memory, tail and buckets of a program under `cm.overlap`.

    Backward stages are listed mirroring the forward ones (they run in reverse order). In mode none
    the gradient bucket, which runs last, is listed first among them and the per-parameter-byte
    work is in the stage that loads the parameter; in ddp and duplex that work is the tail and the
    buckets are listed apart. A segment boundary ends both open stages.
    """
    overlapped = cm.overlap != "none"
    segs = instruction_segments(program, cm.segmentation)
    sources = source_segments(program, cm.segmentation)
    stages: list[Stage] = []
    fwd, bwd = ZERO, ZERO
    mems = [MEM_ZERO] * cm.segmentation.count
    tails = [ZERO] * cm.segmentation.count
    none = ("", -1, 0.0, 0.0, (0,))
    fwd_open = bwd_open = none
    bucket_bytes, cur = 0.0, segs[0] if segs else 0
    n_bwd = 0  # backward stages closed so far: the open one's ordinal
    program_position: dict[int, int] = {}
    anchor: dict[int, tuple[int, Acc]] = {}  # Full parameter -> (ordinal of the backward stage that loads it, its work so far)
    layer = instruction_layers(program, cm.graph) if cm.recompute else []
    for i, ins in enumerate(program):
        k = segs[i]
        if k != cur:  # a boundary: every stage lies inside one segment (§5.2)
            stages += [Stage("forward", *fwd_open[:4], fwd, cur, fwd_open[4]), Stage("backward", *bwd_open[:4], bwd, cur, bwd_open[4])]
            fwd_open, bwd_open, fwd, bwd, cur = none, none, ZERO, ZERO, k
            n_bwd += 1
        if ins.kind == COMPUTE:
            forms = tuple(g for _, g in ins.pre)
            f, b, a = cm.compute_delta(ins.node, is_sharded(ins), cm.weights_whole(ins.node, forms), (forms, ins.post))
            fwd, bwd, mems[k] = add(fwd, f), add(bwd, b), add(mems[k], a)
        elif ins.kind == LOAD:
            sync, m = cm.load_delta(ins.node, ins.post)
            mems[k] = add(mems[k], m)
            if cm.graph[ins.node].op == "parameter" and ins.post == FULL and not (cm.states and cm.states.stage(ins.node)):
                bucket_bytes += cm.nbytes[ins.node]
                program_position[ins.node] = i
                anchor[ins.node] = (n_bwd, bwd)
            if overlapped:
                tails[k] = add(tails[k], sync)
            else:
                bwd = add(bwd, sync)
        elif ins.kind == COMM and ins.rule != "slice":
            over = (sources[i], k) if ins.rule == RESPLIT else (k,)
            stages.append(Stage("forward", *fwd_open[:4], fwd, k, fwd_open[4]))
            fwd_open, fwd = (ins.rule, ins.node, *cm.comm_terms(ins.rule, ins.node), over), ZERO
            if cm.requires_grad[ins.node]:
                stages.append(Stage("backward", *bwd_open[:4], bwd, k, bwd_open[4]))
                n_bwd += 1
                dual = DUAL[ins.rule]
                bwd_open, bwd = (dual, ins.node, *cm.comm_terms(dual, ins.node), over), ZERO
            if layer and layer[i] in cm.recompute and ins.rule != RESPLIT:  # a recomputed layer runs its collective again in backward
                stages.append(Stage("backward", *bwd_open[:4], bwd, k, bwd_open[4]))
                n_bwd += 1
                bwd_open, bwd = (ins.rule, ins.node, *cm.comm_terms(ins.rule, ins.node), over), ZERO
    stages += [Stage("forward", *fwd_open[:4], fwd, cur, fwd_open[4]), Stage("backward", *bwd_open[:4], bwd, cur, bwd_open[4])]
    if not overlapped:
        if bucket_bytes:
            latency, per_byte = cm.bucket_line(None)
            first_bwd = next(i for i, s in enumerate(stages) if s.direction == "backward")
            stages.insert(first_bwd, Stage("backward", "grad_all_reduce", -1, latency + bucket_bytes * per_byte, 0.0, ZERO))
        return Replayed([s for s in stages if s.comm or any(s.work)], mems, tails, [])
    filled = [(k, b) for k, b in ((k, tuple(p for p in slot if p in anchor)) for k, slot in enumerate(cm.slots)) if b]
    buckets = [b for _, b in filled]
    # the earliest-used member (the first loaded) completes its gradient last
    ready = [anchor[min(b, key=lambda p: program_position[p])] for b in buckets]
    kept: list[Stage] = []
    position: dict[int, int] = {}  # backward ordinal -> index in `kept`
    ordinal = 0
    anchors = {r for r, _ in ready} if cm.overlap == "ddp" else set()  # ddp keeps an empty stage that readies a bucket
    for s in stages:
        keep = bool(s.comm or any(s.work))
        if s.direction == "backward":
            if ordinal in anchors:
                keep, position[ordinal] = True, len(kept)
            ordinal += 1
        if keep:
            kept.append(s)
    sized = [(b, float(sum(cm.nbytes[p] for p in b)), cm.bucket_line(k)) for k, b in filled]
    return Replayed(kept, mems, tails, [(b, nbytes, position.get(r, -1), pre, latency + nbytes * per)
                                        for (b, nbytes, (latency, per)), (r, pre) in zip(sized, ready)])


def evaluate(program: tuple[Instruction, ...], cm: CostModel) -> Breakdown:
    """t(Q, B) with its breakdown per stage and device, and memory per device, priced in `cm.overlap`."""
    r = replay_terms(program, cm)
    stages = r.stages
    tops = [max(cm.max_ratios[k] for k in s.comm_segments) for s in stages]
    comm = [cm.stage_comm_s(s, top) for s, top in zip(stages, tops)]
    comp = [cm.device_times(s.work, s.segment) for s in stages]
    per_class = cm.class_memory(r.mems)
    if cm.recompute:
        per_class = add(per_class, transient_peak(program, cm))
    names = [d.name for d in cm.cluster.devices]
    memory = [0.0] * cm.cluster.num_devices
    for c, b in zip(cm.classes, per_class):
        for j in c.devices:
            memory[j] = b + cm.transient_bytes
    if cm.overlap == "none":
        return _with_states(overlap_price(Breakdown(0.0, stages, comm, comp, memory, cm.ratios, devices=names)), program, cm)
    tail = [0.0] * cm.cluster.num_devices
    for c in cm.classes:
        t = sum(class_work(acc, c, c.ratios[k]) for k, acc in enumerate(r.tails))
        for j in c.devices:
            tail[j] = t
    half = [cm.half_comm_seconds(s.comm, s.comm_node, top) for s, top in zip(stages, tops)] if cm.overlap == "duplex" else []
    records = [BucketRecord(params, nbytes, seconds, 0.0, 0.0, 0.0, at,
                            tuple(_left(stages, at, pre, cm)) if cm.overlap == "ddp" else ())
               for params, nbytes, at, pre, seconds in r.buckets]
    out = Breakdown(0.0, stages, comm, comp, memory, cm.ratios, cm.overlap, records, max(tail), tail, half, names)
    return _with_states(overlap_price(out), program, cm)


def _with_states(b: Breakdown, program: tuple[Instruction, ...], cm: CostModel) -> Breakdown:
    """`b` with the staged weights' time after backward added (`engine.spmd.zero`); unchanged without them."""
    if cm.states is None:
        return b
    b.states_s = cm.states_time(cm.states_terms(program))
    b.total_s += b.states_s
    return b


def _left(stages: list[Stage], at: int, pre: Acc, cm: CostModel) -> list[float]:
    """Per device, stage `at`'s work after `pre` (what backward runs of it before reaching `pre`'s end)."""
    return cm.device_times(tuple(x - y for x, y in zip(stages[at].work, pre)), stages[at].segment)
