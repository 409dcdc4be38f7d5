"""HAPT's partitioning DP (§5.2) against brute force, sub-clusters and the data-parallel stage pricer."""
import itertools
import math
import random

import pytest

import engine
from engine.cluster.spec import Cluster
from engine.errors import PlanError
from engine.pipeline.partition import Partitioner, fixed_pipeline
from engine.pipeline.schedule import h1f1b_delta
from engine.pipeline.stage_cost import DataParallelPricer, StagePrice, SubCluster, sub_clusters
from engine.pipeline.stages import StageGraph

GIB = 2**30


def _two_machines(flops=(2e12, 1e12), per_machine=2, inter_Bps=1e8, memory=8 * GIB) -> Cluster:
    devices = [{"name": f"m{m}", "gpu_model": f"gpu{m}", "machine": f"m{m}", "flops_per_gpu": flops[m],
                "memory_bytes_per_gpu": memory, "count": per_machine} for m in range(2)]
    return Cluster.from_dict({"schema_version": 1, "name": "two", "description": "test", "sources": ["tests"],
                              "devices": devices, "network": {"latency_s": 1e-5, "bandwidth_Bps": {
                                  "intra_machine": 1e10, "inter_machine": inter_Bps}}})


@pytest.fixture(scope="module")
def mlp4():
    return engine.load_model("zoo:mlp", layers=4, in_features=64, hidden=256, classes=8, batch=16)


def _brute_force(part: Partitioner, microbatches: int) -> float:
    """min over every partition, group choice and t_max candidate of the DP's objective under its constraints."""
    L, subs, B = part.stages.num_layers, part.subs, microbatches
    table = part.table(B)
    t_values = sorted({float(x) for arr in table.times.values() for x in arr[arr < math.inf]})
    groups = [(a, g) for a, s in enumerate(subs) for g in s.group_sizes]
    best = math.inf
    for cuts in _compositions(L):
        for choice in itertools.product(groups, repeat=len(cuts)):
            stages = _place(cuts, choice, subs)
            if stages is None:
                continue
            prices = [part.price(k, e, a, o, g, B) for (k, e, a, o, g) in stages]
            c = [part.transfer(stages[i][1], stages[i][2], stages[i + 1][2], B) for i in range(len(stages) - 1)]
            for t_max in t_values:
                if any(p.total_s > t_max for p in prices) or any(x > t_max for x in c):
                    continue
                warm = [1]
                for x in reversed(c):
                    warm.append(min(B, warm[-1] + h1f1b_delta(x, t_max, part.epsilon)))
                if any(n > p.max_held for n, p in zip(warm[::-1], prices)):
                    continue
                best = min(best, sum(p.total_s + p.sync_s for p in prices) + 2 * sum(c) + (B - 1) * t_max)
    return best


def _compositions(L: int):
    for k in range(L):
        for inner in itertools.combinations(range(1, L), k):
            bounds = (0, *inner, L)
            yield list(zip(bounds, bounds[1:]))


def _place(cuts, choice, subs):
    """Offsets as the DP assigns them: the last stage first, each at the next aligned place of its sub-cluster."""
    used = [0] * len(subs)
    out = []
    for (k, e), (a, g) in reversed(list(zip(cuts, choice))):
        if used[a] not in subs[a].offsets(g) or used[a] + g > subs[a].size:
            return None
        out.append((k, e, a, used[a], g))
        used[a] += g
    return out[::-1]


class _RandomPricer:
    """Made-up prices with memory that binds: per layer work and state, slower sub-cluster 2x."""

    def __init__(self, seed: int, capacity: float) -> None:
        rng = random.Random(seed)
        self.work = [rng.uniform(1.0, 3.0) for _ in range(8)]
        self.act = [rng.uniform(1.0, 2.0) for _ in range(8)]
        self.capacity = capacity

    def __call__(self, stages, start, end, devices, microbatches):
        speed = len(devices) * (2.0 if devices[0] < 2 else 1.0)
        w = sum(self.work[start:end]) / speed / microbatches
        act = sum(self.act[start:end]) / len(devices) / microbatches
        return StagePrice(w / 3, 2 * w / 3, 0.1, (1.0,) * len(devices), (act,) * len(devices),
                          (self.capacity,) * len(devices))


