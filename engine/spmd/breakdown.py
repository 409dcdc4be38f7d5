"""A priced program (HAP §3.2, Fig. 6): its stages, gradient buckets and per-device times.

The cost model (`engine.spmd.cost`) fills a `Breakdown`; the overlap modes (`engine.spmd.overlap`)
price its total and draw its timeline; the plan keeps its stage records. Plain data, below all three.
"""
from __future__ import annotations

from dataclasses import dataclass, field

Acc = tuple[float, float, float, float, float, float, float]
"""Linear work of a stage: (sharded flops, replicated flops, sharded parameter bytes, Full parameter bytes,
sharded activation bytes, replicated activation bytes, operator runs)."""
ZERO: Acc = (0.0,) * 7
Mem = tuple[float, float, float, float, float]
"""Memory terms: (sharded state, replicated state, sharded activations, replicated activations, staged
state split by the state shares z (`engine.spmd.zero`)) bytes."""
MEM_ZERO: Mem = (0.0,) * 5


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
    segment: int = 0
    """The segment whose ratios scale the work."""
    comm_segments: tuple[int, ...] = (0,)
    """Segments whose largest ratio bounds the payload (two for a resplit across a boundary)."""


@dataclass(frozen=True)
class BucketRecord:
    """One gradient bucket of the overlap modes: which Full parameters, and when it runs."""

    params: tuple[int, ...]
    """Parameter node ids, in the slot's order."""
    bytes: float
    duration_s: float
    """latency + bytes * seconds per byte (`CostModel.bucket_line` of its slot)."""
    ready_s: float
    """When its last gradient is ready (ddp), or when both duplex halves have ended."""
    start_s: float
    end_s: float
    stage: int = -1
    """Index (in `Breakdown.stages`) of the backward stage whose computation readies it (ddp)."""
    stage_left_s: tuple[float, ...] = ()
    """Per device, that stage's computation from the bucket's earliest-used parameter on: backward
    reaches the parameter's gradient that long after the stage starts (ddp)."""


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
    ratios: list[list[float]]
    """The ratios evaluated, one row per segment."""
    overlap: str = "none"
    buckets: list[BucketRecord] = field(default_factory=list)
    """The gradient buckets in launch order (ddp, duplex; mode none lists its one bucket as a stage)."""
    tail_s: float = 0.0
    """The per-parameter-byte work after the last all-reduce, slowest device (ddp, duplex)."""
    tail_device_s: list[float] = field(default_factory=list)
    """That work on every device."""
    stage_half_comm_s: list[float] = field(default_factory=list)
    """Per stage, the collective's time for one duplex half (duplex only)."""
    devices: list[str] = field(default_factory=list)
    """The devices' names, in the order of every per-device list."""
    states_s: float = 0.0
    """Seconds of the staged weights' collectives and sharded update after backward (`engine.spmd.zero`),
    included in `total_s`."""
