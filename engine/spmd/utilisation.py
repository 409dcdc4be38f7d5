"""Model FLOPs utilisation (MFU) and the compute lower bound of a plan, of either kind.

Definitions (one place; the CLI, the plans' summaries, the workbench, the benches and `hap run
--timing` all use these):

- **model FLOPs** of one iteration (`model_flops`): over the whole graph at its full batch, every
  node's forward flops (`Node.flops` of the graph IR) plus the backward flops the cost model
  prices for it (`engine.spmd.cost._backward_flops`: one forward's worth per operand that needs a
  gradient, so a matmul with a weight counts 2x in backward and 3x in all). Activation
  recomputation is NOT counted: it is work a plan chooses to add, not work the model needs, so a
  plan that recomputes shows a lower MFU (the convention of "model" as opposed to "hardware" FLOPs
  utilisation). Neither is the optimizer step or any communication. The count depends on the
  graph only, so a plan, which embeds its graph, always has it.
- **peak FLOP/s** (`peak_flops`): the sum over the cluster's devices of `num_gpus` times the
  rate of one GPU in the plan's precision (`Device.flops_per_gpu_in(options.precision)`); a device
  whose spec gives no rate for that dtype counts at its fp32 rate `flops_per_gpu`. These are the
  cluster spec's figures (what the cost model prices matmuls at), not a datasheet's. Every device of
  the cluster the plan was made for counts, also one a pipeline leaves idle: the job holds it.
- **compute bound** = model FLOPs / peak FLOP/s: the iteration time if every device computed the
  model's FLOPs at its rate, perfectly balanced, with no communication and no memory-bound work.
- **MFU** = compute bound / iteration time (the predicted one for a plan; the measured step for
  `hap run --timing`), i.e. model FLOPs / (iteration time x peak FLOP/s).

A plan records its peak (`peak_flops` in its JSON, beside the derived `model_flops`,
`compute_bound_s` and `mfu`); a plan written before these fields has no peak, and its bound and MFU
are None (unknown) until it is priced against a cluster again (`peak_flops(cluster, precision)`).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.cluster.spec import Cluster
from engine.model.graph import Graph
from engine.spmd.cost import _backward_flops
from engine.spmd.saved import requires_grad

FIELDS = ("model_flops", "peak_flops", "compute_bound_s", "mfu")
"""The top-level keys a plan's JSON records (both kinds of plan); only `peak_flops` is read back,
the others are derived from it, the graph and the predicted time."""


def model_flops(graph: Graph) -> float:
    """FLOPs of one training iteration of `graph`: forward plus backward, recomputation not counted."""
    needs_grad = requires_grad(graph)
    return sum(n.flops + _backward_flops(graph, n.id, needs_grad) for n in graph.nodes)


def peak_flops(cluster: Cluster, precision: str = "fp32") -> float:
    """Sum of every device's FLOP/s in `precision` (a device without a rate for it counts at its fp32 rate)."""
    return sum(d.num_gpus * (d.flops_per_gpu_in(precision) or d.flops_per_gpu) for d in cluster.devices)


@dataclass(frozen=True)
class Utilisation:
    """Model FLOPs, peak FLOP/s and an iteration time: the compute bound and the MFU they give."""

    model_flops: float
    peak_flops: float | None
    """None: unknown (a plan written before plans recorded it)."""
    iteration_s: float

    @property
    def compute_bound_s(self) -> float | None:
        """Seconds the model's FLOPs take at the summed peak (None when the peak is unknown)."""
        if not self.peak_flops:
            return None
        return self.model_flops / self.peak_flops

    @property
    def mfu(self) -> float | None:
        """Compute bound over iteration time, below 1 for a real plan (None when unknown)."""
        return self.mfu_at(self.iteration_s)

    def mfu_at(self, iteration_s: float | None) -> float | None:
        """The MFU of another iteration time of the same model on the same devices (a baseline's, a
        measured step's); None when the peak or the time is unknown."""
        bound = self.compute_bound_s
        if bound is None or iteration_s is None or not iteration_s > 0 or not math.isfinite(iteration_s):
            return None
        return bound / iteration_s

    def to_dict(self) -> dict[str, Any]:
        """The plan-JSON fields (`FIELDS`)."""
        return {"model_flops": self.model_flops, "peak_flops": self.peak_flops,
                "compute_bound_s": self.compute_bound_s, "mfu": self.mfu}

    def line(self, what: str = "predicted iteration") -> str:
        """'predicted iteration 8025.00 ms · compute bound 1203.00 ms · MFU 15.0%' (bound and MFU
        'unknown' when the peak is)."""
        bound = self.compute_bound_s
        if bound is None:
            return f"{what} {milliseconds(self.iteration_s)} · compute bound unknown · MFU unknown " \
                   "(the plan records no peak FLOP/s: plan it again with `hap plan`)"
        return f"{what} {milliseconds(self.iteration_s)} · compute bound {milliseconds(bound)} · MFU {percent(self.mfu)}"

    def detail(self, precision: str = "fp32") -> str:
        """'compute bound 1203.00 ms, MFU 15.0% (9.63e+15 model FLOPs per iteration at 8.00e+15 FLOP/s summed
        bf16 peak)': the line a plan's summary adds under its predicted time."""
        bound = self.compute_bound_s
        if bound is None:
            return f"compute bound and MFU unknown: the plan records no peak FLOP/s ({self.model_flops:.3g} model " \
                   "FLOPs per iteration); plan it again with `hap plan`"
        return f"compute bound {milliseconds(bound)}, MFU {percent(self.mfu)} ({self.model_flops:.3g} model FLOPs per " \
               f"iteration at {self.peak_flops:.3g} FLOP/s summed {precision} peak)"


