"""Hierarchical collectives in the engine (engine.cluster.hierarchy): which layouts offer them, their price
per link level, their duals, the search choosing them where they are predicted faster, and the
plan validator's checks of the machines they need."""
from __future__ import annotations

import math

import pytest
from conftest import ce_graph, cluster_dict, sample_dict

import engine
from engine.cluster.hierarchy import HIER_KEYS, hierarchy_of, machine_groups, peer_groups
from engine.cluster.spec import Cluster
from engine.errors import PlanError
from engine.planner import load_plan
from engine.spmd.baselines import proportional_ratios
from engine.spmd.cost import DUAL, CostModel, evaluate
from engine.spmd.iteration import plan_of
from engine.spmd.plan import Plan
from engine.spmd.program import Instruction
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.spmd.validate import validate_plan

FLAT_ONLY = SearchSpace(collectives=SearchSpace().collectives - set(HIER_KEYS))
FLAT_OF = {"all_reduce.hier": "all_reduce", "all_gather.hier": "all_gather.padded",
           "reduce_scatter.hier": "reduce_scatter"}


@pytest.fixture(scope="module")
def testbed(load_sample) -> Cluster:
    return load_sample("hap_paper_testbed")


def _machines_cluster(machines: list[str], intra: float = 1e10, inter: float = 1e9, latency: float = 1e-4) -> Cluster:
    d = cluster_dict([1e12] * len(machines), latency_s=latency)
    for dev, m in zip(d["devices"], machines):
        dev["machine"] = m
    d["network"]["bandwidth_Bps"] = {"intra_machine": intra, "inter_machine": inter}
    return Cluster.from_dict(d)


# --- layouts -------------------------------------------------------------------------------------


def test_machine_groups_need_two_machines_of_equal_size_of_at_least_two():
    assert machine_groups(["a", "a", "b", "b"]) == ((0, 1), (2, 3))
    assert machine_groups(["a", "b", "a", "b"]) == ((0, 2), (1, 3))
    assert peer_groups(((0, 2), (1, 3))) == ((0, 1), (2, 3))
    assert machine_groups(["a", "a", "a", "a"]) is None, "one machine: nothing to do across machines"
    assert machine_groups(["a", "b", "c"]) is None, "one device per machine: nothing to do inside"
    assert machine_groups(["a", "a", "b", "b", "b"]) is None, "machines of unequal sizes"
    assert machine_groups([]) is None


@pytest.mark.parametrize("name", ["cpu_2", "cpu_4_uneven", "h100x8_node", "hap_paper_testbed_machines",
                                  "a100_v100_mixed"])
def test_clusters_without_two_levels_offer_no_hierarchical_collective(name, load_sample):
    cluster = load_sample(name)
    assert hierarchy_of(cluster) is None
    cm = CostModel(ce_graph(), cluster, proportional_ratios(cluster))
    for key in HIER_KEYS:
        assert cm.comm_terms(key, 0) == (math.inf, 0.0), "never cheaper than the flat collective"


# --- prices per level ----------------------------------------------------------------------------


def test_testbed_levels_are_8_machines_of_8_with_ring_fits_per_level(testbed):
    h = hierarchy_of(testbed)
    k, m, a = 8, 8, testbed.network.latency_s
    intra, inter = 1e10, 1.3e9 / k  # the 8 peer groups of a machine share its link
    assert (h.machine_size, h.num_machines) == (k, m)
    assert h.intra["all_reduce"].latency_s == pytest.approx(2 * (k - 1) * a)
    assert h.intra["all_gather"].bandwidth_Bps == pytest.approx(intra / (k - 1))
    assert h.inter["all_reduce"].bandwidth_Bps == pytest.approx(inter * m / (2 * (m - 1)))
    assert h.inter["reduce_scatter"].bandwidth_Bps == pytest.approx(inter / (m - 1))


def test_hierarchical_prices_are_the_sum_of_their_steps_per_level(testbed):
    graph = ce_graph()
    cm = CostModel(graph, testbed, proportional_ratios(testbed))
    node = next(n.id for n in graph.nodes if n.op == "parameter" and n.rank == 2)
    n, k, m, a = graph[node].nbytes, 8, 8, testbed.network.latency_s
    bi, bx = 1e10, 1.3e9
    # all-reduce: reduce-scatter in the machine, all-reduce of a 1/k piece across, all-gather in the machine
    want_ar = 2 * ((k - 1) * a + n * (k - 1) / k / bi) + 2 * (m - 1) * a + n * 2 * (m - 1) / m / bx
    assert cm.comm_terms("all_reduce.hier", node) == (pytest.approx(want_ar), 0.0)
    # all-gather / reduce-scatter: the largest shard across the peers (k of them per link), M shards inside
    want = ((m - 1) * a + (k - 1) * a, n * ((m - 1) * k / bx + (k - 1) * m / bi))
    assert cm.comm_terms("all_gather.hier", node) == pytest.approx(want)
    assert cm.comm_terms("reduce_scatter.hier", node) == pytest.approx(want)


def test_flat_prices_are_untouched_and_the_hierarchy_saves_ring_hops(testbed):
    graph = ce_graph()
    cm = CostModel(graph, testbed, proportional_ratios(testbed))
    fit = testbed.collectives["all_reduce"]
    n = graph[0].nbytes
    assert cm.comm_terms("all_reduce", 0) == (pytest.approx(fit.latency_s + n / fit.bandwidth_Bps), 0.0)
    k = m = 8
    a = testbed.network.latency_s
    flat_latency, hier_latency = 2 * (k * m - 1) * a, 2 * (k - 1) * a + 2 * (m - 1) * a
    assert flat_latency - hier_latency == pytest.approx(2 * (k - 1) * (m - 1) * a)
    assert cm.comm_terms("all_reduce.hier", 0)[0] < cm.comm_terms("all_reduce", 0)[0]


