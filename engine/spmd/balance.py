"""The load balancer: optimal sharding ratios B for a fixed program Q (HAP §5, Eq. 3).

Formulation (one ratio per device class and segment; identical devices get equal ratios, which
loses nothing because the problem is convex and symmetric in them):

    variables   B_kc >= 0         ratio of each device of class c in segment k   (`_ratio_vars`)
                M_k               the largest ratio of segment k, M_k >= B_kc    (`_max_ratio`)
                t_i               computation time of stage i                   (`_stage_epigraphs`)
    minimise    sum_i t_i + sum_i (comm_const_i + comm_per_i * max_{k in K_i} M_k)
    subject to  sum_c n_c B_kc = 1  for every segment k                        (`_ratios_sum_to_one`)
                t_i >= comp_ic(B_{k_i c})   for every stage i and class c  (epigraph of the max, §5.1)
                sum_k memory_kc(B_kc) <= capacity_c  for every class c         (`_memory_limits`)

A stage lies in one segment k_i (§5.2); a resplit across a boundary is bounded by the largest
ratio of both segments (K_i has two members, an epigraph variable takes their max).

Overlap modes (`overlap=`, priced as `engine.spmd.cost` says; every max is an epigraph variable, so
the LP stays exact): the tail u >= sum_k tail_kc(B_kc) for every class c, and
- ddp: minimise F + T + u with F the forward stages' sum, T >= W (the backward stages' sum) and,
  per bucket k ready in backward stage s_k, T >= sum_{backward i after s_k} (t_i + comm_i) + v_k
  + sum_{j >= k} d_j, where v_k >= the class's work of stage s_k from the bucket's parameter on;
- duplex: minimise psi_f + psi_b + sum_k d_k + u, psi = x_0 + sum_k z_k + x_last over the chain
  x = (m_0, t_0/2, m_1, t_1/2, ...) with z_k >= x_k and z_k >= x_{k+1}; the per-half collectives
  m_i are linear in the largest ratio like comm_i.

Sharded states (`states=`, `engine.spmd.zero`): one share z_c >= 0 per class with sum_c n_c z_c = 1
(`_share_vars`), Z >= z_c, the staged state z_c * bytes in every memory row (plus the transient
gathered bytes), and the staged weights' time after backward in the objective: their collectives
(constant + per * Z) and v >= their per-byte work on every class, the update scaling with z_c.

Every term is linear in B (see `engine.spmd.cost`), so this is an LP. PuLP models it; HiGHS solves it
(the bundled CBC is the fallback). Rounding to integer shard sizes is `plan.split_sizes`.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import pulp

from engine.cluster.spec import Cluster
from engine.errors import InfeasibleError, PlanError
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.spmd.cost import DEFAULT_OPTIONS, CostModel, Replayed, Stage, class_work, device_classes, replay_terms
from engine.spmd.program import Instruction
from engine.spmd.recompute import transient_limits, transient_mems
from engine.spmd.segments import Segmentation
from engine.spmd.zero import StateSharding

GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes in GiB with enough digits that small models do not all read 0.0 GiB."""
    v = nbytes / GIB
    return f"{v:.1f} GiB" if abs(v) >= 1 else f"{v:.3g} GiB"


@dataclass
class BalanceResult:
    by_segment: list[list[float]]
    """One ratio per device for every segment (each row sums to 1)."""
    objective_s: float
    solver: str
    shares: list[float] | None = None
    """Each device's share of the staged weights' state (None without sharded states)."""

    @property
    def ratios(self) -> list[float]:
        """The ratios of the first (with one segment, the only) segment."""
        return self.by_segment[0]


def _solver(time_limit_s: float) -> tuple[pulp.LpSolver, str]:
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    if highs.available():
        _absorb_highs_banner()
        return highs, "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s), "CBC"


_banner_absorbed = False


