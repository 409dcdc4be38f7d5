"""Cluster specifications: the devices HAP plans for and the cost of collectives between them.

A *cluster spec* lists the devices of one training job (each a GPU, or a *virtual
device* that is a whole machine of ``num_gpus`` GPUs doing data parallel inside,
HAP paper §3), where they sit (machine, group of machines on a fast fabric), how
fast they compute, how much memory they have, and what the network between them
costs. It is read from JSON (``schema_version`` 1) with :func:`load_cluster` /
:meth:`Cluster.from_dict`, the one way to build and validate a :class:`Cluster`.

Collective cost model (HAP §3.2: "run each collective operation on the cluster
with tensors of different sizes and fit the latency and bandwidth in a linear
model ... estimated using the fitted model, with the input of the tensor size of
the largest shard")::

    time = latency_s + payload_bytes / bandwidth_Bps

with one :class:`CollectiveFit` per collective. Payload semantics (the cost model
elsewhere relies on them exactly):

* ``all_reduce``: payload = bytes of the whole tensor.
* ``all_gather`` (padded implementation), ``reduce_scatter``, ``all_to_all``:
  payload = bytes of the LARGEST shard.
* ``broadcast``: payload = bytes of the one shard broadcast; a "grouped
  broadcast" all-gather costs the sum over devices j of ``broadcast.time(shard_j)``.

When the JSON has no explicit ``network.collectives.<name>`` fit, a nominal one
is derived for ring algorithms over m virtual devices, with hop latency a =
``network.latency_s`` and L = the bottleneck link bandwidth (the slowest link
level the device layout uses; see :meth:`Cluster.bottleneck_bandwidth_Bps`):

* all_reduce: latency 2(m-1)a, bandwidth L*m/(2(m-1))
* all_gather, reduce_scatter: latency (m-1)a, bandwidth L/(m-1)
* all_to_all: latency (m-1)a, bandwidth L*m/(m-1)
* broadcast: latency a, bandwidth L
* m == 1: latency 0, bandwidth 1e30 (communication is free).

An explicit fit (e.g. written by a profiler) overrides the nominal figure. It may
also carry the measured ``points`` it was fitted to, ``[[payload_bytes, seconds], ...]``
(``hap profile`` writes them): between the smallest and the largest payload the time is
then read off these points (linear between neighbours) rather than off the line, since a
real collective is not one line (gloo on one CPU box switches algorithm above ~64 KiB, and
an activation all-reduce of 128 KiB-1 MiB cost twice the fitted line there). Beyond the
points the line's bandwidth carries on from the nearest one.
:meth:`Cluster.to_dict` writes the resolved fits of all five collectives, so
``Cluster.from_dict(c.to_dict()) == c``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from engine import limits
from engine.errors import ClusterError
from engine.readers import read_json

SCHEMA_VERSION = 1
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
LINK_LEVELS: tuple[str, ...] = ("intra_machine", "inter_machine", "inter_group")
FREE_BANDWIDTH_BPS = 1e30
DEFAULT_INTRA_BANDWIDTH_BPS = 1e11
FLOPS_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""Keys of a `flops_per_gpu` map: the dense matmul rate of each dtype (`engine.options.PRECISIONS`)."""
SLOWDOWN_MODES: tuple[str, ...] = ("ddp", "duplex")
"""The overlap modes a device's `overlap_slowdown` may name (`engine.spmd.overlap.OVERLAP_MODES` less `none`)."""

_TOP_KEYS = ("schema_version", "name", "description", "sources", "devices", "network")
_DEVICE_KEYS = ("name", "gpu_model", "gpu_product", "machine", "group", "num_gpus", "flops_per_gpu",
                "memory_bytes_per_gpu", "memory_bandwidth_Bps", "activation_bandwidth_Bps", "op_overhead_s",
                "intra_bandwidth_Bps", "overlap_slowdown", "count", "slurm")
SLURM_KEYS = ("feature", "gres_type", "nodelist")
"""Scheduler hints a device may carry (`Device.slurm`): they pin the hardware of its machine's Slurm job component."""
_NETWORK_KEYS = ("latency_s", "bandwidth_Bps", "collectives")
_FIT_KEYS = ("latency_s", "bandwidth_Bps", "points")

_RANGES: dict[str, tuple[float, float]] = {
    "num_gpus": (1, limits.MAX_GPUS_PER_DEVICE),
    "count": (1, limits.MAX_DEVICES),
    "flops_per_gpu": (limits.MIN_RATE, limits.MAX_FLOPS_PER_GPU),
    "memory_bytes_per_gpu": (1, limits.MAX_MEMORY_BYTES),
    "memory_bandwidth_Bps": (limits.MIN_RATE, limits.MAX_BANDWIDTH_BPS),
    "activation_bandwidth_Bps": (limits.MIN_RATE, limits.MAX_BANDWIDTH_BPS),
    "op_overhead_s": (0.0, limits.MAX_OP_OVERHEAD_S),
    "intra_bandwidth_Bps": (limits.MIN_RATE, limits.MAX_BANDWIDTH_BPS),
    "bandwidth_Bps": (limits.MIN_RATE, limits.MAX_BANDWIDTH_BPS),
    "latency_s": (0.0, limits.MAX_LATENCY_S),
    "overlap_slowdown": (0.5, 20.0),
    "payload_bytes": (0.0, limits.MAX_MEMORY_BYTES),
    "seconds": (0.0, limits.MAX_LATENCY_S),
}
"""Sane bounds of each numeric field (see `engine.limits`): checked before a device is expanded or a cost computed."""