def test_with_equal_levels_and_no_latency_the_flat_ring_moves_fewer_bytes():
    """Hierarchy pays off in latency and where the levels differ: with one bandwidth everywhere and
    no latency, 2 machines of 2 move 4 shards per device hierarchically against 3 in one ring."""
    even = _machines_cluster(["a", "a", "b", "b"], intra=1e9, inter=2e9, latency=0.0)  # 2e9 / k = 1e9 per peer
    cm = CostModel(ce_graph(), even, [0.25] * 4)
    for key, flat in FLAT_OF.items():
        hier, plain = cm.comm_terms(key, 0), cm.comm_terms(flat, 0)
        assert sum(hier) > sum(plain), key


def test_duals_of_hierarchical_collectives_are_hierarchical():
    assert DUAL["all_reduce.hier"] == "all_reduce.hier"
    assert DUAL["all_gather.hier"] == "reduce_scatter.hier" and DUAL["reduce_scatter.hier"] == "all_gather.hier"


# --- the search ----------------------------------------------------------------------------------


def test_search_picks_hierarchical_collectives_on_the_testbed_and_predicts_less(testbed):
    graph = ce_graph()
    cm = CostModel(graph, testbed, proportional_ratios(testbed))
    full, flat = synthesize(graph, cm), synthesize(graph, cm, space=FLAT_ONLY)
    assert full.optimal and flat.optimal
    used = {i.rule for i in full.program if i.kind == "comm"}
    assert used & set(HIER_KEYS), f"no hierarchical collective in {sorted(used)}"
    assert full.cost < flat.cost
    assert evaluate(full.program, cm).total_s == pytest.approx(full.cost)


def test_search_keeps_flat_collectives_where_there_is_one_machine(load_sample):
    cluster, graph = load_sample("cpu_4_uneven"), ce_graph()
    res = synthesize(graph, CostModel(graph, cluster, proportional_ratios(cluster)))
    assert not {i.rule for i in res.program} & set(HIER_KEYS)


def test_plan_on_the_testbed_uses_them_and_beats_the_best_flat_program(testbed):
    graph = ce_graph()
    plan = engine.plan(graph, testbed, time_budget_s=30)
    assert {i.rule for i in plan.program} & set(HIER_KEYS)
    assert plan.machines == [d.machine for d in testbed.devices]
    cm = CostModel(graph, testbed, plan.ratio_rows)
    assert evaluate(plan.program, cm).total_s == pytest.approx(plan.predicted_time_s)
    assert plan.predicted_time_s < synthesize(graph, cm, space=FLAT_ONLY).cost
    assert validate_plan(plan, testbed) == []


# --- plans and the validator ---------------------------------------------------------------------


def _hier_plan(cluster: Cluster) -> Plan:
    graph = ce_graph()
    ratios = proportional_ratios(cluster)
    program = synthesize(graph, CostModel(graph, cluster, ratios)).program
    assert {i.rule for i in program} & set(HIER_KEYS)
    return plan_of(program, graph, cluster, ratios)


def test_plan_round_trips_its_machines_and_the_validator_accepts_hierarchical_keys():
    cluster = _machines_cluster(["a", "a", "b", "b"], inter=1e8, latency=1e-3)
    plan = _hier_plan(cluster)
    again = load_plan(plan.to_json())
    assert again.machines == ["a", "a", "b", "b"] and again.program == plan.program
    assert validate_plan(again, cluster) == []


def test_validator_refuses_hierarchical_keys_without_machines_of_equal_size():
    cluster = _machines_cluster(["a", "a", "b", "b"], inter=1e8, latency=1e-3)
    d = _hier_plan(cluster).to_dict()
    del d["cluster"]["machines"]
    with pytest.raises(PlanError, match="needs at least 2 machines"):
        load_plan(d)
    d["cluster"]["machines"] = ["a", "a", "a", "b"]
    with pytest.raises(PlanError, match="needs at least 2 machines"):
        load_plan(d)
    d["cluster"]["machines"] = ["a", "b"]
    with pytest.raises(PlanError, match=r"cluster\.machines.*2 entries but the plan has 4 devices"):
        load_plan(d)


def test_validator_refuses_a_cluster_whose_machines_differ_from_the_plan():
    plan = _hier_plan(_machines_cluster(["a", "a", "b", "b"], inter=1e8, latency=1e-3))
    other = _machines_cluster(["a", "b", "a", "b"], inter=1e8, latency=1e-3)
    with pytest.raises(PlanError, match=r"cluster\.machines\[1\]"):
        validate_plan(plan, other)


def test_old_plans_without_machines_still_load(load_sample):
    cluster = load_sample("cpu_2")
    graph = ce_graph()
    plan = plan_of(synthesize(graph, CostModel(graph, cluster, [0.5, 0.5])).program, graph, cluster, [0.5, 0.5])
    d = plan.to_dict()
    del d["cluster"]["machines"]
    assert load_plan(d).machines == []


def test_sample_two_by_two_cluster_is_two_machines_of_two():
    d = sample_dict("cpu_2x2")
    h = hierarchy_of(Cluster.from_dict(d))
    assert h is not None and h.machines == ((0, 1), (2, 3))
