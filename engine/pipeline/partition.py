"""Pipeline partitioning (HAPT §5.2, Algorithm 1): stages, their device groups and the microbatch count.

Formulation. The graph's L layers (`engine.pipeline.stages`) are split into S contiguous stages; stage i
runs on a group of devices of one sub-cluster (`engine.pipeline.stage_cost`), its per-microbatch time t_i
from the pricer, and c_i is the transfer to stage i+1. For a bound t_max, HAPT's Eq. 13 objective is

    T(t_max) = min over partitions of  sum_i (t_i + 2 c_i + u_i)  +  (B - 1) t_max

where u_i is stage i's gradient sync after the pipeline drains (its all-reduce inside its group and
its optimizer step; HAPT leaves it out). The syncs of different stages overlap in time, so the sum
over-counts them (their maximum, roughly, is what the simulator charges), but without it the DP
spreads a stage over a sub-cluster whose all-reduce crosses a slow link. Subject to, for every
stage: t_i <= t_max; c_i <= t_max (H-1F1B hides it, §4.1); its memory with N_i microbatches
in flight fits every device (Eq. 24), N_i the H-1F1B warm-up count for this
t_max (N_S = 1, N_i = min(B, N_{i+1} + ceil(1 + 2 c_i / t_max))); and the groups of a sub-cluster
use at most its devices; a group has at most as many devices as a microbatch has samples; no cut
separates the uses of a parameter (a tied weight: its transfer is priced infinite, since the two
stages would train two copies).

Dynamic program (`_Solver`). From the last layer back: the state is (first layer k of the rest,
devices used so far in each sub-cluster, sub-cluster of the rest's first stage, that stage's N),
the value the least sum_i (t_i + 2 c_i + u_i) of the rest. A new first stage [k, e) on a group of size g
of sub-cluster a lands at the next aligned offset of a (the count used so far), so its price is
exact; c depends on the two sub-clusters. Tracking N keeps the memory constraint exact (HAPT takes
N from the sub-problem's optimum instead); when no stage within t_max has a memory that binds
for some N <= B, the N axis collapses. States are numpy arrays over the used-device counts, one transition per (k, a, g,
sub-cluster of the next stage) for all stage ends e at once.

t_max candidates (§5.2.2, bidirectional pruning): every stage time t of the price table, sorted;
binary search for the smallest feasible one; then upwards while the bound F(inf) + (B - 1) t_max is
below the best T found (F(t_max) never drops below the unconstrained F(inf)). With `tolerance` > 0,
candidates within a factor (1 + tolerance) are merged into their largest (the answer is then within
that factor of the optimum in its (B - 1) t_max term). B ranges over `microbatch_candidates`.

The DP ranks by this objective; `best_pipeline` picks among the best few partitions of every B by
the simulator (`engine.pipeline.schedule`, H-1F1B), which charges the syncs as they overlap, and reports the
chosen partition under every schedule.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from engine.cluster.spec import Cluster
from engine.errors import InfeasibleError, PlanError
from engine.options import PlanOptions
from engine.pipeline.plan import Boundary, PipelinePlan, PipelineStage, ScheduleResult, timeline_boxes
from engine.pipeline.schedule import (SCHEDULES, Pipeline, PipelineRun, StageTimes, closed_form_s, h1f1b_delta,
                                      run_schedule, warmup_counts)
from engine.pipeline.stage_cost import (DataParallelPricer, StagePrice, StagePricer, SubCluster, device_signature,
                                        sub_clusters, transfer_level, transfer_s)
from engine.pipeline.stages import StageGraph, batch_of, microbatch_candidates
from engine.spmd.precision import ACTIVATION_BYTES
from engine.spmd.utilisation import peak_flops

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
    """HAPT Eq. 13 with the bound, plus every stage's sync: sum_i (t_i + 2 c_i + u_i) + (B - 1) t_max."""
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
    syncs: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    """(a, g) -> the stage's gradient sync after the drain, [k, e, o]."""
    prices: dict[tuple[int, int, int, int, int], StagePrice] = field(default_factory=dict)
    transfers: np.ndarray | None = None
    """c[e, a, b]: transfer at cut e from sub-cluster a to b."""


