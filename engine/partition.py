"""Pipeline partitioning (HAPT §5.2, Algorithm 1): stages, their device groups and the microbatch count.

Formulation. The graph's L layers (`engine.stages`) are split into S contiguous stages; stage i
runs on a group of devices of one sub-cluster (`engine.stage_cost`), its per-microbatch time t_i
from the pricer, and c_i is the transfer to stage i+1. For a bound t_max, HAPT's Eq. 13 objective is

    T(t_max) = min over partitions of  sum_i (t_i + 2 c_i)  +  (B - 1) t_max

subject to, for every stage: t_i <= t_max; c_i <= t_max (H-1F1B hides it, §4.1); its memory with
N_i microbatches in flight fits every device (Eq. 24), N_i the H-1F1B warm-up count for this
t_max (N_S = 1, N_i = min(B, N_{i+1} + ceil(1 + 2 c_i / t_max))); and the groups of a sub-cluster
use at most its devices.

Dynamic program (`_Solver`). From the last layer back: the state is (first layer k of the rest,
devices used so far in each sub-cluster, sub-cluster of the rest's first stage, that stage's N),
the value the least sum_i (t_i + 2 c_i) of the rest. A new first stage [k, e) on a group of size g
of sub-cluster a lands at the next aligned offset of a (the count used so far), so its price is
exact; c depends on the two sub-clusters. Tracking N keeps the memory constraint exact (HAPT takes
N from the sub-problem's optimum instead); when no stage's memory binds for any N <= B, the N
axis collapses. States are numpy arrays over the used-device counts, one transition per (k, a, g,
sub-cluster of the next stage) for all stage ends e at once.

t_max candidates (§5.2.2, bidirectional pruning): every stage time t of the price table, sorted;
binary search for the smallest feasible one; then upwards while the bound F(inf) + (B - 1) t_max is
below the best T found (F(t_max) never drops below the unconstrained F(inf)). With `tolerance` > 0,
candidates within a factor (1 + tolerance) are merged into their largest (the answer is then within
that factor of the optimum in its (B - 1) t_max term). B ranges over `microbatch_candidates`.

The DP ranks by Eq. 13; the final choice among the best few is by the simulator
(`engine.schedule`), which also counts each stage's gradient sync after the pipeline drains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .cluster import Cluster
from .errors import InfeasibleError, PlanError
from .schedule import h1f1b_delta
from .stage_cost import (DataParallelPricer, StagePrice, StagePricer, SubCluster, device_signature, sub_clusters,
                         transfer_level, transfer_s)
from .stages import StageGraph

INF = math.inf


@dataclass(frozen=True)
class StageChoice:
    """A stage of a partition: layers [start, end) on `devices` (sub-cluster `sub`, at `offset`)."""

    start: int
    end: int
    sub: int
    offset: int
    size: int
    devices: tuple[int, ...]
    price: StagePrice


@dataclass(frozen=True)
class Partition:
    """The best partition the DP found for one (B, t_max)."""

    stages: tuple[StageChoice, ...]
    microbatches: int
    t_max_bound: float
    objective_s: float
    """HAPT Eq. 13 with the bound: sum_i (t_i + 2 c_i) + (B - 1) t_max."""
    transfers_s: tuple[float, ...]
    warmup: tuple[int, ...]
    """H-1F1B counts under the bound (those the memory check used)."""


@dataclass
class _Table:
    """Prices of every (start, end, sub-cluster, size, offset) for one B, as arrays the solver slices."""

    times: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    """(a, g) -> t[k, e, o] (inf where no stage)."""
    held: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    """(a, g) -> most microbatches in flight that fit, [k, e, o]."""
    prices: dict[tuple[int, int, int, int, int], StagePrice] = field(default_factory=dict)
    transfers: np.ndarray | None = None
    """c[e, a, b]: transfer at cut e from sub-cluster a to b."""


class Partitioner:
    """HAPT's DP over (cut, devices used per sub-cluster) for one graph on one cluster."""

    def __init__(self, stages: StageGraph, cluster: Cluster, pricer: StagePricer | None = None,
                 optimizer: str = "adam") -> None:
        self.stages, self.cluster = stages, cluster
        self.pricer = pricer or DataParallelPricer(cluster, optimizer)
        self.subs: tuple[SubCluster, ...] = sub_clusters(cluster)
        self.levels = [[transfer_level(cluster, a, b) for b in self.subs] for a in self.subs]
        self.block_ids = _layer_signatures(stages)
        self._cache: dict[tuple, StagePrice] = {}

    # --- prices ----------------------------------------------------------------------------
    def price(self, start: int, end: int, sub: int, offset: int, size: int, microbatches: int) -> StagePrice:
        """The pricer's answer, shared by identical blocks of layers on identical groups (HAPT §5.1)."""
        devices = self.subs[sub].devices[offset:offset + size]
        key = (tuple(self.block_ids[start:end]), device_signature(self.cluster, devices), microbatches)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self.pricer(self.stages, start, end, devices, microbatches)
        return hit

    def transfer(self, cut: int, a: int, b: int, microbatches: int) -> float:
        """c at cut `cut` (between layers cut-1 and cut) from a group of sub-cluster a to one of b."""
        info = self.stages.cut(cut)
        nbytes = 0 if info is None else max(info.forward_bytes, info.backward_bytes)
        return transfer_s(self.cluster, self.levels[a][b], nbytes / microbatches)

    def table(self, microbatches: int) -> _Table:
        L, B = self.stages.num_layers, microbatches
        t = _Table()
        for a, sub in enumerate(self.subs):
            for g in sub.group_sizes:
                times = np.full((L + 1, L + 1, sub.size - g + 1), INF)
                held = np.full_like(times, -1.0)
                for o in sub.offsets(g):
                    for k in range(L):
                        for e in range(k + 1, L + 1):
                            p = t.prices[(k, e, a, g, o)] = self.price(k, e, a, o, g, B)
                            times[k, e, o], held[k, e, o] = p.total_s, p.max_held
                t.times[(a, g)], t.held[(a, g)] = times, held
        C = len(self.subs)
        t.transfers = np.array([[[self.transfer(e, a, b, B) for b in range(C)] for a in range(C)] for e in range(L + 1)])
        return t

    # --- search ----------------------------------------------------------------------------
    def search(self, microbatches: int, tolerance: float = 0.0) -> list[Partition]:
        """The DP's best partition for every t_max it evaluates at this B, best objective first."""
        table = self.table(microbatches)
        solver = _Solver(self, table, microbatches)
        free = solver.solve(INF)
        if free is None:
            return []
        candidates = _candidates(table, tolerance)
        lo = _first_feasible(solver, candidates)
        found: list[Partition] = []
        best = INF
        for t_max in candidates[lo:]:
            if free.value + (microbatches - 1) * t_max >= best:
                break
            sol = solver.solve(t_max)
            if sol is None:
                continue
            found.append(solver.partition(sol, t_max))
            best = min(best, found[-1].objective_s)
        return sorted(found, key=lambda p: p.objective_s)