def _absorb_highs_banner() -> None:
    """highspy prints its banner on the process's stdout when its first solver object is created,
    whatever the options (`msg=False` included); create that first one with stdout on /dev/null so
    `hap plan` prints only its report."""
    global _banner_absorbed
    if _banner_absorbed:
        return
    _banner_absorbed = True
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def balance(program: tuple[Instruction, ...], graph: Graph, cluster: Cluster, *, options: PlanOptions = DEFAULT_OPTIONS,
            time_limit_s: float = 30.0, segmentation: Segmentation | None = None, overlap: str = "none",
            recompute: frozenset[int] = frozenset(), states: StateSharding | None = None) -> BalanceResult:
    """Solve Eq. 3 for `program` priced in `overlap` (with the layers `recompute` recomputed in backward,
    and with `states`, the state shares too); raises InfeasibleError naming the device short of memory."""
    probe = CostModel(graph, cluster, [1.0 / cluster.num_devices] * cluster.num_devices, options, segmentation, overlap,
                      recompute=recompute, states=states)
    r = replay_terms(program, probe)
    stages, mems = r.stages, r.mems
    classes = device_classes(cluster, None, options.optimizer, overlap, options.precision, options.grad_dtype)
    _check_finite(stages, mems, classes)
    prob = pulp.LpProblem("hap_sharding_ratios", pulp.LpMinimize)
    B = [_ratio_vars(prob, classes, k) for k in range(len(mems))]
    M = [_max_ratio(prob, row, k) for k, row in enumerate(B)]
    t = _stage_epigraphs(prob, stages, classes, B)
    if overlap == "none":
        prob += pulp.lpSum(t.values()) + pulp.lpSum(_comm(prob, i, s, M, probe) for i, s in enumerate(stages))
    else:
        prob += _overlap_objective(prob, probe, r, classes, B, M, t)
    for k, row in enumerate(B):
        _ratios_sum_to_one(prob, classes, row, k)
    z = _states_objective(prob, probe, program, classes) if states is not None else None
    _memory_limits(prob, classes, B, mems, z, probe.transient_bytes)
    if recompute:
        transient_limits(prob, classes, B, mems, transient_mems(program, probe), z, probe.transient_bytes)
    solver, name = _solver(time_limit_s)
    prob.solve(solver)
    if pulp.LpStatus[prob.status] != "Optimal" or prob.sol_status not in (pulp.LpSolutionOptimal,):
        raise _memory_error(cluster, classes, mems)
    shares = None if z is None else _device_ratios(cluster, classes, z)
    return BalanceResult([_device_ratios(cluster, classes, row) for row in B], float(pulp.value(prob.objective)), name,
                         shares)


def _states_objective(prob: pulp.LpProblem, cm: CostModel, program: tuple[Instruction, ...], classes) -> list:
    """The state shares z_c (sum_c n_c z_c = 1), and the staged weights' time after backward added to
    the objective: collectives const + per * Z (Z >= z_c) and v >= each class's per-byte work."""
    z = [prob.add_variable(f"z_{c}", lowBound=0) for c in range(len(classes))]
    prob += pulp.lpSum(len(c.devices) * v for c, v in zip(classes, z)) == 1, "shares_sum_to_one"
    t = cm.states_terms(program)
    if not t.any:
        return z
    top = prob.add_variable("Z", lowBound=0)
    v = prob.add_variable("states_work", lowBound=0)
    for c, (cls, zc) in enumerate(zip(classes, z)):
        prob += top >= zc, f"max_share_{c}"
        prob += v >= cm.states_work(t, cls, zc), f"states_work_class_{c}"
    const, per = cm.states_comm_terms(t)
    prob.setObjective(prob.objective + const + per * top + v)
    return z