class Partitioner:
    """HAPT's DP over (cut, devices used per sub-cluster) for one graph on one cluster."""

    def __init__(self, stages: StageGraph, cluster: Cluster, pricer: StagePricer | None = None,
                 options: PlanOptions = PlanOptions(), epsilon: float = 0.0) -> None:
        self.stages, self.cluster, self.epsilon = stages, cluster, epsilon
        """HAPT Eq. 2's epsilon: a transfer of at most epsilon t_max adds one warm-up forward, not two."""
        self.pricer = pricer or DataParallelPricer(cluster, options)
        self.activation_scale = ACTIVATION_BYTES[options.precision]
        """Bytes of a boundary tensor per captured byte (2-byte activations under mixed precision)."""
        self.subs: tuple[SubCluster, ...] = sub_clusters(cluster)
        self.levels = [[transfer_level(cluster, a, b) for b in self.subs] for a in self.subs]
        self.batch = batch_of(stages.graph)
        self.block_ids = layer_signatures(stages)
        blocks: dict[tuple[int, ...], int] = {}
        L = stages.num_layers
        self.block_key = [[blocks.setdefault(tuple(self.block_ids[k:e]), len(blocks)) if e > k else -1
                           for e in range(L + 1)] for k in range(L + 1)]
        """An id per run of layers [k, e), equal for identical runs (repeated blocks are priced once)."""
        self._cache: dict[tuple, StagePrice] = {}

    # --- prices ----------------------------------------------------------------------------
    def price(self, start: int, end: int, sub: int, offset: int, size: int, microbatches: int) -> StagePrice:
        """The pricer's answer, shared by identical blocks of layers on identical groups (HAPT §5.1)."""
        sig = device_signature(self.cluster, self.subs[sub].devices[offset:offset + size])
        return self._price(start, end, sig, sub, offset, size, microbatches)

    def transfer(self, cut: int, a: int, b: int, microbatches: int) -> float:
        """c at cut `cut` (between layers cut-1 and cut) from a group of sub-cluster a to one of b; inf
        where a parameter is used on both sides (a tied weight: the stages would train two copies)."""
        if self.stages.tied_at(cut):
            return INF
        info = self.stages.cut(cut)
        nbytes = 0 if info is None else max(info.forward_bytes, info.backward_bytes) * self.activation_scale
        return transfer_s(self.cluster, self.levels[a][b], nbytes / microbatches)

    def table(self, microbatches: int) -> _Table:
        """Every stage's price at B, each distinct (block, group) priced once."""
        L, B = self.stages.num_layers, microbatches
        t = _Table()
        for a, sub in enumerate(self.subs):
            for g in sub.group_sizes:
                times = np.full((L + 1, L + 1, sub.size - g + 1), INF)
                held, syncs = np.full_like(times, -1.0), np.zeros_like(times)
                t.times[(a, g)], t.held[(a, g)], t.syncs[(a, g)] = times, held, syncs
                if g * B > self.batch:  # a device of the group would get no sample of a microbatch
                    continue
                places: dict[tuple, list[int]] = {}
                for o in sub.offsets(g):
                    places.setdefault(device_signature(self.cluster, sub.devices[o:o + g]), []).append(o)
                for sig, offsets in places.items():  # offsets with the same layout share every price
                    for k in range(L):
                        for e in range(k + 1, L + 1):
                            p = self._price(k, e, sig, a, offsets[0], g, B)
                            times[k, e, offsets], held[k, e, offsets] = p.total_s, p.max_held
                            syncs[k, e, offsets] = p.sync_s
                            t.prices.update({(k, e, a, g, o): p for o in offsets})
        C = len(self.subs)
        t.transfers = np.array([[[self.transfer(e, a, b, B) for b in range(C)] for a in range(C)]
                                for e in range(L + 1)])
        return t

    def _price(self, k: int, e: int, sig: tuple, a: int, o: int, g: int, B: int) -> StagePrice:
        key = (self.block_key[k][e], sig, B)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self.pricer(self.stages, k, e, self.subs[a].devices[o:o + g], B)
        return hit

    # --- search ----------------------------------------------------------------------------
    def search(self, microbatches: int, tolerance: float = 0.0, floor_s: float = INF) -> list[Partition]:
        """The DP's best partition for every t_max it evaluates at this B, best objective first. None
        when B times the smallest feasible t_max is at least `floor_s`: every microbatch passes the
        slowest stage, so no partition at this B runs an iteration faster than that."""
        table = self.table(microbatches)
        solver = _Solver(self, table, microbatches)
        free = solver.solve(INF)
        if free is None:
            return []
        candidates = _candidates(table, tolerance)
        lo = _first_feasible(solver, candidates)
        if lo == len(candidates) or microbatches * candidates[lo] >= floor_s:
            return []
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
    collapsed: bool
    """Whether the N axis was dropped (no memory constraint binds)."""