class Utilised:
    """The compute bound and MFU of a plan of either kind, read off its `utilisation` property."""

    utilisation: Utilisation

    @property
    def compute_bound_s(self) -> float | None:
        """The model's FLOPs at the summed peak: no iteration is faster (None when the peak is unknown)."""
        return self.utilisation.compute_bound_s

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation of the predicted iteration: compute bound / predicted time."""
        return self.utilisation.mfu


def of_plan(graph: Graph | None, peak: float | None, iteration_s: float) -> Utilisation:
    """The utilisation of a plan's graph, recorded peak and predicted time (no graph: no FLOPs known)."""
    return Utilisation(model_flops(graph) if graph is not None else 0.0, peak if graph is not None else None,
                       iteration_s)


def recorded(utilisation: Utilisation) -> dict[str, Any]:
    """The fields a plan's JSON records: all of `FIELDS` when the peak is known, none otherwise (a plan
    written before them is written back as it was)."""
    return utilisation.to_dict() if utilisation.peak_flops is not None else {}


def percent(x: float | None) -> str:
    """An MFU as people read it: '15.0%' ('unknown' for None; below 0.1% two significant digits: '0.0093%')."""
    if x is None:
        return "unknown"
    value = x * 100
    if value >= 0.1 or value <= 0:
        return f"{value:.1f}%"
    return f"{value:.{1 - math.floor(math.log10(value))}f}%"  # two significant digits, never in e-notation


def milliseconds(seconds: float) -> str:
    """'1203.45 ms', or three significant digits below a millisecond ('0.000724 ms'): a tiny model's
    bound is not shown as 0."""
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if abs(ms) >= 1 else f"{ms:.3g} ms"


@dataclass(frozen=True)
class DeviceUse:
    """Which of the cluster's devices a plan runs work on, and which it leaves idle (a pipeline may use a
    few groups; an SPMD plan gives every device a share). Said beside the predicted time, so a plan on
    7 of 16 devices never reads as a plan on 16."""

    used: tuple[str, ...]
    idle: tuple[str, ...]

    @classmethod
    def of(cls, device_names: Sequence[str], used: Iterable[int]) -> "DeviceUse":
        """The use of `device_names` (in rank order) when the ranks in `used` run work."""
        ranks = set(used)
        return cls(tuple(n for j, n in enumerate(device_names) if j in ranks),
                   tuple(n for j, n in enumerate(device_names) if j not in ranks))

    @property
    def total(self) -> int:
        return len(self.used) + len(self.idle)

    def line(self) -> str:
        """'uses 7 of 16 devices; idle: a100-7, v100-0 to v100-7' (or 'uses all 4 devices')."""
        if not self.idle:
            return f"uses all {self.total} devices"
        return f"uses {len(self.used)} of {self.total} devices; idle: {name_runs(self.idle)}"


def name_runs(names: Sequence[str]) -> str:
    """Device names with runs of consecutive numbered names shortened: 'a100-7, v100-0 to v100-7'."""
    parts: list[list[tuple[str, str]]] = []
    for name in names:
        m = re.fullmatch(r"(.*?)(\d+)", name)
        head, num = (m.group(1), m.group(2)) if m else (name, "")
        last = parts[-1][-1] if parts else None
        if last and num and last[1] and last[0] == head and int(last[1]) + 1 == int(num):
            parts[-1].append((head, num))
        else:
            parts.append([(head, num)])
    return ", ".join("".join(run[0]) if len(run) == 1 else f"{''.join(run[0])} to {''.join(run[-1])}"
                     for run in parts)