_HINTS: dict[str, str] = {
    "name": "a unique name, e.g. 'a100-0'",
    "gpu_model": "the GPU model, e.g. 'V100-SXM2-16GB'",
    "gpu_product": "the nvidia.com/gpu.product node label of its machines (GPU feature discovery), e.g. "
                   "'NVIDIA-A100-SXM4-40GB'; omit it when gpu_model is that label",
    "machine": "the machine (box) holding the device, e.g. 'm0'",
    "group": "a set of machines on a fast fabric, or '' for none",
    "num_gpus": "GPUs inside this virtual device, e.g. 1 or 8",
    "flops_per_gpu": "the sustained FLOP/s of one GPU, e.g. 1.5e13 (read as fp32), or one per dtype, e.g. "
                     "{\"fp32\": 1.95e13, \"bf16\": 3.12e14, \"fp16\": 3.12e14}; leave out a dtype the GPU lacks",
    "memory_bytes_per_gpu": "bytes of memory of one GPU, e.g. 17179869184 for 16 GiB",
    "memory_bandwidth_Bps": "bytes/s one GPU reads and writes its own memory, e.g. 1.555e12 for an A100-40GB",
    "activation_bandwidth_Bps": "bytes/s of the memory-bound operators on one GPU, e.g. 1.2e12 (as hap profile measures)",
    "op_overhead_s": "seconds each operator run costs one GPU besides its flops and bytes (dispatch, launch), e.g. 2e-05 "
                     "(as hap profile measures)",
    "intra_bandwidth_Bps": "bytes/s between the GPUs inside the virtual device, e.g. 1.5e11",
    "overlap_slowdown": "per overlap mode, how much slower computation runs in it, e.g. {\"ddp\": 1.05, \"duplex\": 1.3} "
                        "(as hap profile measures)",
    "count": "how many identical devices this entry expands to, e.g. 8",
    "slurm": "scheduler hints for the device's machine, e.g. {\"feature\": \"a100\", \"gres_type\": \"a100\", "
             "\"nodelist\": \"gpu[01-02]\"} (each optional)",
    "latency_s": "seconds of latency, e.g. 2e-05",
    "bandwidth_Bps": "bytes per second, e.g. 1.25e9 for 10 Gbps",
    "payload_bytes": "bytes of the collective's payload, e.g. 1048576",
    "seconds": "seconds the collective took on that payload, e.g. 2.1e-3",
    "points": "measured [payload_bytes, seconds] pairs, e.g. [[4096, 3e-4], [1048576, 2.1e-3]] (as hap profile writes)",
    "schema_version": "set it to 1",
    "cluster_name": "a name for the cluster, e.g. 'a100x2_p100x2'",
    "description": "free text",
}


# ----------------------------------------------------------------------------- dataclasses