class _Solver:
    """The DP of the module docstring for one B (see `Partitioner.search`)."""

    def __init__(self, part: Partitioner, table: _Table, microbatches: int) -> None:
        self.part, self.table, self.B = part, table, microbatches
        self.subs = part.subs
        self.L = part.stages.num_layers
        self.grid = tuple(s.size + 1 for s in self.subs)
        self.collapse, self.NB = False, microbatches + 1

    def _memory_binds(self, t_max: float) -> bool:
        """Whether some stage within t_max fits its state but not B microbatches in flight."""
        for key, held in self.table.held.items():
            h = held[self.table.times[key] <= t_max]
            if ((h >= 1) & (h < self.B)).any():
                return True
        return False

    def solve(self, t_max: float) -> _Solution | None:
        C, L = len(self.subs), self.L
        self.collapse = not self._memory_binds(t_max)  # then N never matters: drop its axis
        self.NB = 1 if self.collapse else self.B + 1
        self._masked = {key: self._mask_times(key, t_max) for key in self.table.times}
        c = self.table.transfers  # [e, a, b]
        self._step = {(a, g, b): self._masked[(a, g)] + self.table.syncs[(a, g)]
                      + np.where(c[:, a, b] <= t_max, 2 * c[:, a, b], INF)[None, :, None]
                      for (a, g) in self._masked for b in range(C)}  # t + u + 2c of stage [k, e) at offset o
        eps = self.part.epsilon
        self._deltas = np.array([[[h1f1b_delta(float(x), t_max, eps) if x <= t_max and x < INF else 0 for x in c[:, a, b]]
                                  for b in range(C)] for a in range(C)], dtype=int)
        V = {a: np.full((L + 1, *self.grid, self.NB), INF) for a in range(C)}
        for k in range(L - 1, -1, -1):
            for a in range(C):
                for g in self.subs[a].group_sizes:
                    if not np.isfinite(self._masked[(a, g)][k]).any():
                        continue
                    self._base(V[a], k, a, g, t_max)
                    for b in range(C):
                        self._extend(V, k, a, g, b, t_max)
        best = min(((V[a][0].min(), a) for a in range(C)), default=(INF, 0))
        if not math.isfinite(best[0]):
            return None
        a = best[1]
        index = (a, 0, *np.unravel_index(int(np.argmin(V[a][0])), V[a][0].shape))
        return _Solution(float(best[0]), V, tuple(int(i) for i in index), self.collapse)

    def _mask_times(self, key: tuple[int, int], t_max: float) -> np.ndarray:
        """Stage times with inf where a stage is slower than t_max or does not fit its memory."""
        t, held = self.table.times[key], self.table.held[key]
        return np.where((t <= t_max) & (held >= (self.B if self.collapse else 1)), t, INF)

    def _times(self, a: int, g: int, k: int, t_max: float) -> tuple[np.ndarray, np.ndarray]:
        """t[e, o] of stages starting at k (inf above t_max or out of memory) and the microbatches they can hold."""
        return self._masked[(a, g)][k], self.table.held[(a, g)][k]

    def _base(self, Va: np.ndarray, k: int, a: int, g: int, t_max: float) -> None:
        """The last stage [k, L): N = 1, at offset 0 of its sub-cluster."""
        t, held = self._times(a, g, k, t_max)
        if not math.isfinite(t[self.L, 0]):
            return
        idx = [k, *[0] * len(self.subs), 0 if self.collapse else 1]
        idx[1 + a] = g
        Va[tuple(idx)] = min(Va[tuple(idx)], t[self.L, 0] + self.table.syncs[(a, g)][k, self.L, 0])

    def _extend(self, V: dict[int, np.ndarray], k: int, a: int, g: int, b: int, t_max: float) -> None:
        """Stage [k, e) on g devices of a before a rest whose first stage is on b, for every e at once."""
        L, n_o = self.L, self.subs[a].size - g + 1
        if k + 1 >= L:
            return
        cost = self._step[(a, g, b)][k, k + 1:L]  # (E, n_o): t + 2c, inf where not allowed
        live = np.isfinite(cost).any(axis=1)
        if not live.any():
            return
        lo = k + 1 + int(np.argmax(live))  # the first useful end; later ones may be inf (harmless)
        cost = cost[lo - k - 1:]
        window = (slice(lo, L), *(slice(0, n_o) if ax == a else slice(None) for ax in range(len(self.subs))))
        cand = V[b][window] + _along(cost, 1 + a, V[b].ndim)  # rest used o = used[a] devices of a
        dst = V[a][k][tuple(slice(g, None) if ax == a else slice(None) for ax in range(len(self.subs)))]
        if self.collapse:
            np.minimum(dst, cand.min(axis=0), out=dst)
            return
        held = self.table.held[(a, g)][k, lo:L]
        deltas = self._deltas[a, b, lo:L]
        for d in np.unique(deltas):
            sel = deltas == d
            shifted = _shift_n(cand[sel], int(d), self.B)  # N of this stage = min(N of the rest + delta, B)
            fits = np.arange(self.NB)[None, None, :] <= held[sel][:, :, None]  # Eq. 24
            shape = [1] * shifted.ndim
            shape[0], shape[1 + a], shape[-1] = fits.shape
            np.minimum(dst, np.where(fits.reshape(shape), shifted, INF).min(axis=0), out=dst)

    def partition(self, sol: _Solution, t_max: float) -> Partition:
        """Walk the optimum forward, re-finding each stage's choice in the value arrays."""
        self.collapse, self.NB = sol.collapsed, 1 if sol.collapsed else self.B + 1
        self._masked = {key: self._mask_times(key, t_max) for key in self.table.times}
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

    def _find(self, sol: _Solution, k: int, a: int, used: list[int], n: int, value: float, t_max: float):
        """The stage at k on sub-cluster a, and the rest's state (None for the last stage), that give `value`."""
        for g in self.subs[a].group_sizes:
            rest = list(used)
            rest[a] -= g
            o = rest[a]
            if o < 0:
                continue
            t, held = self._times(a, g, k, t_max)
            own = t[:, o] + self.table.syncs[(a, g)][k][:, o]
            if not any(rest) and _same(own[self.L], value) and (self.collapse or n == 1):
                return self._choice(k, self.L, a, o, g), None
            for e, b in ((e, b) for e in range(k + 1, self.L) for b in range(len(self.subs))):
                c = float(self.table.transfers[e, a, b])
                if c > t_max or not math.isfinite(c) or not math.isfinite(own[e]):
                    continue
                for m in self._rest_counts(n, c, t_max, held[e, o]):
                    v = float(sol.arrays[b][(e, *rest, m)])
                    if _same(v + own[e] + 2 * c, value):
                        return self._choice(k, e, a, o, g), (e, b, rest, m, v)
        raise AssertionError("DP reconstruction found no stage for the optimum")

    def _rest_counts(self, n: int, c: float, t_max: float, held: float) -> list[int]:
        """The rest's first-stage N values that give this stage N = n (any, when N is not tracked)."""
        if self.collapse:
            return [0]
        if n > held:
            return []
        delta = h1f1b_delta(c, t_max, self.part.epsilon)
        return [m for m in range(1, self.B + 1) if min(m + delta, self.B) == n]

    def _choice(self, k: int, e: int, a: int, o: int, g: int) -> StageChoice:
        sub = self.subs[a]
        return StageChoice(k, e, a, o, g, sub.devices[o:o + g], self.table.prices[(k, e, a, g, o)])

    def _partition(self, stages: tuple[StageChoice, ...], t_max: float) -> Partition:
        c = tuple(float(self.table.transfers[s.end, s.sub, nxt.sub]) for s, nxt in zip(stages, stages[1:]))
        warm = [1]
        for x in reversed(c):
            warm.append(min(self.B, warm[-1] + h1f1b_delta(x, t_max, self.part.epsilon)))
        objective = sum(s.price.total_s + s.price.sync_s for s in stages) + 2 * sum(c) + (self.B - 1) * t_max
        return Partition(stages, self.B, t_max, objective, c, tuple(warm[::-1]))


