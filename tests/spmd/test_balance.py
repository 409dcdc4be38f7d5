"""Tests of engine.spmd.balance (the sharding-ratio LP, HAP §5) and of the integer shard sizes of engine.plan."""
from __future__ import annotations

import itertools
import math
import re
from fractions import Fraction

import pytest
from conftest import GIB, cluster_dict, with_memory
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.errors import InfeasibleError
from engine.spmd.balance import BalanceResult, balance
from engine.spmd.cost import CostModel, evaluate
from engine.spmd.program import COMPUTE
from engine.spmd.sizes import shard_sizes, shard_units, split_sizes
from engine.spmd.synthesis import SearchSpace, synthesize


def one_segment(by_key: dict) -> dict:
    """(tensor, dim, segment) keys of a one-segment program as (tensor, dim)."""
    assert {k for _, _, k in by_key} <= {0}
    return {(t, d): v for (t, d, _), v in by_key.items()}


def cost_at(program, graph, cluster, ratios) -> float:
    return evaluate(program, CostModel(graph, cluster, list(ratios))).total_s


def optimal_program(graph, cluster, beam_width=None):
    """The search's program under flops-proportional ratios."""
    ratios = [f / sum(cluster.flops) for f in cluster.flops]
    return synthesize(graph, CostModel(graph, cluster, ratios), beam_width=beam_width).program


def simplex_grid(n: int, steps: int) -> list[tuple[float, ...]]:
    """Every ratio vector of n devices on a grid of 1/steps, summing to 1."""
    out = []
    for head in itertools.product(range(steps + 1), repeat=n - 1):
        if sum(head) <= steps:
            out.append(tuple(k / steps for k in head) + ((steps - sum(head)) / steps,))
    return out


def grid_neighbours(ratios: list[float], steps: int) -> list[tuple[float, ...]]:
    """The grid points of the cell that holds `ratios` (floor/ceil of each free coordinate)."""
    n = len(ratios)
    out = []
    for offs in itertools.product((0, 1), repeat=n - 1):
        head = [math.floor(r * steps + 1e-9) + o for r, o in zip(ratios[:-1], offs)]
        if all(k >= 0 for k in head) and sum(head) <= steps:
            out.append(tuple(k / steps for k in head) + ((steps - sum(head)) / steps,))
    return out


# ----------------------------------------------------------------------------- LP == grid search


@pytest.mark.parametrize("flops,steps", [([2e10, 1e10], 200), ([2e10, 1e10, 5e9], 50)], ids=["2-devices", "3-devices"])
@pytest.mark.parametrize("model", ["mlp1", "small_gpt"])
def test_lp_objective_equals_a_fine_grid_search(request, model, flops, steps):
    graph = request.getfixturevalue(model)
    lp_matches_grid(graph, engine.load_cluster(cluster_dict(flops)), len(flops), steps)


@pytest.mark.parametrize("model", ["mlp1", "small_gpt"])
def test_lp_objective_equals_a_fine_grid_search_under_the_roofline_split(request, model):
    """Memory-bound operators priced by bytes at each device's activation bandwidth (uneven ratios
    of flops and bandwidth, so the two terms pull the ratios apart)."""
    d = cluster_dict([2e10, 1e10])
    for dev, bw in zip(d["devices"], [2e9, 2e9]):
        dev["activation_bandwidth_Bps"] = bw
    lp_matches_grid(request.getfixturevalue(model), engine.load_cluster(d), 2, 200)


def lp_matches_grid(graph, cluster, n: int, steps: int) -> None:
    """The LP's objective is the replayed cost at its ratios and no worse than a grid of 1/steps."""
    program = optimal_program(graph, cluster, beam_width=16)
    result = balance(program, graph, cluster)
    assert isinstance(result, BalanceResult)
    lp = cost_at(program, graph, cluster, result.ratios)
    assert lp == pytest.approx(result.objective_s, rel=1e-6)

    grid = {r: cost_at(program, graph, cluster, r) for r in simplex_grid(n, steps)}
    grid_min = min(grid.values())
    # the LP optimises over all ratios, the grid over some of them: it can only be better
    assert result.objective_s <= grid_min * (1 + 1e-6)
    # and it cannot beat the grid by more than the cost varies over the grid cell holding the LP's ratios
    neighbours = grid_neighbours(result.ratios, steps)
    assert neighbours
    tolerance = max(grid[r] for r in neighbours) - result.objective_s
    assert tolerance >= -1e-12 * result.objective_s
    assert result.objective_s >= grid_min - tolerance