def _check_finite(stages: list[Stage], mems, classes) -> None:
    """Refuse an LP with an infinite or NaN coefficient (PuLP would fail with an untyped PulpError),
    naming where it comes from; the bounds of `engine.limits` on every input keep this from happening."""
    rows = [(f"stage {i} ({st.direction} {st.comm or 'compute'})", (st.comm_const, st.comm_per_max_ratio, *st.work))
            for i, st in enumerate(stages)]
    rows += [(f"memory of segment {k}", tuple(m)) for k, m in enumerate(mems)]
    rows += [(f"device class {c}", (cls.flops, cls.memory_bytes, cls.full_param_s_per_byte, cls.sharded_param_s_per_byte,
                                    cls.activation_s_per_byte)) for c, cls in enumerate(classes)]
    for where, numbers in rows:
        bad = next((x for x in numbers if not math.isfinite(x)), None)
        if bad is not None:
            raise PlanError(f"load balancer: {where} has a non-finite coefficient ({bad}); a cluster rate or a "
                            "node's flops or shape is out of range (see engine/limits.py)")


def _device_ratios(cluster: Cluster, classes, row: list[pulp.LpVariable]) -> list[float]:
    ratios = [0.0] * cluster.num_devices
    for c, b in zip(classes, row):
        for j in c.devices:
            ratios[j] = max(0.0, b.value() or 0.0)
    total = sum(ratios)
    return [r / total for r in ratios]


def _ratio_vars(prob: pulp.LpProblem, classes, segment: int) -> list[pulp.LpVariable]:
    return [prob.add_variable(f"B_{segment}_{c}", lowBound=0) for c in range(len(classes))]


def _max_ratio(prob: pulp.LpProblem, B: list[pulp.LpVariable], segment: int) -> pulp.LpVariable:
    M = prob.add_variable(f"M_{segment}", lowBound=0)
    for c, b in enumerate(B):
        prob += M >= b, f"max_ratio_{segment}_{c}"
    return M


def _comm(prob: pulp.LpProblem, i: int, st: Stage, M: list[pulp.LpVariable], cm: CostModel):
    """Communication time of stage i: its payload scales with the largest ratio of its segments."""
    return _collective(prob, f"stage_{i}", cm.stage_comm_lines(st), st.comm_segments, M)


def _collective(prob: pulp.LpProblem, name: str, lines: tuple[tuple[float, float], ...], segments: tuple[int, ...],
                M: list[pulp.LpVariable]):
    """A collective's seconds: the largest of its (constant, per max-ratio) `lines` (`CostModel.comm_lines`)
    at the largest ratio of `segments`, with an epigraph variable where there are several lines."""
    if all(per == 0 for _, per in lines):
        return max(const for const, _ in lines)
    top = M[segments[0]]
    if len(segments) > 1:
        top = prob.add_variable(f"M_{name}", lowBound=0)
        for k in segments:
            prob += top >= M[k], f"max_ratio_{name}_{k}"
    if len(lines) == 1:
        return lines[0][0] + lines[0][1] * top
    c = prob.add_variable(f"comm_{name}", lowBound=0)
    for j, (const, per) in enumerate(lines):
        prob += c >= const + per * top, f"comm_{name}_line_{j}"
    return c


def _stage_epigraphs(prob: pulp.LpProblem, stages: list[Stage], classes, B) -> dict[int, pulp.LpVariable]:
    """t_i >= every class's computation of stage i (stages with work only)."""
    t = {}
    for i, st in enumerate(stages):
        if not any(st.work):
            continue
        ti = prob.add_variable(f"t_{i}", lowBound=0)
        for k, (c, b) in enumerate(zip(classes, B[st.segment])):
            prob += ti >= class_work(st.work, c, b), f"stage_{i}_class_{k}"
        t[i] = ti
    return t