def _same(x: float, y: float) -> bool:
    return math.isfinite(x) and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-15)


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


def layer_signatures(stages: StageGraph) -> list[int]:
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


# ----------------------------------------------------------------------------- the best pipeline


def best_pipeline(graph, cluster: Cluster, microbatches: int | None = None, *, pricer: StagePricer | None = None,
                  options: PlanOptions = PlanOptions(), tolerance: float = 0.05, finalists: int = 3,
                  epsilon: float = 0.0) -> PipelinePlan:
    """The fastest simulated H-1F1B pipeline among the DP's best `finalists` partitions per B (a B
    that cannot beat the best simulated so far is skipped, see `Partitioner.search`)."""
    start = time.perf_counter()
    stages = StageGraph(graph)
    part = Partitioner(stages, cluster, pricer, options, epsilon)
    counts = [microbatches] if microbatches else microbatch_candidates(graph)
    if any(not isinstance(b, int) or b < 1 for b in counts):
        raise PlanError(f"microbatches = {microbatches!r}; give a positive integer (or None to search)")
    best: tuple[float, Partition, PipelineRun] | None = None
    for B in sorted(counts, reverse=True):
        for p in part.search(B, tolerance, best[0] if best else INF)[:finalists]:
            pipe, warm = _pipeline_of(p, epsilon)
            run = run_schedule(pipe, "h-1f1b", warmup=warm)
            if best is None or run.iteration_s < best[0]:
                best = (run.iteration_s, p, run)
    if best is None:
        raise InfeasibleError(f"no pipeline of {graph.name} fits {cluster.name}: every stage on every device group "
                              "runs out of memory or a boundary transfer is slower than the slowest stage; "
                              "add devices, use fewer microbatches, or shrink the model")
    plan = _plan(part, best[1], best[2], time.perf_counter() - start)
    return replace(plan, graph=graph, cluster_name=cluster.name, cluster_fingerprint=cluster.fingerprint(),
                   device_names=tuple(d.name for d in cluster.devices), timeline=timeline_boxes(best[2].timeline),
                   peak_flops=peak_flops(cluster, options.precision))