@pytest.mark.parametrize("flops", [[2e10, 1e10], [2e10, 1e10, 5e9], [3e10, 3e10, 1e10, 2e9]])
def test_lp_ratios_cannot_be_improved_by_moving_load_between_two_devices(mlp1, flops):
    cluster = engine.load_cluster(cluster_dict(flops))
    program = optimal_program(cluster=cluster, graph=mlp1)
    result = balance(program, mlp1, cluster)
    best = cost_at(program, mlp1, cluster, result.ratios)
    for i, j in itertools.permutations(range(len(flops)), 2):
        moved = list(result.ratios)
        delta = min(1e-4, moved[i])
        moved[i] -= delta
        moved[j] += delta
        assert cost_at(program, mlp1, cluster, moved) >= best * (1 - 1e-9), (i, j)


def test_balance_beats_flops_proportional_and_even_ratios(small_gpt, load_sample):
    cluster = load_sample("a100x2_p100x2")
    program = optimal_program(small_gpt, cluster, beam_width=16)
    result = balance(program, small_gpt, cluster)
    for ratios in ([0.25] * 4, [f / sum(cluster.flops) for f in cluster.flops]):
        assert result.objective_s <= cost_at(program, small_gpt, cluster, ratios) * (1 + 1e-9)


# ----------------------------------------------------------------------------- ratio properties


@pytest.mark.parametrize("cluster_name", ["cpu_4_uneven", "h100x8_node", "hap_paper_testbed_machines", "a100_v100_mixed"])
def test_ratios_sum_to_one_are_non_negative_and_equal_on_identical_devices(mlp1, load_sample, cluster_name):
    cluster = load_sample(cluster_name)
    program = optimal_program(mlp1, cluster, beam_width=16)
    result = balance(program, mlp1, cluster)
    assert len(result.ratios) == cluster.num_devices
    assert sum(result.ratios) == pytest.approx(1.0, abs=1e-9)
    assert all(r >= 0 for r in result.ratios)
    for a, b in itertools.combinations(range(cluster.num_devices), 2):
        da, db = cluster.devices[a], cluster.devices[b]
        if (da.flops, da.memory_bytes_per_gpu, da.num_gpus) == (db.flops, db.memory_bytes_per_gpu, db.num_gpus):
            assert result.ratios[a] == pytest.approx(result.ratios[b], abs=1e-12), (da.name, db.name)


def test_identical_devices_listed_apart_get_equal_ratios(mlp1):
    cluster = engine.load_cluster(cluster_dict([2e10, 1e10, 2e10, 1e10, 2e10]))
    result = balance(optimal_program(mlp1, cluster, beam_width=16), mlp1, cluster)
    assert result.ratios[0] == result.ratios[2] == result.ratios[4]
    assert result.ratios[1] == result.ratios[3]
    assert result.ratios[0] > result.ratios[1]


def test_faster_device_gets_the_larger_ratio(mlp1):
    cluster = engine.load_cluster(cluster_dict([1e10, 4e10]))
    result = balance(optimal_program(mlp1, cluster), mlp1, cluster)
    assert result.ratios[1] > result.ratios[0]


# ----------------------------------------------------------------------------- memory constraints