def _overlap_objective(prob: pulp.LpProblem, cm: CostModel, r: Replayed, classes, B, M, t: dict):
    """The iteration time of the overlap modes (module docstring), with its epigraph constraints."""
    stages = r.stages
    u = prob.add_variable("tail", lowBound=0)
    for c, cls in enumerate(classes):
        prob += u >= pulp.lpSum(class_work(acc, cls, B[k][c]) for k, acc in enumerate(r.tails)), f"tail_class_{c}"
    durations = [seconds for *_, seconds in r.buckets]
    if cm.overlap == "ddp":
        full = [t.get(i, 0) + _comm(prob, i, st, M, cm) for i, st in enumerate(stages)]
        bwd = [i for i, st in enumerate(stages) if st.direction == "backward"]
        T = prob.add_variable("backward", lowBound=0)
        prob += T >= pulp.lpSum(full[i] for i in bwd), "backward_chain"
        for k, (_, _, at, pre, _) in enumerate(r.buckets):
            v = prob.add_variable(f"ready_{k}", lowBound=0)
            left = tuple(x - y for x, y in zip(stages[at].work, pre))
            for c, cls in enumerate(classes):
                prob += v >= class_work(left, cls, B[stages[at].segment][c]), f"ready_{k}_class_{c}"
            prob += T >= pulp.lpSum(full[i] for i in bwd if i > at) + v + sum(durations[k:]), f"bucket_{k}"
        return pulp.lpSum(full[i] for i, st in enumerate(stages) if st.direction == "forward") + T + u
    psi = []
    for direction in ("forward", "backward"):
        xs = []
        for i, st in enumerate(stages):
            if st.direction == direction:
                xs += [_half_comm(prob, i, st, M, cm), 0.5 * t[i] if i in t else 0]
        psi.append(xs[0] + xs[-1] if xs else 0)
        for k, (a, b) in enumerate(zip(xs, xs[1:])):
            z = prob.add_variable(f"pair_{direction}_{k}", lowBound=0)
            prob += z >= a, f"pair_{direction}_{k}_left"
            prob += z >= b, f"pair_{direction}_{k}_right"
            psi.append(z)
    return pulp.lpSum(psi) + sum(durations) + u


def _half_comm(prob: pulp.LpProblem, i: int, st: Stage, M: list[pulp.LpVariable], cm: CostModel):
    """Stage i's collective for one duplex half (`CostModel.half_comm_seconds`)."""
    return _collective(prob, f"half_stage_{i}", cm.stage_comm_lines(st, half=True), st.comm_segments, M)


def _ratios_sum_to_one(prob: pulp.LpProblem, classes, B, segment: int) -> None:
    prob += pulp.lpSum(len(c.devices) * b for c, b in zip(classes, B)) == 1, f"ratios_sum_to_one_{segment}"


def _memory_limits(prob: pulp.LpProblem, classes, B, mems, z: list | None = None, transient: float = 0.0) -> None:
    for c, cls in enumerate(classes):
        need = pulp.lpSum(s * row[c] + r + (sa * row[c] + ra) / cls.num_gpus for row, (s, r, sa, ra, _) in zip(B, mems))
        if z is not None:
            need = need + pulp.lpSum(zs for *_, zs in mems) * z[c] + transient
        prob += need <= cls.memory_bytes, f"memory_class_{c}"


def _memory_error(cluster: Cluster, classes, mems) -> InfeasibleError:
    """Explain an infeasible LP: with ratios proportional to memory, which device overflows by how much."""
    s, r, sa, ra, zs = (sum(m[i] for m in mems) for i in range(5))
    caps = [c.memory_bytes * c.num_gpus for c in classes]
    total_cap = sum(cap * len(c.devices) for cap, c in zip(caps, classes))
    worst = None
    for c, cap in zip(classes, caps):
        ratio = cap / total_cap
        need = s * ratio + r + (sa * ratio + ra) / c.num_gpus + zs * ratio
        over = need - c.memory_bytes
        if worst is None or over > worst[0]:
            worst = (over, c, need)
    over, c, need = worst
    name = cluster.devices[c.devices[0]].name
    return InfeasibleError(f"out of memory: device '{name}' needs {gib(need)} per GPU but has "
                           f"{gib(c.memory_bytes)} ({gib(over)} over); use more or larger "
                           "devices, a smaller batch or model, or `optimizer=sgd`")