def fixed_pipeline(graph, cluster: Cluster, stages: list[tuple[int, int, tuple[int, ...]]], microbatches: int,
                   schedule: str = "h-1f1b", *, options: PlanOptions = PlanOptions()) -> PipelinePlan:
    """The plan of a partition given by hand: `stages` as (first layer, end layer, device ranks), priced
    and simulated as `best_pipeline` prices its own (for tests, benches and users who fix the cuts).
    A group may mix sub-clusters (its transfers are priced from its first device's sub-cluster)."""
    start = time.perf_counter()
    sg = StageGraph(graph)
    part = Partitioner(sg, cluster, None, options)
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {schedule!r} (choose one of: {', '.join(SCHEDULES)})")
    bounds = [k for k, _, _ in stages] + [stages[-1][1] if stages else 0]
    if not stages or bounds[0] != 0 or bounds[-1] != sg.num_layers or any(e != k2 for (_, e, _), k2 in zip(stages, bounds[1:]))\
            or any(k >= e for k, e, _ in stages):
        raise PlanError(f"stages {[(k, e) for k, e, _ in stages]} must be consecutive non-empty runs of layers covering "
                        f"0..{sg.num_layers} (the graph has {sg.num_layers} layers)")
    for k, _, _ in stages[1:]:
        if tied := sg.tied_at(k):
            raise PlanError(f"a stage boundary at layer {k} separates the uses of parameter {graph[tied[0]].name} (a "
                            "tied weight), which the stages would train as two copies; put its uses in one stage")
    choices = []
    for k, e, devices in stages:
        sub = next((a for a, s in enumerate(part.subs) if devices and devices[0] in s.devices), None)
        if sub is None or len(set(devices)) != len(devices) or not all(0 <= j < cluster.num_devices for j in devices):
            raise PlanError(f"stage [{k}, {e}) on devices {devices}: give distinct ranks of the cluster's "
                            f"{cluster.num_devices} devices")
        price = part.pricer(sg, k, e, tuple(devices), microbatches)
        choices.append(StageChoice(k, e, sub, part.subs[sub].devices.index(devices[0]), len(devices),
                                   tuple(devices), price))
    transfers = tuple(part.transfer(s.end, s.sub, n.sub, microbatches) for s, n in zip(choices, choices[1:]))
    p = Partition(tuple(choices), microbatches, INF, 0.0, transfers, ())
    pipe, _ = _pipeline_of(p, 0.0, fixed=True)
    run = run_schedule(pipe, schedule)
    plan = _plan(part, p, run, time.perf_counter() - start)
    return replace(plan, graph=graph, cluster_name=cluster.name, cluster_fingerprint=cluster.fingerprint(),
                   device_names=tuple(d.name for d in cluster.devices), timeline=timeline_boxes(run.timeline),
                   peak_flops=peak_flops(cluster, options.precision))