@dataclass(frozen=True, kw_only=True)
class Device:
    """One (virtual) device of the cluster: a GPU, or a machine of ``num_gpus`` GPUs doing data parallel inside."""

    name: str
    """Unique name of the device."""
    gpu_model: str
    """GPU model, e.g. 'A100-SXM4-40GB'; used to group devices in what-if scaling."""
    gpu_product: str | None = None
    """The `nvidia.com/gpu.product` label (GPU feature discovery) of the machines holding this GPU, e.g.
    'NVIDIA-A100-SXM4-40GB', which Kubernetes manifests select nodes by; None: gpu_model is that label."""
    machine: str
    """Machine (box) id; devices sharing a machine are in one box."""
    group: str = ""
    """Set of machines on a fast fabric ('' for none); used for the link hierarchy."""
    num_gpus: int = 1
    """GPUs inside this virtual device (>= 1)."""
    flops_per_gpu: float
    """Sustained fp32 FLOP/s of one GPU (> 0)."""
    flops_by_dtype: tuple[tuple[str, float], ...] = ()
    """(dtype, FLOP/s of one GPU) for the mixed-precision dtypes the spec rates (`FLOPS_DTYPES` less fp32):
    the matmul rate under autocast in that dtype. A dtype left out is one the GPU is not planned in."""
    memory_bytes_per_gpu: int
    """Bytes of memory of one GPU (> 0)."""
    memory_bandwidth_Bps: float | None = None
    """Bytes/s one GPU moves to and from its memory; prices the memory-bound optimizer update and
    gradient-bucket copies (`engine.spmd.cost`). None: those are not priced."""
    activation_bandwidth_Bps: float | None = None
    """Bytes/s at which one GPU runs the memory-bound operators (element-wise, norms, softmax, losses,
    copies). When set, `engine.spmd.cost` prices those by the bytes they read and write, and
    `flops_per_gpu` prices only the matmul-class operators (a roofline split); None: every operator
    is priced by its flops at `flops_per_gpu`. Set it on every device or on none."""
    op_overhead_s: float = 0.0
    """Seconds every operator run costs one GPU on top of its flops and bytes: the framework's dispatch and
    the kernel launch, which do not shrink with the operator's share of the work (`engine.spmd.cost`
    counts one run per node forward, one per node with a gradient backward). 0: not priced."""
    intra_bandwidth_Bps: float = DEFAULT_INTRA_BANDWIDTH_BPS
    """Bytes/s between the GPUs inside this virtual device; used only when num_gpus > 1."""
    overlap_slowdown: tuple[tuple[str, float], ...] = ()
    """(mode, factor) pairs: computation in that overlap mode takes `factor` times as long, e.g. the
    communication's own work competing for the cores (ddp) or two half-batches running smaller
    kernels (duplex). Absent modes run at full speed. `hap profile` measures both."""
    slurm: tuple[tuple[str, str], ...] = ()
    """(key, value) Slurm hints of SLURM_KEYS (`feature` -> --constraint, `gres_type` -> --gres=gpu:TYPE:N,
    `nodelist` -> --nodelist) for the job component of this device's machine; () pins nothing. They say where
    to run, not how fast: they are left out of the cluster's fingerprint (`Cluster.fingerprint`)."""

    def slowdown(self, overlap: str) -> float:
        """How much slower this device computes in overlap mode `overlap` (1.0 when not given)."""
        return dict(self.overlap_slowdown).get(overlap, 1.0)

    @property
    def flops(self) -> float:
        """Sustained FLOP/s of the whole (virtual) device."""
        return self.num_gpus * self.flops_per_gpu

    def flops_per_gpu_in(self, dtype: str) -> float | None:
        """FLOP/s of one GPU for matmuls in `dtype` (`FLOPS_DTYPES`); None when the spec gives no rate for it."""
        return self.flops_per_gpu if dtype == "fp32" else dict(self.flops_by_dtype).get(dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return {
            "name": self.name, "gpu_model": self.gpu_model,
            **({"gpu_product": self.gpu_product} if self.gpu_product is not None else {}),
            "machine": self.machine,
            "group": self.group, "num_gpus": self.num_gpus,
            "flops_per_gpu": ({"fp32": self.flops_per_gpu, **dict(self.flops_by_dtype)} if self.flops_by_dtype
                              else self.flops_per_gpu),
            "memory_bytes_per_gpu": self.memory_bytes_per_gpu,
            **({"memory_bandwidth_Bps": self.memory_bandwidth_Bps} if self.memory_bandwidth_Bps is not None else {}),
            **({"activation_bandwidth_Bps": self.activation_bandwidth_Bps}
               if self.activation_bandwidth_Bps is not None else {}),
            **({"op_overhead_s": self.op_overhead_s} if self.op_overhead_s else {}),
            "intra_bandwidth_Bps": self.intra_bandwidth_Bps,
            **({"overlap_slowdown": dict(self.overlap_slowdown)} if self.overlap_slowdown else {}),
            **({"slurm": dict(self.slurm)} if self.slurm else {}),
        }


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """Cost model of one collective: time = latency_s + payload_bytes / bandwidth_Bps, or read off the
    measured `points` between their smallest and largest payload (module docstring)."""

    latency_s: float
    """Fixed cost in seconds (>= 0)."""
    bandwidth_Bps: float
    """Effective bytes per second of payload (> 0); see the module docstring for the payload of each collective."""
    points: tuple[tuple[float, float], ...] = ()
    """Measured (payload bytes, seconds), by increasing payload: none, or at least two."""

    def time(self, payload_bytes: float) -> float:
        """Seconds to run the collective on a payload of ``payload_bytes``."""
        pts = self.points
        if not pts:
            return self.latency_s + payload_bytes / self.bandwidth_Bps
        if payload_bytes <= pts[0][0]:
            return max(self.latency_s, pts[0][1] - (pts[0][0] - payload_bytes) / self.bandwidth_Bps)
        for (x0, t0), (x1, t1) in zip(pts, pts[1:]):
            if payload_bytes <= x1:
                return t0 + (t1 - t0) * (payload_bytes - x0) / (x1 - x0)
        return pts[-1][1] + (payload_bytes - pts[-1][0]) / self.bandwidth_Bps

    def chord_s_per_byte(self, payload_bytes: float) -> float:
        """Seconds per byte of the chord of `time` from its latency (no payload) to `payload_bytes`: the
        line a gradient bucket is priced on, exact at that payload (no payload: the fitted line's slope)."""
        if payload_bytes <= 0:
            return 1.0 / self.bandwidth_Bps
        return max(0.0, self.time(payload_bytes) - self.latency_s) / payload_bytes

    def lines(self, upto_bytes: float) -> tuple[tuple[float, float], ...]:
        """(seconds, seconds per byte) lines whose maximum is the lower convex hull of `time` on payloads
        0..`upto_bytes`: `time` itself where it is convex, below it across a bump. A linear programme takes
        their maximum with one epigraph variable; without measured points it is the one fitted line."""
        if not self.points or upto_bytes <= 0:
            return ((self.latency_s, 1.0 / self.bandwidth_Bps),)
        (x0, t0) = self.points[0]
        corner = x0 - (t0 - self.latency_s) * self.bandwidth_Bps  # where the line below the points meets the latency
        xs = sorted({0.0, upto_bytes, *(x for x in (corner, *(x for x, _ in self.points)) if 0 < x < upto_bytes)})
        hull: list[tuple[float, float]] = []
        for p in ((x, self.time(x)) for x in xs):
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            hull.append(p)
        return tuple((ya - (yb - ya) / (xb - xa) * xa, (yb - ya) / (xb - xa)) for (xa, ya), (xb, yb) in zip(hull, hull[1:]))

    def scaled(self, bandwidth_scale: float) -> "CollectiveFit":
        """The fit on links `bandwidth_scale` times as fast: the time above the latency shrinks by it."""
        return CollectiveFit(latency_s=self.latency_s, bandwidth_Bps=self.bandwidth_Bps * bandwidth_scale,
                             points=tuple((x, self.latency_s + max(0.0, t - self.latency_s) / bandwidth_scale)
                                          for x, t in self.points))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        out: dict[str, Any] = {"latency_s": self.latency_s, "bandwidth_Bps": self.bandwidth_Bps}
        if self.points:
            out["points"] = [list(p) for p in self.points]
        return out


@dataclass(frozen=True, kw_only=True)
class Network:
    """Links between devices: one per-hop latency and a bandwidth per link level."""

    latency_s: float
    """Per-hop latency in seconds (>= 0)."""
    bandwidth_Bps: dict[str, float] = field(default_factory=dict)
    """Bytes/s per link level: 'intra_machine', 'inter_machine', 'inter_group'."""

    def __hash__(self) -> int:
        """Hash of the latency and the sorted bandwidth levels."""
        return hash((self.latency_s, tuple(sorted(self.bandwidth_Bps.items()))))


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A validated cluster: devices, network and the resolved collective fits. Build with from_dict/load_cluster."""

    name: str
    """Short name of the cluster."""
    description: str
    """Free text: what the cluster is and how the figures were chosen."""
    sources: tuple[str, ...]
    """Where the numbers came from (datasheets, measurements)."""
    devices: tuple[Device, ...]
    """The (virtual) devices, in the order plans index them."""
    network: Network
    """Per-hop latency and link bandwidths."""
    collectives: dict[str, CollectiveFit]
    """Fit per collective, with exactly the keys of COLLECTIVES."""

    def __repr__(self) -> str:
        """One line for logs."""
        gpus = sum(d.num_gpus for d in self.devices)
        return f"<Cluster '{self.name}': {self.num_devices} devices, {gpus} GPUs, {len(self.machines)} machines>"

    def __hash__(self) -> int:
        """Hash of the fingerprint."""
        return hash(self.fingerprint())

    @property
    def num_devices(self) -> int:
        """Number of (virtual) devices."""
        return len(self.devices)

    @property
    def flops(self) -> tuple[float, ...]:
        """Sustained FLOP/s of each device, in device order."""
        return tuple(d.flops for d in self.devices)

    @property
    def machines(self) -> tuple[str, ...]:
        """Distinct machine ids, in order of first appearance."""
        return tuple(dict.fromkeys(d.machine for d in self.devices))

    @property
    def link_levels(self) -> tuple[str, ...]:
        """Link levels the device layout uses (see required_link_levels)."""
        return required_link_levels(self.devices)

    @property
    def bottleneck_bandwidth_Bps(self) -> float:
        """Bandwidth of the slowest link level the layout uses (1e30 when no link is used)."""
        return _bottleneck(self.devices, self.network.bandwidth_Bps)

    def fingerprint(self) -> str:
        """SHA-256 hex of the canonical JSON of to_dict() less the devices' Slurm hints: those say where a job
        runs, not what it costs, so adding them keeps every plan made for the cluster valid."""
        d = self.to_dict()
        for dev in d["devices"]:
            dev.pop("slurm", None)
        text = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (schema_version 1) with expanded devices and resolved collectives."""
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "description": self.description,
            "sources": list(self.sources),
            "devices": [d.to_dict() for d in self.devices],
            "network": {
                "latency_s": self.network.latency_s,
                "bandwidth_Bps": dict(self.network.bandwidth_Bps),
                "collectives": {k: self.collectives[k].to_dict() for k in COLLECTIVES},
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        """Validate a JSON-style dict and build the cluster; raises ClusterError naming the bad field."""
        return _parse_cluster(d)

    def scaled(self, flops_scale: Mapping[str, float] | None = None, bandwidth_scale: float = 1.0) -> Cluster:
        """New cluster with flops_per_gpu scaled per gpu_model and all network bandwidths (levels and fits) scaled."""
        flops_scale = dict(flops_scale or {})
        models = {dev.gpu_model for dev in self.devices}
        for model, factor in flops_scale.items():
            if model not in models:
                raise ClusterError(f"flops_scale[{model!r}]: unknown gpu_model; the cluster has {sorted(models)}")
            _check_scale(factor, f"flops_scale[{model!r}]")
        _check_scale(bandwidth_scale, "bandwidth_scale")
        devices = tuple(replace(dev, flops_per_gpu=dev.flops_per_gpu * flops_scale.get(dev.gpu_model, 1.0),
                                flops_by_dtype=tuple((k, v * flops_scale.get(dev.gpu_model, 1.0))
                                                     for k, v in dev.flops_by_dtype))
                        for dev in self.devices)
        levels = {k: v * bandwidth_scale for k, v in self.network.bandwidth_Bps.items()}
        fits = {k: f.scaled(bandwidth_scale) for k, f in self.collectives.items()}
        return replace(self, devices=devices, network=replace(self.network, bandwidth_Bps=levels), collectives=fits)


# ----------------------------------------------------------------------------- cost-model helpers


def required_link_levels(devices: tuple[Device, ...] | list[Device]) -> tuple[str, ...]:
    """Link levels a layout uses: intra_machine if a machine holds >1 device, inter_machine if >1 machine, inter_group if >1 non-empty group."""
    per_machine: dict[str, int] = {}
    for dev in devices:
        per_machine[dev.machine] = per_machine.get(dev.machine, 0) + 1
    groups = {dev.group for dev in devices if dev.group}
    used = []
    if any(n > 1 for n in per_machine.values()):
        used.append("intra_machine")
    if len(per_machine) > 1:
        used.append("inter_machine")
    if len(groups) > 1:
        used.append("inter_group")
    return tuple(used)


def nominal_collectives(m: int, latency_s: float, bottleneck_Bps: float) -> dict[str, CollectiveFit]:
    """Ring-algorithm fits of the five collectives over m devices with hop latency and bottleneck bandwidth."""
    if m <= 1:
        free = CollectiveFit(latency_s=0.0, bandwidth_Bps=FREE_BANDWIDTH_BPS)
        return {k: free for k in COLLECTIVES}
    a, bw = latency_s, bottleneck_Bps
    return {
        "all_reduce": CollectiveFit(latency_s=2 * (m - 1) * a, bandwidth_Bps=bw * m / (2 * (m - 1))),
        "all_gather": CollectiveFit(latency_s=(m - 1) * a, bandwidth_Bps=bw / (m - 1)),
        "reduce_scatter": CollectiveFit(latency_s=(m - 1) * a, bandwidth_Bps=bw / (m - 1)),
        "all_to_all": CollectiveFit(latency_s=(m - 1) * a, bandwidth_Bps=bw * m / (m - 1)),
        "broadcast": CollectiveFit(latency_s=a, bandwidth_Bps=bw),
    }


def fit_collective(payload_bytes: list[float] | tuple[float, ...], seconds: list[float] | tuple[float, ...]) -> CollectiveFit:
    """Fit ``time = latency + bytes / bandwidth`` to measured points (HAP §3.2), anchored at the smallest payload.

    The line goes through the smallest payload's point, where latency dominates, and its slope is
    the weighted least-squares slope of the other points, with squared residuals weighted by
    1/time: timing noise grows with the time (a collective is a sequence of chunk transfers, each
    delayed at random on a loaded host). Measured collectives are not quite linear (on a CPU host
    gloo's bandwidth drops for multi-MiB payloads); the anchor keeps small, latency-bound
    collectives priced at what they cost, and the weighting lets the large payloads, such as
    gradient buckets, set the bandwidth. A negative intercept is clamped to 0; a slope <= 0 (time
    does not grow with size) gives FREE_BANDWIDTH_BPS with the mean time as latency. Give it one
    point per payload, each already a robust summary (e.g. a median of repeats). The fit keeps the
    points, so that its `time` reads between them (module docstring).
    """
    if len(payload_bytes) != len(seconds) or len(seconds) < 2:
        raise ValueError(f"fit_collective needs >= 2 (bytes, seconds) points of equal count, got "
                         f"{len(payload_bytes)} and {len(seconds)}")
    if any(t <= 0 for t in seconds) or any(b < 0 for b in payload_bytes):
        raise ValueError("fit_collective needs positive times and non-negative payloads")
    x0, t0 = min(zip(payload_bytes, seconds))
    num = sum((x - x0) * (t - t0) / t for x, t in zip(payload_bytes, seconds))
    den = sum((x - x0) ** 2 / t for x, t in zip(payload_bytes, seconds))
    slope = num / den if den > 0 else 0.0
    points = _measured_points(payload_bytes, seconds)
    if slope <= 0:
        return CollectiveFit(latency_s=sum(seconds) / len(seconds), bandwidth_Bps=FREE_BANDWIDTH_BPS, points=points)
    latency = t0 - slope * x0
    if latency < 0:  # refit through the origin: min sum (s x - t)^2 / t
        latency, slope = 0.0, sum(payload_bytes) / sum(x * x / t for x, t in zip(payload_bytes, seconds))
    return CollectiveFit(latency_s=latency, bandwidth_Bps=min(1.0 / slope, FREE_BANDWIDTH_BPS), points=points)


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    """z of (a - o) x (b - o): positive when o, a, b turn counter-clockwise (a lies below the chord o-b)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _measured_points(payload_bytes, seconds) -> tuple[tuple[float, float], ...]:
    """The points a fit keeps: one per payload (the mean of any repeated payload), by increasing payload;
    none unless at least two payloads differ."""
    by_size: dict[float, list[float]] = {}
    for x, t in zip(payload_bytes, seconds):
        by_size.setdefault(float(x), []).append(float(t))
    if len(by_size) < 2:
        return ()
    return tuple((x, sum(ts) / len(ts)) for x, ts in sorted(by_size.items()))


def _bottleneck(devices: tuple[Device, ...], levels: Mapping[str, float]) -> float:
    """Slowest bandwidth among the link levels the layout uses (FREE_BANDWIDTH_BPS if none)."""
    used = required_link_levels(devices)
    return min((levels[k] for k in used), default=FREE_BANDWIDTH_BPS)


def _check_scale(factor: Any, path: str) -> None:
    """Raise unless factor is a finite number in [1e-6, 1e6] (a what-if scale, not a typo)."""
    if not _is_number(factor) or not 1e-6 <= factor <= 1e6:
        raise ClusterError(f"{path}: must be a positive number in [1e-06, 1e+06], got {factor!r}")


# ----------------------------------------------------------------------------- loading


def load_cluster(source: str | Path | Mapping[str, Any] | Cluster) -> Cluster:
    """Load a cluster from a JSON file path, a dict, or return a Cluster as is."""
    if isinstance(source, Cluster):
        return source
    if isinstance(source, Mapping):
        return Cluster.from_dict(source)
    if isinstance(source, (str, Path)):
        return Cluster.from_dict(_read_json(Path(source), str(source)))
    raise ClusterError(f"cluster: expected a JSON file path, a dict or a Cluster, got {type(source).__name__}")


def _read_json(path: Path, shown: str) -> Any:
    """Parse a JSON file within engine.readers' bounds, turning every problem into a one-line ClusterError."""
    return read_json(path, f"cluster file {shown!r}", ClusterError)


# ----------------------------------------------------------------------------- validation primitives


def _is_number(value: Any) -> bool:
    """True for a finite int/float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _hint(key: str) -> str:
    """Parenthesised explanation of a field, or ''."""
    return f" ({_HINTS[key]})" if key in _HINTS else ""


def _missing(path: str, key: str) -> ClusterError:
    """Error for a required field that is absent."""
    return ClusterError(f"{path}: missing{_hint(key)}")


def _require(d: Mapping[str, Any], key: str, path: str, hint_key: str | None = None) -> Any:
    """Value of a required key, or a 'missing' error."""
    if key not in d:
        raise _missing(path, hint_key or key)
    return d[key]


def _check_keys(d: Mapping[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
    """Reject unknown keys, suggesting the closest allowed one."""
    for key in d:
        if key not in allowed:
            close = _suggest(str(key), allowed)
            tip = f"did you mean {close!r}?" if close else f"allowed fields: {', '.join(allowed)}"
            raise ClusterError(f"{prefix}{key}: unknown field; {tip}")


def _suggest(word: str, allowed: tuple[str, ...]) -> str | None:
    """Closest allowed name: one starting with the word, else difflib's best match."""
    starts = [a for a in allowed if word and a.lower().startswith(word.lower())]
    if starts:
        return starts[0]
    close = difflib.get_close_matches(word, allowed, n=1, cutoff=0.5)
    return close[0] if close else None


def _object(value: Any, path: str) -> Mapping[str, Any]:
    """Value as a JSON object, or an error."""
    if not isinstance(value, Mapping):
        raise ClusterError(f"{path}: must be a JSON object, got {_type_name(value)}")
    return value


def _type_name(value: Any) -> str:
    """JSON-ish name of a value's type."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _text(value: Any, path: str, key: str, allow_empty: bool = False) -> str:
    """Value as a string (non-empty unless allowed)."""
    if not isinstance(value, str):
        raise ClusterError(f"{path}: must be a string, got {value!r}{_hint(key)}")
    if not allow_empty and not value.strip():
        raise ClusterError(f"{path}: must be a non-empty string{_hint(key)}")
    return value


def _positive(value: Any, path: str, key: str) -> float:
    """Value as a float > 0, within the field's bounds."""
    if not _is_number(value) or not value > 0:
        raise ClusterError(f"{path}: must be a positive number, got {value!r}{_hint(key)}")
    return float(_within(value, path, key))


def _non_negative(value: Any, path: str, key: str) -> float:
    """Value as a float >= 0, within the field's bounds."""
    if not _is_number(value) or value < 0:
        raise ClusterError(f"{path}: must be a non-negative number, got {value!r}{_hint(key)}")
    return float(_within(value, path, key))


def _positive_int(value: Any, path: str, key: str) -> int:
    """Value as an int >= 1 (an integral float such as 1.6e10 is accepted), within the field's bounds."""
    if not _is_number(value) or value < 1 or value != int(value):
        raise ClusterError(f"{path}: must be a positive integer, got {value!r}{_hint(key)}")
    return int(_within(value, path, key))


def _within(value: float, path: str, key: str) -> float:
    """Value unchanged when inside the sane range of its field (`_RANGES`), else an error showing the range."""
    low, high = _RANGES.get(key, (-math.inf, math.inf))
    if not low <= value <= high:
        raise ClusterError(f"{path}: {value!r} is outside the sane range [{low:g}, {high:g}]{_hint(key)}")
    return value


# ----------------------------------------------------------------------------- parsing


def _parse_cluster(d: Any) -> Cluster:
    """Validate the top level and assemble the Cluster."""
    d = _object(d, "cluster")
    _check_keys(d, _TOP_KEYS, "")
    _parse_schema_version(_require(d, "schema_version", "schema_version"))
    name = _text(_require(d, "name", "name", "cluster_name"), "name", "cluster_name")
    description = _text(d.get("description", ""), "description", "description", allow_empty=True)
    sources = _parse_sources(d.get("sources", []))
    devices = _parse_devices(_require(d, "devices", "devices"))
    network, explicit = _parse_network(_require(d, "network", "network"), devices)
    fits = nominal_collectives(len(devices), network.latency_s, _bottleneck(devices, network.bandwidth_Bps))
    fits.update(explicit)
    return Cluster(name=name, description=description, sources=sources, devices=devices,
                   network=network, collectives={k: fits[k] for k in COLLECTIVES})


def _parse_schema_version(value: Any) -> None:
    """Accept only schema_version 1."""
    if isinstance(value, bool) or value != SCHEMA_VERSION:
        raise ClusterError(f"schema_version: unsupported version {value!r}; this tool reads schema_version 1")


def _parse_sources(value: Any) -> tuple[str, ...]:
    """Sources as a tuple of strings."""
    if not isinstance(value, list):
        raise ClusterError(f"sources: must be a list of strings, got {_type_name(value)}")
    return tuple(_text(s, f"sources[{i}]", "sources") for i, s in enumerate(value))


def _parse_devices(value: Any) -> tuple[Device, ...]:
    """Devices list, with `count` entries expanded and names checked for uniqueness."""
    if not isinstance(value, list):
        raise ClusterError(f"devices: must be a list of device objects, got {_type_name(value)}")
    if not value:
        raise ClusterError("devices: empty; list at least one device")
    if len(value) > limits.MAX_DEVICES:
        raise ClusterError(f"devices: {len(value)} entries, more than the limit of {limits.MAX_DEVICES} devices")
    devices: list[Device] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(value):
        for dev in _parse_device_entry(entry, f"devices[{i}]", limits.MAX_DEVICES - len(devices)):
            if dev.name in seen:
                raise ClusterError(f"devices[{i}].name: duplicate device name {dev.name!r} "
                                   f"(also used by devices[{seen[dev.name]}]); device names must be unique")
            seen[dev.name] = i
            devices.append(dev)
    if len(devices) > limits.MAX_DEVICES:
        raise ClusterError(f"devices: {len(devices)} devices, more than the limit of {limits.MAX_DEVICES}; "
                           "use virtual devices (num_gpus) for large machines")
    _check_machine_groups(devices)
    _check_machine_slurm(devices)
    _check_activation_bandwidth(devices)
    return tuple(devices)


def _parse_device_entry(entry: Any, path: str, room: int) -> list[Device]:
    """One device entry, expanded to `count` devices named <name>-0..N-1 when count is given (at most `room`)."""
    entry = _object(entry, path)
    _check_keys(entry, _DEVICE_KEYS, f"{path}.")
    field_path: Callable[[str], str] = lambda k: f"{path}.{k}"  # noqa: E731
    name = _text(_require(entry, "name", field_path("name")), field_path("name"), "name")
    base = Device(
        name=name,
        gpu_model=_text(_require(entry, "gpu_model", field_path("gpu_model")), field_path("gpu_model"), "gpu_model"),
        gpu_product=(None if entry.get("gpu_product") is None else
                     _text(entry["gpu_product"], field_path("gpu_product"), "gpu_product")),
        machine=_text(_require(entry, "machine", field_path("machine")), field_path("machine"), "machine"),
        group=_text(entry.get("group", ""), field_path("group"), "group", allow_empty=True),
        num_gpus=_positive_int(entry.get("num_gpus", 1), field_path("num_gpus"), "num_gpus"),
        **_parse_flops(_require(entry, "flops_per_gpu", field_path("flops_per_gpu")), field_path("flops_per_gpu")),
        memory_bytes_per_gpu=_positive_int(_require(entry, "memory_bytes_per_gpu", field_path("memory_bytes_per_gpu")),
                                           field_path("memory_bytes_per_gpu"), "memory_bytes_per_gpu"),
        memory_bandwidth_Bps=(None if entry.get("memory_bandwidth_Bps") is None else
                              _positive(entry["memory_bandwidth_Bps"], field_path("memory_bandwidth_Bps"),
                                        "memory_bandwidth_Bps")),
        activation_bandwidth_Bps=(None if entry.get("activation_bandwidth_Bps") is None else
                                  _positive(entry["activation_bandwidth_Bps"], field_path("activation_bandwidth_Bps"),
                                            "activation_bandwidth_Bps")),
        op_overhead_s=_non_negative(entry.get("op_overhead_s", 0.0), field_path("op_overhead_s"), "op_overhead_s"),
        intra_bandwidth_Bps=_positive(entry.get("intra_bandwidth_Bps", DEFAULT_INTRA_BANDWIDTH_BPS),
                                      field_path("intra_bandwidth_Bps"), "intra_bandwidth_Bps"),
        overlap_slowdown=_parse_slowdown(entry.get("overlap_slowdown"), field_path("overlap_slowdown")),
        slurm=_parse_slurm(entry.get("slurm"), field_path("slurm")),
    )
    if "count" not in entry:
        return [base]
    count = _positive_int(entry["count"], field_path("count"), "count")
    if count > room:
        raise ClusterError(f"{field_path('count')}: {count} devices here bring the cluster above the limit of "
                           f"{limits.MAX_DEVICES} devices; use virtual devices (num_gpus) for large machines")
    return [replace(base, name=f"{name}-{k}") for k in range(count)]


def _parse_flops(value: Any, path: str) -> dict[str, Any]:
    """`flops_per_gpu` as a number (the fp32 rate) or a map of `FLOPS_DTYPES` to rates (fp32 required)."""
    if not isinstance(value, Mapping):
        return {"flops_per_gpu": _positive(value, path, "flops_per_gpu")}
    _check_keys(value, FLOPS_DTYPES, f"{path}.")
    if "fp32" not in value:
        raise ClusterError(f"{path}: give the fp32 rate too, e.g. {{\"fp32\": 1.95e13, \"bf16\": 3.12e14}}")
    rates = {k: _positive(v, f"{path}.{k}", "flops_per_gpu") for k, v in value.items()}
    return {"flops_per_gpu": rates.pop("fp32"), "flops_by_dtype": tuple(sorted(rates.items()))}


def _parse_slurm(value: Any, path: str) -> tuple[tuple[str, str], ...]:
    """A device's Slurm hints as sorted (key, value) pairs; their grammar is checked at export (engine.bundle.grammar)."""
    if value is None:
        return ()
    hints = _object(value, path)
    _check_keys(hints, SLURM_KEYS, f"{path}.")
    return tuple(sorted((k, _text(v, f"{path}.{k}", "slurm")) for k, v in hints.items()))


def _check_machine_slurm(devices: list[Device]) -> None:
    """A machine is one Slurm job component: every device of a machine carries the same hints."""
    hints_of: dict[str, tuple[int, tuple[tuple[str, str], ...]]] = {}
    for i, dev in enumerate(devices):
        first, hints = hints_of.setdefault(dev.machine, (i, dev.slurm))
        if hints != dev.slurm:
            raise ClusterError(f"devices[{i}].slurm: machine {dev.machine!r} has slurm {dict(hints)} on device "
                               f"{devices[first].name!r} but {dict(dev.slurm)} here; give every device of a machine one slurm")


def _parse_slowdown(value: Any, path: str) -> tuple[tuple[str, float], ...]:
    """`overlap_slowdown` as sorted (mode, factor) pairs; absent or null is none."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ClusterError(f"{path}: must be an object of mode: factor, got {_type_name(value)}{_hint('overlap_slowdown')}")
    out = []
    for mode, factor in value.items():
        if mode not in SLOWDOWN_MODES:
            raise ClusterError(f"{path}: unknown overlap mode {mode!r} (choose from: {', '.join(SLOWDOWN_MODES)})")
        out.append((mode, _positive(factor, f"{path}.{mode}", "overlap_slowdown")))
    return tuple(sorted(out))


def _check_activation_bandwidth(devices: list[Device]) -> None:
    """The roofline split applies to the whole cluster: activation_bandwidth_Bps on every device or none."""
    given = [d.activation_bandwidth_Bps is not None for d in devices]
    if any(given) and not all(given):
        i = given.index(False)
        raise ClusterError(f"devices[{i}].activation_bandwidth_Bps: missing on device {devices[i].name!r} but set on "
                           f"{devices[given.index(True)].name!r}; set it on every device or remove it everywhere")


def _check_machine_groups(devices: list[Device]) -> None:
    """A machine belongs to exactly one group."""
    group_of: dict[str, str] = {}
    for i, dev in enumerate(devices):
        if group_of.setdefault(dev.machine, dev.group) != dev.group:
            raise ClusterError(f"devices[{i}].group: machine {dev.machine!r} is in group {group_of[dev.machine]!r} "
                               f"but device {dev.name!r} says {dev.group!r}; give every device of a machine one group")


def _parse_network(value: Any, devices: tuple[Device, ...]) -> tuple[Network, dict[str, CollectiveFit]]:
    """Network latency, the link levels the layout needs, and explicit collective fits."""
    net = _object(value, "network")
    _check_keys(net, _NETWORK_KEYS, "network.")
    latency = _non_negative(_require(net, "latency_s", "network.latency_s"), "network.latency_s", "latency_s")
    levels = _parse_levels(_require(net, "bandwidth_Bps", "network.bandwidth_Bps"), devices)
    explicit = _parse_fits(net.get("collectives", {}))
    return Network(latency_s=latency, bandwidth_Bps=levels), explicit


def _parse_levels(value: Any, devices: tuple[Device, ...]) -> dict[str, float]:
    """Bandwidth per link level; every level the layout uses must be present."""
    levels = _object(value, "network.bandwidth_Bps")
    _check_keys(levels, LINK_LEVELS, "network.bandwidth_Bps.")
    out = {k: _positive(levels[k], f"network.bandwidth_Bps.{k}", "bandwidth_Bps") for k in LINK_LEVELS if k in levels}
    for level in required_link_levels(devices):
        if level not in out:
            raise ClusterError(f"network.bandwidth_Bps.{level}: missing; {_layout_reason(level, devices)}, "
                               f"so give its bandwidth in bytes/s (e.g. 1.25e9 for 10 Gbps)")
    return out


def _layout_reason(level: str, devices: tuple[Device, ...]) -> str:
    """Why the layout needs a link level, in words."""
    if level == "intra_machine":
        return "some machine holds more than one device"
    if level == "inter_machine":
        return f"the devices span {len({d.machine for d in devices})} machines"
    return f"the devices span {len({d.group for d in devices if d.group})} groups"


def _parse_fits(value: Any) -> dict[str, CollectiveFit]:
    """Explicit collective fits keyed by collective name."""
    fits = _object(value, "network.collectives")
    out: dict[str, CollectiveFit] = {}
    for name, fit in fits.items():
        path = f"network.collectives.{name}"
        if name not in COLLECTIVES:
            close = _suggest(str(name), COLLECTIVES)
            tip = f"did you mean {close!r}?" if close else f"known collectives: {', '.join(COLLECTIVES)}"
            raise ClusterError(f"{path}: unknown collective; {tip}")
        fit = _object(fit, path)
        _check_keys(fit, _FIT_KEYS, f"{path}.")
        out[name] = CollectiveFit(
            latency_s=_non_negative(_require(fit, "latency_s", f"{path}.latency_s"), f"{path}.latency_s", "latency_s"),
            bandwidth_Bps=_positive(_require(fit, "bandwidth_Bps", f"{path}.bandwidth_Bps"),
                                    f"{path}.bandwidth_Bps", "bandwidth_Bps"),
            points=_parse_points(fit.get("points"), f"{path}.points"),
        )
    return out


def _parse_points(value: Any, path: str) -> tuple[tuple[float, float], ...]:
    """A fit's measured points: absent/null, or a list of at least two [payload_bytes >= 0, seconds > 0]
    with distinct payloads, kept by increasing payload."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) < 2:
        raise ClusterError(f"{path}: must be a list of at least two [payload_bytes, seconds] pairs, got "
                           f"{value!r}{_hint('points')}")
    out = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ClusterError(f"{path}[{i}]: must be a [payload_bytes, seconds] pair, got {pair!r}{_hint('points')}")
        out.append((_non_negative(pair[0], f"{path}[{i}][0]", "payload_bytes"),
                    _positive(pair[1], f"{path}[{i}][1]", "seconds")))
    out.sort()
    if len({x for x, _ in out}) < len(out):
        raise ClusterError(f"{path}: two points share a payload; give one point per payload{_hint('points')}")
    return tuple(out)
