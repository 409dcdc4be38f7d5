"""Hierarchical collectives (Hetu v2 §4; DESIGN "Resharding"): inside each machine, then across
machines, then inside again, each step a standard collective over a sub-group, priced per link level.

A layout of M machines of k devices each (k >= 2, M >= 2, every machine the same k) numbers each
device by (machine i, local index r). The *machine group* of i holds its k devices; the *peer
group* of r holds the r-th device of every machine (one shard per machine). With N the bytes of
the whole tensor and s those of the largest shard:

| collective           | steps                                                                  |
|----------------------|------------------------------------------------------------------------|
| all_reduce.hier      | reduce-scatter in the machine (N/k each), all-reduce of that piece     |
|                      | across the peers, all-gather in the machine                            |
| all_gather.hier      | all-gather across the peers (s each), then in the machine (M s each)   |
| reduce_scatter.hier  | reduce-scatter in the machine (M s each), then across the peers (s)    |

Each step is priced by the nominal ring fit of its level (`engine.cluster.spec.nominal_collectives`):
the machine level over k devices at the `intra_machine` bandwidth, the peer level over M devices
at the slowest level between machines (`inter_machine`, and `inter_group` when there are several
groups) divided by k, because the k peer groups of a machine share its link. So the
hierarchical collectives move about the bytes a flat ring moves across machines, and save the
latency of (k-1)(M-1) ring hops (2x for all-reduce); the cost model keeps whichever is cheaper.

Not offered (`hierarchy_of` is None) with one machine, one device per machine, or machines of
unequal sizes. The fits are nominal even when the cluster spec carries measured flat fits (`hap
profile` does not yet time the levels apart).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.cluster.spec import FREE_BANDWIDTH_BPS, Cluster, CollectiveFit, nominal_collectives

HIER_KEYS: tuple[str, ...] = ("all_reduce.hier", "all_gather.hier", "reduce_scatter.hier")
"""Collective keys (engine.theory.collectives) with a hierarchical implementation."""


def machine_groups(machines: Sequence[str]) -> tuple[tuple[int, ...], ...] | None:
    """Device indices grouped by machine (machines in order of first appearance), or None when the
    layout cannot run hierarchically: fewer than 2 machines, or machines not all of k >= 2 devices."""
    groups: dict[str, list[int]] = {}
    for j, name in enumerate(machines):
        groups.setdefault(name, []).append(j)
    sizes = {len(g) for g in groups.values()}
    if len(groups) < 2 or len(sizes) != 1 or sizes.pop() < 2:
        return None
    return tuple(tuple(g) for g in groups.values())


def peer_groups(machines: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The r-th device of every machine, for each local index r."""
    return tuple(zip(*machines))


@dataclass(frozen=True)
class Hierarchy:
    """Two link levels of a cluster: M machines of k devices and the fits of each level's rings."""

    machines: tuple[tuple[int, ...], ...]
    """Device indices of each machine."""
    intra: dict[str, CollectiveFit]
    """Ring fits over the k devices of one machine at the intra_machine bandwidth."""
    inter: dict[str, CollectiveFit]
    """Ring fits over the M devices of one peer group at 1/k of the bandwidth between machines."""

    @property
    def machine_size(self) -> int:
        return len(self.machines[0])

    @property
    def num_machines(self) -> int:
        return len(self.machines)

    def terms(self, key: str, nbytes: float) -> tuple[float, float]:
        """(constant, per max-ratio) seconds of hierarchical collective `key` on a tensor of `nbytes`
        (the same split as `engine.spmd.cost.CostModel.comm_terms`: all-reduce is constant, the others
        scale with the largest shard)."""
        k, m = self.machine_size, self.num_machines
        if key == "all_reduce.hier":
            piece = nbytes / k
            steps = [(self.intra["reduce_scatter"], piece), (self.inter["all_reduce"], piece),
                     (self.intra["all_gather"], piece)]
            return sum(f.latency_s + b / f.bandwidth_Bps for f, b in steps), 0.0
        if key in ("all_gather.hier", "reduce_scatter.hier"):
            steps = [(self.inter[key.split(".")[0]], 1.0), (self.intra[key.split(".")[0]], float(m))]
            return sum(f.latency_s for f, _ in steps), sum(nbytes * b / f.bandwidth_Bps for f, b in steps)
        raise KeyError(f"'{key}' has no hierarchical implementation (those are: {', '.join(HIER_KEYS)})")


def hierarchy_of(cluster: Cluster) -> Hierarchy | None:
    """The cluster's two levels, or None when hierarchical collectives are not offered on it."""
    machines = machine_groups([d.machine for d in cluster.devices])
    if machines is None:
        return None
    levels = cluster.network.bandwidth_Bps
    between = [levels[lv] for lv in cluster.link_levels if lv != "intra_machine"]
    inter_Bps = min(between, default=FREE_BANDWIDTH_BPS)
    k, a = len(machines[0]), cluster.network.latency_s
    return Hierarchy(machines, nominal_collectives(k, a, levels["intra_machine"]),
                     nominal_collectives(len(machines), a, inter_Bps / k))