def _pipeline_of(p: Partition, epsilon: float = 0.0, fixed: bool = False) -> tuple[Pipeline, tuple[int, ...]]:
    """The schedule's view of a partition, and its H-1F1B counts: for its own t_max when they fit
    memory, else those the DP checked (for the DP's larger t_max bound, so fewer)."""
    pipe = Pipeline(tuple(StageTimes(s.price.forward_s, s.price.backward_s, max(s.price.activation_bytes),
                                     s.price.sync_s) for s in p.stages), p.transfers_s, p.microbatches)
    exact = warmup_counts("h-1f1b", pipe, epsilon)
    if fixed:
        return pipe, exact
    fits = all(n <= s.price.max_held for n, s in zip(exact, p.stages))
    return pipe, exact if fits else p.warmup


def _plan(part: Partitioner, p: Partition, run: PipelineRun, planning_s: float) -> PipelinePlan:
    """The plan of partition `p` (simulated as `run` under H-1F1B), with every other schedule simulated."""
    pipe, _ = _pipeline_of(p, part.epsilon)
    results = {}
    for name in SCHEDULES:
        r = run if name == run.schedule else run_schedule(pipe, name)
        peaks = tuple(s.price.memory_bytes(h) for s, h in zip(p.stages, r.in_flight))
        results[name] = ScheduleResult(r.iteration_s, r.warmup, peaks,
                                       all(h <= s.price.max_held for s, h in zip(p.stages, r.in_flight)))
    sg = part.stages
    stages = tuple(PipelineStage(s.devices, part.subs[s.sub].name, (s.start, s.end),
                                 (sg.layers[s.start][0], sg.layers[s.end - 1][-1]), w, s.price.forward_s,
                                 s.price.backward_s, s.price.sync_s, m, _shares(part.cluster, s.devices))
                   for s, w, m in zip(p.stages, run.warmup, results["h-1f1b"].peak_memory_bytes))
    bounds = tuple(Boundary(s.end, sg.cut(s.end).tensors, sg.cut(s.end).forward_bytes, sg.cut(s.end).backward_bytes,
                            part.levels[s.sub][n.sub], c) for s, n, c in zip(p.stages, p.stages[1:], p.transfers_s))
    closed = closed_form_s(pipe) if all(c <= pipe.t_max for c in pipe.transfer_s) else None
    return PipelinePlan(stages, bounds, run.schedule, p.microbatches, run.iteration_s, pipe.t_max, closed, results,
                        planning_s)


def _shares(cluster: Cluster, devices: tuple[int, ...]) -> tuple[float, ...]:
    """Shares proportional to the devices' FLOP/s (as `engine.pipeline.stage_cost.DataParallelPricer` prices them)."""
    flops = [cluster.flops[j] for j in devices]
    return tuple(f / sum(flops) for f in flops)


def schedule_input(plan: PipelinePlan, transfers_s: tuple[float, ...] | None = None) -> Pipeline:
    """The schedule's view of a plan (stage times, syncs), with other transfer times to ask "what if"."""
    return Pipeline(tuple(StageTimes(s.forward_s, s.backward_s, 0.0, s.sync_s) for s in plan.stages),
                    transfers_s if transfers_s is not None else tuple(b.transfer_s for b in plan.boundaries),
                    plan.microbatches)
