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

Every term is linear in B (see `engine.cost`), so this is an LP. PuLP models it; HiGHS solves it
(the bundled CBC is the fallback). Rounding to integer shard sizes is `plan.split_sizes`.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import pulp

from .cluster import Cluster
from .cost import CostModel, Stage, class_work, device_classes, replay
from .errors import InfeasibleError, PlanError
from .graph import Graph
from .program import Instruction
from .segments import Segmentation

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


def balance(program: tuple[Instruction, ...], graph: Graph, cluster: Cluster, *, optimizer: str = "adam",
            time_limit_s: float = 30.0, segmentation: Segmentation | None = None) -> BalanceResult:
    """Solve Eq. 3 for `program`; raises InfeasibleError naming the device short of memory."""
    probe = CostModel(graph, cluster, [1.0 / cluster.num_devices] * cluster.num_devices, optimizer, segmentation)
    stages, mems = replay(program, probe)
    classes = device_classes(cluster, None, optimizer)
    _check_finite(stages, mems, classes)
    prob = pulp.LpProblem("hap_sharding_ratios", pulp.LpMinimize)
    B = [_ratio_vars(prob, classes, k) for k in range(len(mems))]
    M = [_max_ratio(prob, row, k) for k, row in enumerate(B)]
    t = _stage_epigraphs(prob, stages, classes, B)
    prob += pulp.lpSum(t) + pulp.lpSum(_comm(prob, i, s, M) for i, s in enumerate(stages))
    for k, row in enumerate(B):
        _ratios_sum_to_one(prob, classes, row, k)
    _memory_limits(prob, classes, B, mems)
    solver, name = _solver(time_limit_s)
    prob.solve(solver)
    if pulp.LpStatus[prob.status] != "Optimal" or prob.sol_status not in (pulp.LpSolutionOptimal,):
        raise _memory_error(cluster, classes, mems)
    return BalanceResult([_device_ratios(cluster, classes, row) for row in B], float(pulp.value(prob.objective)), name)


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


def _comm(prob: pulp.LpProblem, i: int, st: Stage, M: list[pulp.LpVariable]):
    """Communication time of stage i: its payload scales with the largest ratio of its segments."""
    if st.comm_per_max_ratio == 0 or len(st.comm_segments) == 1:
        return st.comm_const + st.comm_per_max_ratio * M[st.comm_segments[0]]
    top = prob.add_variable(f"M_stage_{i}", lowBound=0)
    for k in st.comm_segments:
        prob += top >= M[k], f"max_ratio_stage_{i}_{k}"
    return st.comm_const + st.comm_per_max_ratio * top


def _stage_epigraphs(prob: pulp.LpProblem, stages: list[Stage], classes, B) -> list[pulp.LpVariable]:
    t = []
    for i, st in enumerate(stages):
        if not any(st.work):
            continue
        ti = prob.add_variable(f"t_{i}", lowBound=0)
        for k, (c, b) in enumerate(zip(classes, B[st.segment])):
            prob += ti >= class_work(st.work, c, b), f"stage_{i}_class_{k}"
        t.append(ti)
    return t


def _ratios_sum_to_one(prob: pulp.LpProblem, classes, B, segment: int) -> None:
    prob += pulp.lpSum(len(c.devices) * b for c, b in zip(classes, B)) == 1, f"ratios_sum_to_one_{segment}"


def _memory_limits(prob: pulp.LpProblem, classes, B, mems) -> None:
    for c, cls in enumerate(classes):
        need = pulp.lpSum(s * row[c] + r + (sa * row[c] + ra) / cls.num_gpus for row, (s, r, sa, ra) in zip(B, mems))
        prob += need <= cls.memory_bytes, f"memory_class_{c}"


def _memory_error(cluster: Cluster, classes, mems) -> InfeasibleError:
    """Explain an infeasible LP: with ratios proportional to memory, which device overflows by how much."""
    s, r, sa, ra = (sum(m[i] for m in mems) for i in range(4))
    caps = [c.memory_bytes * c.num_gpus for c in classes]
    total_cap = sum(cap * len(c.devices) for cap, c in zip(caps, classes))
    worst = None
    for c, cap in zip(classes, caps):
        ratio = cap / total_cap
        need = s * ratio + r + (sa * ratio + ra) / c.num_gpus
        over = need - c.memory_bytes
        if worst is None or over > worst[0]:
            worst = (over, c, need)
    over, c, need = worst
    name = cluster.devices[c.devices[0]].name
    return InfeasibleError(f"out of memory: device '{name}' needs {gib(need)} per GPU but has "
                           f"{gib(c.memory_bytes)} ({gib(over)} over); use more or larger "
                           "devices, a smaller batch or model, or `optimizer=sgd`")