@pytest.mark.parametrize("B", [1, 2, 4])
@pytest.mark.parametrize("inter_Bps", [1e6, 1e9])
def test_dp_equals_brute_force_with_the_data_parallel_pricer(mlp4, B, inter_Bps):
    part = Partitioner(StageGraph(mlp4), _two_machines(flops=(2e9, 1e9), inter_Bps=inter_Bps))
    found = part.search(B)
    assert found and found[0].objective_s == pytest.approx(_brute_force(part, B), rel=1e-12)


def test_a_fast_link_and_enough_microbatches_make_a_two_stage_pipeline(mlp4):
    part = Partitioner(StageGraph(mlp4), _two_machines(flops=(2e9, 1e9), inter_Bps=1e9))
    best = part.search(4)[0]
    assert [(s.sub, s.size) for s in best.stages] == [(0, 2), (1, 2)] and best.warmup == (3, 1)
    assert best.stages[0].end == best.stages[1].start


@pytest.mark.parametrize("seed, capacity, epsilon", [(0, 100.0, 0.0), (1, 4.0, 0.0), (2, 2.5, 0.0), (3, 3.0, 0.0),
                                                      (2, 2.5, 0.05), (3, 3.0, 0.05)])
def test_dp_equals_brute_force_when_memory_binds(mlp4, seed, capacity, epsilon):
    part = Partitioner(StageGraph(mlp4), _two_machines(inter_Bps=3e5), pricer=_RandomPricer(seed, capacity),
                       epsilon=epsilon)
    for B in (2, 4):
        found = part.search(B)
        expect = _brute_force(part, B)
        if math.isinf(expect):
            assert not found
        else:
            assert found[0].objective_s == pytest.approx(expect, rel=1e-12)
            best = found[0]
            assert all(n <= s.price.max_held for n, s in zip(best.warmup, best.stages))


def test_sub_clusters_follow_hardware_and_groups(load_sample):
    subs = sub_clusters(load_sample("a100x8_v100x8_5gbps"))
    assert [(s.size, s.per_machine, s.group_sizes) for s in subs] == [(8, 8, (1, 2, 4, 8)), (8, 8, (1, 2, 4, 8))]
    testbed = sub_clusters(load_sample("hap_paper_testbed"))
    assert [s.size for s in testbed] == [16, 48] and testbed[1].group_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48)
    assert testbed[1].offsets(4) == list(range(0, 45, 4)) and testbed[1].offsets(16) == list(range(0, 33, 8))
    six = SubCluster("x", tuple(range(12)), 6)  # 4 devices fit once in a machine of 6, never across two
    assert six.group_sizes == (1, 2, 4, 6, 12) and six.offsets(4) == [0, 6] and six.offsets(2) == [0, 2, 4, 6, 8, 10]
    assert len(sub_clusters(load_sample("a100_v100_mixed"))) == 2


def test_data_parallel_price_splits_flops_over_the_group_and_microbatches(mlp4):
    cluster = _two_machines()
    sg, pricer = StageGraph(mlp4), DataParallelPricer(cluster)
    one, two = pricer(sg, 0, 4, (0,), 1), pricer(sg, 0, 4, (0, 1), 1)
    assert two.forward_s == pytest.approx(one.forward_s / 2, rel=0.05)  # parameter-only work is tiny here
    assert pricer(sg, 0, 4, (0, 1), 4).forward_s == pytest.approx(two.forward_s / 4, rel=0.05)
    assert one.sync_s < two.sync_s  # the group of two all-reduces its gradients
    slow = pricer(sg, 0, 4, (2,), 1)
    assert slow.forward_s == pytest.approx(2 * one.forward_s)
    assert pricer(sg, 0, 2, (0,), 1).total_s + pricer(sg, 2, 4, (0,), 1).total_s == pytest.approx(one.total_s)
    # memory: every device of the group holds all parameters with gradient and Adam state (4x), and its
    # share of a microbatch's activations
    assert two.state_bytes == (mlp4.num_parameters * 4 * 4,) * 2
    assert two.activation_bytes[0] == pytest.approx(one.activation_bytes[0] / 2)
    assert pricer(sg, 0, 4, (0, 1), 4).activation_bytes[0] == pytest.approx(two.activation_bytes[0] / 4)
    assert one.activation_bytes[0] == pytest.approx(sg.stage(0, 4).activation_bytes)
    assert one.max_held == (8 * GIB - one.state_bytes[0]) // one.activation_bytes[0]