def test_memory_limit_lowers_the_ratio_of_a_small_device(mlp1):
    spec = cluster_dict([1e10, 1e10], memory=64 * GIB)
    roomy = engine.load_cluster(spec)
    program = optimal_program(mlp1, roomy)
    free = balance(program, mlp1, roomy)
    assert free.ratios == pytest.approx([0.5, 0.5], abs=1e-6)  # pure speed: equal devices, equal shares

    capacity = int(evaluate(program, CostModel(mlp1, roomy, [0.7, 0.3])).memory_bytes[1])  # fits up to B = 0.3
    tight = with_memory(spec, [64 * GIB, capacity])
    result = balance(program, mlp1, tight)
    assert result.ratios[1] < free.ratios[1]
    assert result.ratios[1] <= 0.3 + 1e-6
    assert result.ratios[1] == pytest.approx(0.3, abs=1e-3)  # the LP uses all the memory it may
    assert sum(result.ratios) == pytest.approx(1.0, abs=1e-9)
    memory = evaluate(program, CostModel(mlp1, tight, result.ratios)).memory_bytes
    assert memory[1] <= capacity * (1 + 1e-6)
    assert result.objective_s >= free.objective_s * (1 - 1e-9)
    assert cost_at(program, mlp1, tight, result.ratios) == pytest.approx(result.objective_s, rel=1e-6)


