"""The load balancer: optimal sharding ratios B for a fixed program Q (HAP §5, Eq. 3).

Formulation (one ratio per device class; identical devices get equal ratios, which loses nothing
because the problem is convex and symmetric in them):

    variables   B_c >= 0          ratio of each device of class c      (`_ratio_vars`)
                M                 the largest ratio, M >= B_c          (`_max_ratio`)
                t_i               computation time of stage i          (`_stage_epigraphs`)
    minimise    sum_i t_i + sum_i (comm_const_i + comm_per_i * M)
    subject to  sum_c n_c B_c = 1                                      (`_ratios_sum_to_one`)
                t_i >= comp_ic(B_c)   for every stage i and class c    (epigraph of the max, §5.1)
                memory_c(B_c) <= capacity_c  for every class c         (`_memory_limits`)

Every term is linear in B (see `engine.cost`), so this is an LP. PuLP models it; HiGHS solves it
(the bundled CBC is the fallback). Rounding to integer shard sizes is `plan.split_sizes`.
"""
from __future__ import annotations

from dataclasses import dataclass

import pulp

from .cluster import Cluster
from .cost import CostModel, Stage, device_classes, replay
from .errors import InfeasibleError
from .graph import Graph
from .program import Instruction

GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes in GiB with enough digits that small models do not all read 0.0 GiB."""
    v = nbytes / GIB
    return f"{v:.1f} GiB" if abs(v) >= 1 else f"{v:.3g} GiB"


@dataclass
class BalanceResult:
    ratios: list[float]
    """One ratio per device (sums to 1)."""
    objective_s: float
    solver: str


def _solver(time_limit_s: float) -> tuple[pulp.LpSolver, str]:
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    if highs.available():
        return highs, "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s), "CBC"


def balance(program: tuple[Instruction, ...], graph: Graph, cluster: Cluster, *, optimizer: str = "adam",
            time_limit_s: float = 30.0) -> BalanceResult:
    """Solve Eq. 3 for `program`; raises InfeasibleError naming the device short of memory."""
    probe = CostModel(graph, cluster, [1.0 / cluster.num_devices] * cluster.num_devices, optimizer)
    stages, mem = replay(program, probe)
    classes = device_classes(cluster, None)
    prob = pulp.LpProblem("hap_sharding_ratios", pulp.LpMinimize)
    B = _ratio_vars(prob, classes)
    M = _max_ratio(prob, B)
    t = _stage_epigraphs(prob, stages, classes, B)
    prob += pulp.lpSum(t) + pulp.lpSum(s.comm_const + s.comm_per_max_ratio * M for s in stages)
    _ratios_sum_to_one(prob, classes, B)
    _memory_limits(prob, classes, B, mem)
    solver, name = _solver(time_limit_s)
    prob.solve(solver)
    if pulp.LpStatus[prob.status] != "Optimal" or prob.sol_status not in (pulp.LpSolutionOptimal,):
        raise _memory_error(cluster, classes, mem)
    ratios = [0.0] * cluster.num_devices
    for c, b in zip(classes, B):
        for j in c.devices:
            ratios[j] = max(0.0, b.value() or 0.0)
    total = sum(ratios)
    return BalanceResult([r / total for r in ratios], float(pulp.value(prob.objective)), name)


def _ratio_vars(prob: pulp.LpProblem, classes) -> list[pulp.LpVariable]:
    return [prob.add_variable(f"B_{k}", lowBound=0) for k in range(len(classes))]


def _max_ratio(prob: pulp.LpProblem, B: list[pulp.LpVariable]) -> pulp.LpVariable:
    M = prob.add_variable("M", lowBound=0)
    for k, b in enumerate(B):
        prob += M >= b, f"max_ratio_{k}"
    return M


def _stage_epigraphs(prob: pulp.LpProblem, stages: list[Stage], classes, B) -> list[pulp.LpVariable]:
    t = []
    for i, st in enumerate(stages):
        s, r, ss, rs = st.work
        if not any(st.work):
            continue
        ti = prob.add_variable(f"t_{i}", lowBound=0)
        for k, (c, b) in enumerate(zip(classes, B)):
            prob += ti >= (s * b + r) / c.flops + (ss * b + rs) * c.sync_s_per_byte, f"stage_{i}_class_{k}"
        t.append(ti)
    return t


def _ratios_sum_to_one(prob: pulp.LpProblem, classes, B) -> None:
    prob += pulp.lpSum(len(c.devices) * b for c, b in zip(classes, B)) == 1, "ratios_sum_to_one"


def _memory_limits(prob: pulp.LpProblem, classes, B, mem) -> None:
    s, r, sa, ra = mem
    for k, (c, b) in enumerate(zip(classes, B)):
        prob += s * b + r + (sa * b + ra) / c.num_gpus <= c.memory_bytes, f"memory_class_{k}"


def _memory_error(cluster: Cluster, classes, mem) -> InfeasibleError:
    """Explain an infeasible LP: with ratios proportional to memory, which device overflows by how much."""
    s, r, sa, ra = mem
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