@dataclass
class _Solution:
    value: float
    arrays: dict[int, np.ndarray]
    """Sub-cluster of the first stage -> value array [k, used..., N]."""
    index: tuple[int, ...]
    """(a, k=0, used..., N) of the optimum."""


class _Solver:
    """The DP of the module docstring for one B (see `Partitioner.search`)."""

    def __init__(self, part: Partitioner, table: _Table, microbatches: int) -> None:
        self.part, self.table, self.B = part, table, microbatches
        self.subs = part.subs
        self.L = part.stages.num_layers
        self.grid = tuple(s.size + 1 for s in self.subs)
        finite = [h[np.isfinite(self.table.times[key])] for key, h in self.table.held.items()]
        self.collapse = all(((x >= microbatches) | (x < 1)).all() for x in finite)
        self.NB = 1 if self.collapse else microbatches + 1

    def solve(self, t_max: float) -> _Solution | None:
        C, L = len(self.subs), self.L
        V = {a: np.full((L + 1, *self.grid, self.NB), INF) for a in range(C)}
        for k in range(L - 1, -1, -1):
            for a in range(C):
                for g in self.subs[a].group_sizes:
                    self._base(V[a], k, a, g, t_max)
                    for b in range(C):
                        self._extend(V, k, a, g, b, t_max)
        best = min(((V[a][0].min(), a) for a in range(C)), default=(INF, 0))
        if not math.isfinite(best[0]):
            return None
        a = best[1]
        index = (a, 0, *np.unravel_index(int(np.argmin(V[a][0])), V[a][0].shape))
        return _Solution(float(best[0]), V, tuple(int(i) for i in index))

    def _times(self, a: int, g: int, k: int, t_max: float) -> tuple[np.ndarray, np.ndarray]:
        """t[e, o] of stages starting at k (inf above t_max) and the microbatches they can hold."""
        t = self.table.times[(a, g)][k]
        return np.where(t <= t_max, t, INF), self.table.held[(a, g)][k]

    def _base(self, Va: np.ndarray, k: int, a: int, g: int, t_max: float) -> None:
        """The last stage [k, L): N = 1, at offset 0 of its sub-cluster."""
        t, held = self._times(a, g, k, t_max)
        if not math.isfinite(t[self.L, 0]) or held[self.L, 0] < (self.B if self.collapse else 1):
            return
        idx = [k, *[0] * len(self.subs), 0 if self.collapse else 1]
        idx[1 + a] = g
        Va[tuple(idx)] = min(Va[tuple(idx)], t[self.L, 0])

    def _extend(self, V: dict[int, np.ndarray], k: int, a: int, g: int, b: int, t_max: float) -> None:
        """Stage [k, e) on g devices of a before a rest whose first stage is on b, for every e at once."""
        n_a = self.subs[a].size
        t, held = self._times(a, g, k, t_max)
        es = np.arange(k + 1, self.L)
        if not len(es):
            return
        c = self.table.transfers[es, a, b]
        ok = (c <= t_max) & np.isfinite(t[es]).any(axis=1)
        if not ok.any():
            return
        src = V[b][es[ok]].take(np.arange(n_a - g + 1), axis=1 + a)  # rest used o = used[a] devices of a
        cand = src + _along(t[es[ok]], 1 + a, src.ndim) + _along(2 * c[ok], 0, src.ndim)
        dst = V[a][k][tuple(slice(g, None) if ax == a else slice(None) for ax in range(len(self.subs)))]
        if self.collapse:
            np.minimum(dst, cand.min(axis=0), out=dst)
            return
        deltas = np.array([h1f1b_delta(x, t_max) for x in c[ok]])
        for d in np.unique(deltas):
            sel = deltas == d
            shifted = _shift_n(cand[sel], int(d), self.B)  # N of this stage = min(N of the rest + delta, B)
            fits = np.arange(self.NB)[None, None, :] <= held[es[ok][sel], :n_a - g + 1, None]  # Eq. 24
            shape = [1] * shifted.ndim
            shape[0], shape[1 + a], shape[-1] = fits.shape
            np.minimum(dst, np.where(fits.reshape(shape), shifted, INF).min(axis=0), out=dst)

    def partition(self, sol: _Solution, t_max: float) -> Partition:
        """Walk the optimum forward, re-finding each stage's choice in the value arrays."""
        a, k, *used = sol.index
        n = used.pop()
        used, value, stages = list(used), sol.value, []
        while True:
            choice = self._find(sol, k, a, used, n, value, t_max)
            stages.append(choice[0])
            if choice[1] is None:
                break
            (k, a, used, n, value) = choice[1]
        return self._partition(tuple(stages), t_max)

    def _find(self, sol, k, a, used, n, value, t_max):
        """The stage at k on sub-cluster a (and the rest's state) that gives `value`."""
        for g in self.subs[a].group_sizes:
            if used[a] < g:
                continue
            rest = list(used)
            rest[a] -= g
            o = rest[a]
            t, held = self._times(a, g, k, t_max)
            if t.shape[1] <= o:
                continue
            if all(x == 0 for x in rest) and math.isclose(t[self.L, o], value, rel_tol=1e-9, abs_tol=1e-15) \
                    and (self.collapse or n == 1):
                return self._choice(k, self.L, a, o, g), None
            for e in range(k + 1, self.L):
                for b in range(len(self.subs)):
                    c = float(self.table.transfers[e, a, b])
                    if c > t_max or not math.isfinite(t[e, o]):
                        continue
                    nexts = [0] if self.collapse else [m for m in range(1, self.B + 1)
                                                       if min(m + h1f1b_delta(c, t_max), self.B) == n and n <= held[e, o]]
                    for m in nexts:
                        v = sol.arrays[b][(e, *rest, m)]
                        if math.isfinite(v) and math.isclose(v + t[e, o] + 2 * c, value, rel_tol=1e-9, abs_tol=1e-15):
                            return self._choice(k, e, a, o, g), (e, b, rest, m, float(v))
        raise AssertionError("DP reconstruction found no stage for the optimum")

    def _choice(self, k: int, e: int, a: int, o: int, g: int) -> StageChoice:
        sub = self.subs[a]
        return StageChoice(k, e, a, o, g, sub.devices[o:o + g], self.table.prices[(k, e, a, g, o)])

    def _partition(self, stages: tuple[StageChoice, ...], t_max: float) -> Partition:
        c = tuple(float(self.table.transfers[s.end, s.sub, nxt.sub]) for s, nxt in zip(stages, stages[1:]))
        warm = [1]
        for x in reversed(c):
            warm.append(min(self.B, warm[-1] + h1f1b_delta(x, t_max)))
        objective = sum(s.price.total_s for s in stages) + 2 * sum(c) + (self.B - 1) * t_max
        return Partition(stages, self.B, t_max, objective, c, tuple(warm[::-1]))