def test_impossible_memory_raises_infeasible_naming_the_device_and_the_shortfall_in_gib():
    graph = engine.load_model("zoo:mlp")  # 4 x 4096 wide: ~0.8 GiB of weights, gradients and Adam state
    spec = cluster_dict([1e10, 1e10], memory=[64 * GIB, GIB // 2])
    roomy = engine.load_cluster(cluster_dict([1e10, 1e10], memory=64 * GIB))
    program = engine.evaluate(graph, roomy, "dp-even").program  # every parameter Full: replicated state
    replicated = evaluate(program, CostModel(graph, roomy, [1.0, 0.0])).memory_bytes[1]
    assert replicated > GIB // 2

    with pytest.raises(InfeasibleError, match=r"out of memory: device 'dev-1' .* GiB over") as info:
        balance(program, graph, engine.load_cluster(spec))
    message = str(info.value)
    assert "\n" not in message
    need, has, over = (float(x) for x in re.search(r"needs ([\d.]+) GiB per GPU but has ([\d.]+) GiB \(([\d.]+) GiB over\)",
                                                   message).groups())
    assert has == pytest.approx(0.5, abs=0.051)
    assert over == pytest.approx(need - has, abs=0.11)
    assert over >= (replicated - GIB / 2) / GIB - 0.051  # at least what the replicated state alone overflows


# ----------------------------------------------------------------------------- split_sizes, shard sizes


@settings(max_examples=300, deadline=None)
@given(total=st.integers(min_value=0, max_value=100_000),
       ratios=st.lists(st.floats(min_value=0.0, max_value=1.0, allow_nan=False), min_size=1, max_size=64)
       .filter(lambda rs: sum(rs) > 0))
def test_split_sizes_sum_exactly_and_stay_within_one_of_the_exact_share(total, ratios):
    sizes = split_sizes(total, ratios)
    assert len(sizes) == len(ratios)
    assert all(isinstance(s, int) for s in sizes)
    assert sum(sizes) == total
    assert all(s >= 0 for s in sizes)
    s = sum(Fraction(r) for r in ratios)
    for size, r in zip(sizes, ratios):
        exact = total * Fraction(r) / s
        assert abs(size - exact) < 1, (size, float(exact))


@settings(max_examples=100, deadline=None)
@given(total=st.integers(min_value=1, max_value=10_000), n=st.integers(min_value=1, max_value=16))
def test_split_sizes_of_equal_ratios_differ_by_at_most_one(total, n):
    sizes = split_sizes(total, [1.0 / n] * n)
    assert sum(sizes) == total
    assert max(sizes) - min(sizes) <= 1


def test_split_sizes_gives_nothing_to_a_zero_ratio():
    assert split_sizes(10, [0.5, 0.0, 0.5]) == [5, 0, 5]
    assert split_sizes(7, [1.0]) == [7]


@pytest.fixture(scope="module")
def gpt_plan(small_gpt, load_sample):
    return engine.plan(small_gpt, load_sample("cpu_4_uneven"))


@pytest.mark.parametrize("ratios", [None, [0.25, 0.25, 0.25, 0.25], [0.55, 0.3, 0.1, 0.05], [0.97, 0.01, 0.01, 0.01]],
                         ids=["plan", "even", "skewed", "extreme"])
def test_shard_sizes_of_linked_dims_scale_consistently(small_gpt, gpt_plan, ratios):
    graph, program = gpt_plan.graph, gpt_plan.program
    ratios = ratios or gpt_plan.ratios["0"]
    sizes = one_segment(shard_sizes(program, graph, [ratios]))
    for (t, d), per_device in sizes.items():
        assert sum(per_device) == graph[t].shape[d], graph[t].name
        assert all(s >= 0 for s in per_device)
    checked = 0
    for ins in program:
        if ins.kind != COMPUTE:
            continue
        dims = [(t, f) for t, f in ins.pre if f >= 0] + ([(ins.node, ins.post)] if ins.post >= 0 else [])
        for (ta, da), (tb, db) in itertools.combinations(dims, 2):
            a, b = graph[ta].shape[da], graph[tb].shape[db]
            for j in range(len(ratios)):
                # e.g. hidden 64 = 4 heads x 16: a device with k heads holds 16k of the hidden dim
                assert sizes[(ta, da)][j] * b == sizes[(tb, db)][j] * a, (ins.render(graph), j)
            checked += 1
    assert checked > 0


@pytest.fixture(scope="module")
def heads_program(small_gpt, load_sample):
    """A program of the 1-layer GPT whose attention must be split by heads."""
    space = SearchSpace(rule_filter=lambda node, r: small_gpt[node].op != "sdpa" or r.name == "heads")
    cluster = load_sample("cpu_4_uneven")
    return synthesize(small_gpt, CostModel(small_gpt, cluster, [0.25] * 4), space=space, beam_width=16).program


@pytest.mark.parametrize("ratios", [[0.25, 0.25, 0.25, 0.25], [0.55, 0.3, 0.1, 0.05], [0.4, 0.4, 0.1, 0.1]])
def test_head_split_view_gives_each_device_whole_heads_of_the_hidden_dim(small_gpt, heads_program, ratios):
    sizes = one_segment(shard_sizes(heads_program, small_gpt, [ratios]))
    views = [ins for ins in heads_program if ins.kind == COMPUTE and small_gpt[ins.node].op == "view"
             and small_gpt[ins.node].rank == 4 and ins.post == 2]
    assert views, "expected q/k/v views split on the heads dim"
    for ins in views:
        (src, src_dim), = ins.pre
        view = small_gpt[ins.node]
        assert (view.shape[2], view.shape[3], small_gpt[src].shape[src_dim]) == (4, 16, 64)
        heads, hidden = sizes[(ins.node, 2)], sizes[(src, src_dim)]
        assert [h * 16 for h in heads] == hidden
        assert sum(heads) == 4 and sum(hidden) == 64


def test_shard_units_of_a_head_view_are_the_number_of_heads(small_gpt, heads_program):
    units = one_segment(shard_units(heads_program, small_gpt))
    for (t, d), u in units.items():
        assert small_gpt[t].shape[d] % u == 0
    views = [(t, d) for (t, d) in units if small_gpt[t].op == "view" and small_gpt[t].rank == 4 and d == 2]
    assert views and all(units[v] == 4 for v in views)


# ----------------------------------------------------------------------------- overlap modes


def cost_in(program, graph, cluster, ratios, overlap: str) -> float:
    return evaluate(program, CostModel(graph, cluster, list(ratios), overlap=overlap)).total_s


@pytest.mark.parametrize("overlap", ["ddp", "duplex"])
@pytest.mark.parametrize("flops,steps,mem_bw", [([2e10, 1e10], 200, None), ([2e10, 1e10, 5e9], 50, [1e10, 2e9, 1e9])],
                         ids=["2-devices", "3-devices-tail"])
@pytest.mark.parametrize("model", ["mlp1", "small_gpt"])
def test_lp_objective_equals_a_fine_grid_search_in_the_overlap_modes(request, model, flops, steps, mem_bw, overlap):
    """Buckets overlapped with backward (ddp) or the duplex chains, and a per-class tail whose shape
    differs from the computation's (memory bandwidths not proportional to flops)."""
    graph = request.getfixturevalue(model)
    d = cluster_dict(flops, latency_s=1e-4, bandwidth_Bps=5e8)
    for dev, bw in zip(d["devices"], mem_bw or []):
        dev["memory_bandwidth_Bps"] = bw
    cluster = engine.load_cluster(d)
    program = optimal_program(graph, cluster, beam_width=16)
    result = balance(program, graph, cluster, overlap=overlap)
    assert cost_in(program, graph, cluster, result.ratios, overlap) == pytest.approx(result.objective_s, rel=1e-6)
    grid = {r: cost_in(program, graph, cluster, r, overlap) for r in simplex_grid(len(flops), steps)}
    assert result.objective_s <= min(grid.values()) * (1 + 1e-6)
    neighbours = grid_neighbours(result.ratios, steps)
    tolerance = max(grid[r] for r in neighbours) - result.objective_s
    assert result.objective_s >= min(grid.values()) - tolerance


def test_lp_in_ddp_mode_overlaps_the_buckets_it_prices(mlp1):
    """The same program balanced for ddp is predicted no slower than balanced for none, and ddp's
    objective is what evaluate says at its ratios (with several buckets)."""
    from engine.spmd.baselines import data_parallel_space

    cluster = engine.load_cluster(cluster_dict([2e12, 1e12, 5e11], latency_s=1e-5, bandwidth_Bps=1e9))
    big = engine.load_model("zoo:mlp", layers=3, in_features=512, hidden=1024, classes=16, batch=4096)
    cm = CostModel(big, cluster, [1 / 3] * 3)
    program = synthesize(big, cm, space=data_parallel_space(big)).program
    ddp = balance(program, big, cluster, overlap="ddp")
    b = evaluate(program, CostModel(big, cluster, ddp.ratios, overlap="ddp"))
    assert len(b.buckets) >= 2
    assert b.total_s == pytest.approx(ddp.objective_s, rel=1e-6)
    none = balance(program, big, cluster)
    assert ddp.objective_s <= none.objective_s


def test_a_baseline_searched_once_is_not_searched_again_for_the_same_graph_cluster_and_ratios(load_sample):
    """A plan's seeds, then the CLI's and the Compare page's baselines: one search each (`_SEARCHED`)."""
    from conftest import mse_graph

    from engine.spmd import baselines as B

    graph, cluster = mse_graph(), load_sample("cpu_4_uneven")
    cm = B.CostModel(graph, cluster, B.even_ratios(cluster))
    first = B.data_parallel(graph, cm)
    again = B.data_parallel(graph, B.CostModel(graph, cluster, B.even_ratios(cluster)))
    assert again is first
    other = B.data_parallel(graph, B.CostModel(graph, cluster, B.proportional_ratios(cluster)))
    assert other is not first and other.program == first.program


@pytest.mark.parametrize("bumpy", [False, True], ids=["convex", "bump"])
def test_the_lp_prices_sharded_collectives_on_the_convex_hull_of_their_measured_points(bumpy):
    """Issue 28: with profiled points the LP's objective is the replayed time at its own ratios where the
    points are convex, and never above it across a bump (the hull lies below the points); the points
    change the objective from that of the line alone."""
    from conftest import measured_collectives, residual_graph

    from engine.spmd.synthesis import synthesize

    graph = residual_graph()
    d = cluster_dict([3e10, 1e10, 1e9], latency_s=2e-4, bandwidth_Bps=1e9)
    d["network"]["collectives"] = measured_collectives(max(n.nbytes for n in graph.nodes if not n.is_leaf), bumpy=bumpy)
    measured = engine.load_cluster(d)
    for fit in d["network"]["collectives"].values():
        del fit["points"]
    line = engine.load_cluster(d)
    program = synthesize(graph, CostModel(graph, measured, [0.6, 0.3, 0.1])).program
    assert any(ins.rule in ("all_gather.padded", "reduce_scatter") for ins in program)
    b = balance(program, graph, measured)
    replayed = evaluate(program, CostModel(graph, measured, b.ratios)).total_s
    if bumpy:
        assert b.objective_s <= replayed * (1 + 1e-9)
    else:
        assert b.objective_s == pytest.approx(replayed, rel=1e-9)
    assert b.objective_s > balance(program, graph, line).objective_s * 1.01