def test_best_pipeline_is_a_consistent_plan(mlp4):
    from engine.pipeline.partition import best_pipeline
    from engine.pipeline.schedule import SCHEDULES

    plan = best_pipeline(mlp4, _two_machines(flops=(2e9, 1e9), inter_Bps=1e9), microbatches=4)
    layers = [s.layers for s in plan.stages]
    assert layers[0][0] == 0 and layers[-1][1] == 4 and all(a[1] == b[0] for a, b in zip(layers, layers[1:]))
    devices = [d for s in plan.stages for d in s.devices]
    assert len(devices) == len(set(devices))
    sg = StageGraph(mlp4)
    assert [b.forward_bytes for b in plan.boundaries] == [sg.cut(s.layers[1]).forward_bytes for s in plan.stages[:-1]]
    assert set(plan.schedules) == set(SCHEDULES) and plan.schedule == "h-1f1b"
    assert plan.predicted_s == plan.schedules["h-1f1b"].iteration_s
    assert all(r.fits for r in plan.schedules.values())
    assert max(plan.schedules["gpipe"].peak_memory_bytes) >= max(plan.schedules["1f1b"].peak_memory_bytes)
    assert plan.stages[-1].warmup == 1 and plan.stages[0].warmup == plan.schedules["h-1f1b"].warmup[0]


def test_epsilon_lets_a_tiny_transfer_cost_one_warmup_forward_not_two(mlp4):
    from engine.pipeline.partition import best_pipeline

    cluster = _two_machines(flops=(2e9, 1e9), inter_Bps=1e9)
    exact = best_pipeline(mlp4, cluster, microbatches=4)
    relaxed = best_pipeline(mlp4, cluster, microbatches=4, epsilon=0.05)
    assert exact.boundaries[0].transfer_s < 0.05 * exact.t_max_s
    assert exact.schedules["h-1f1b"].warmup == (3, 1) and relaxed.schedules["h-1f1b"].warmup == (2, 1)


def test_best_pipeline_says_why_nothing_fits(mlp4):
    from engine.errors import InfeasibleError, PlanError
    from engine.pipeline.partition import best_pipeline

    with pytest.raises(InfeasibleError, match="no pipeline"):
        best_pipeline(mlp4, _two_machines(memory=1024))
    with pytest.raises(PlanError, match="microbatches"):
        best_pipeline(mlp4, _two_machines(), microbatches=-2)


@pytest.mark.parametrize("stages", [[(0, 1, (0, 1)), (7, 9, (2, 3))], [(0, 1, (0, 1)), (-1, 4, (2, 3))],
                                    [(0, 2, (0, 1)), (3, 4, (2, 3))]])
def test_fixed_pipeline_refuses_stages_outside_the_layers_with_a_plan_error(mlp4, load_sample, stages):
    """Layers past the model's end, negative, or a gap: the one-line PlanError naming the layers, never an
    IndexError from looking up a cut that does not exist."""
    with pytest.raises(PlanError, match="must be consecutive non-empty runs of layers"):
        fixed_pipeline(mlp4, load_sample("cpu_4_uneven"), stages, 2)


def test_a_cluster_without_links_plans_a_one_stage_pipeline(mlp4):
    """`hap profile` on one rank writes a spec with no link levels; the pipeline planner priced a transfer
    over them with min() of nothing (a ValueError traceback from `hap plan --parallelism pipeline`)."""
    d = {"schema_version": 1, "name": "one", "description": "one GPU as hap profile writes it", "sources": [],
         "devices": [{"name": "rank-0", "gpu_model": "gpu", "machine": "vm", "flops_per_gpu": 1e13,
                      "memory_bytes_per_gpu": 2**34}],
         "network": {"latency_s": 0.0, "bandwidth_Bps": {}, "collectives": {}}}
    plan = engine.plan(mlp4, Cluster.from_dict(d), parallelism="pipeline")
    assert len(plan.stages) == 1 and plan.stages[0].devices == (0,) and plan.boundaries == ()