def _along(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """Reshape a 1- or 2-d array (axes 0 and `axis`) to broadcast over `ndim` dims."""
    if v.ndim == 1:
        shape = [1] * ndim
        shape[axis] = v.shape[0]
        return v.reshape(shape)
    shape = [1] * ndim
    shape[0], shape[axis] = v.shape
    return v.reshape(shape)


def _shift_n(x: np.ndarray, delta: int, B: int) -> np.ndarray:
    """Move the N axis (last) by delta with N capped at B: out[..., min(N + delta, B)] = min x[..., N]."""
    out = np.full_like(x, INF)
    if delta < B:
        out[..., delta:B] = x[..., :B - delta]
    out[..., B] = x[..., max(B - delta, 0):].min(axis=-1)
    return out


def _candidates(table: _Table, tolerance: float) -> list[float]:
    values = sorted({float(x) for arr in table.times.values() for x in arr[np.isfinite(arr)]})
    if tolerance <= 0 or not values:
        return values
    merged: list[float] = []
    for v in values:  # keep the largest of each run within a factor (1 + tolerance) of its smallest
        if merged and v <= merged[-1][0] * (1 + tolerance):
            merged[-1] = (merged[-1][0], v)
        else:
            merged.append((v, v))
    return [hi for _, hi in merged]


def _first_feasible(solver: _Solver, candidates: list[float]) -> int:
    """Binary search for the smallest t_max with a partition (feasibility grows with t_max)."""
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if solver.solve(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _layer_signatures(stages: StageGraph) -> list[int]:
    """An id per layer, equal for layers that compute the same thing on the same shapes (repeated blocks)."""
    graph, ids, out = stages.graph, {}, []
    for layer in stages.layers:
        first = layer[0] if layer else 0
        key = []
        for i in layer:
            n = graph[i]
            refs = tuple(("in", j - first) if j >= first and stages.layer_of.get(j) == stages.layer_of[i]
                         else ("out", graph[j].op, graph[j].shape, graph[j].dtype) for j in n.inputs)
            key.append((n.op, n.shape, n.dtype, n.flops, repr(sorted(n.attrs.items())), refs))
        out.append(ids.setdefault(tuple(key), len(ids)))
    return out
