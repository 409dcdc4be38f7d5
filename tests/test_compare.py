"""engine.compare: baselines and Fig. 15 ablations under one cost model, and what-if clusters."""
from __future__ import annotations

from pathlib import Path

import pytest

import engine
from engine import ClusterError, compare
from engine.options import DEFAULT_BEAM_WIDTH
from engine.spmd.baselines import proportional_ratios
from engine.spmd.cost import CostModel
from engine.spmd.synthesis import synthesize

SAMPLES = Path(__file__).resolve().parent.parent / "sample_clusters"


@pytest.fixture(scope="module")
def setting():
    graph = engine.load_model("zoo:gpt", layers=1, hidden=64, heads=4, ffn=128, vocab=256, seq_len=16, batch=8)
    cluster = engine.load_cluster(SAMPLES / "a100x2_p100x2.json")
    return graph, cluster, engine.plan(graph, cluster)


def test_predict_reproduces_the_plan(setting):
    graph, cluster, plan = setting
    predicted = compare.predict(plan.program, graph, cluster, plan.ratios["0"], overlap=plan.overlap)
    assert predicted == pytest.approx(plan.predicted_time_s, rel=1e-12)


def test_comparison_rows_and_their_order(setting):
    graph, cluster, plan = setting
    result = compare.compare(plan, cluster)
    rows = {r.name: r for r in result.rows}
    extra = [] if plan.overlap in compare.PLAN_ROWS else ["plan"]  # auto may keep none: the plan gets its own row
    assert list(rows) == ["ddp", "dp-even", "dp-proportional", "Q", "Q+B", "Q+B+C", "Q+B+C+D", *extra]
    mine = compare.PLAN_ROWS.get(plan.overlap, "plan")
    assert [r.name for r in result.rows if r.is_plan] == [mine]
    assert rows[mine].predicted_time_s == plan.predicted_time_s
    for mode, name in compare.PLAN_ROWS.items():  # the plan's auto search priced both modes
        assert rows[name].predicted_time_s == pytest.approx(plan.search["overlap_s"][mode], rel=1e-12)
    for name in ("ddp", "dp-even", "dp-proportional"):
        assert rows[name].predicted_time_s == pytest.approx(plan.search["baselines_s"][name], rel=1e-12)
        assert result.speedup(rows[name]) >= 1 - 1e-9
    assert rows["Q+B"].predicted_time_s <= rows["Q"].predicted_time_s * (1 + 1e-12)  # the LP only improves on B(0)
    best = result.best_baseline
    assert best.predicted_time_s == min(rows[n].predicted_time_s for n in ("ddp", "dp-even", "dp-proportional"))
    table = result.table()
    assert [t["strategy"] for t in table] == list(rows) and [t["plan"] for t in table].count(True) == 1


def test_without_duplex_is_the_same_search_forced_to_ddp(setting):
    """A plan made in one mode gets the other mode's row from a search forced to it."""
    graph, cluster, _ = setting
    duplex = engine.plan(graph, cluster, time_budget_s=5, overlap="duplex")
    rows = {r.name: r for r in compare.compare(duplex, cluster, time_budget_s=6).rows}
    assert rows["Q+B+C+D"].is_plan and rows["Q+B+C+D"].predicted_time_s == duplex.predicted_time_s
    ddp = engine.plan(graph, cluster, time_budget_s=2, overlap="ddp")
    assert rows["Q+B+C"].predicted_time_s == pytest.approx(ddp.predicted_time_s, rel=1e-9)
    none = engine.plan(graph, cluster, time_budget_s=2, overlap="none")
    rows = {r.name: r for r in compare.compare(none, cluster, time_budget_s=6).rows}
    assert rows["plan"].is_plan and rows["plan"].predicted_time_s == none.predicted_time_s


def test_lane_figures_measure_busy_time_and_overlap():
    spans = [("a", "compute", 0.0, 4.0), ("a", "network", 3.0, 6.0), ("a", "network", 5.0, 7.0),  # network 3..7
             ("b", "compute", 0.0, 2.0), ("b", "compute", 1.0, 3.0), ("b", "network", 8.0, 10.0)]
    a, b = compare.lane_figures(spans)
    assert (a.device, a.compute_s, a.network_s, a.overlapped_s, a.span_s) == ("a", 4.0, 4.0, 1.0, 10.0)
    assert a.idle_s == 3.0 and a.hidden_share == 0.25 and a.overlap_ratio == 0.25
    assert (b.compute_s, b.network_s, b.overlapped_s, b.idle_s) == (3.0, 2.0, 0.0, 5.0)
    with pytest.raises(engine.PlanError, match="timeline lane 'disk'"):
        compare.lane_figures([("a", "disk", 0.0, 1.0)])


def test_predicted_schedule_draws_the_plan_in_two_lanes_per_device(setting):
    graph, cluster, plan = setting
    schedule = compare.predicted_schedule(plan, cluster)
    assert schedule.makespan_s == pytest.approx(plan.predicted_time_s, rel=1e-9)
    spans = compare.schedule_spans(schedule)
    lanes = [lane for lane in compare.LANES if lane != "buckets" or plan.overlap == "ddp"]  # buckets: ddp's own lane
    assert {(d, lane) for d, lane, _, _ in spans} == {(d, lane) for d in plan.device_names for lane in lanes}
    for f in compare.lane_figures(spans):
        assert f.compute_s > 0 and f.network_s > 0 and f.idle_s >= -1e-12


def test_ablation_space_has_no_communication_optimisation(setting):
    graph, cluster, _ = setting
    space = compare.without_comm_optimisation(graph)
    assert "all_gather.grouped" not in space.collectives and "all_gather.padded" in space.collectives
    cm = CostModel(graph, cluster, proportional_ratios(cluster), overlap="ddp")
    res = synthesize(graph, cm, space=space, beam_width=DEFAULT_BEAM_WIDTH)
    for ins in res.program:
        assert ins.rule != "all_gather.grouped"
        assert not (graph[ins.node].op in compare.MATMUL_OPS and ins.kind == "compute" and ins.rule == "replicate")
    assert compare.ablation_q(graph, cluster).predicted_time_s == pytest.approx(res.cost, rel=1e-12)


def test_scale_link_follows_the_bottleneck():
    cluster = engine.load_cluster(SAMPLES / "hap_paper_testbed.json")
    faster = compare.scale_link(cluster, "inter_machine", 2.0)
    assert faster.network.bandwidth_Bps["inter_machine"] == 2 * cluster.network.bandwidth_Bps["inter_machine"]
    assert faster.collectives["all_reduce"].bandwidth_Bps == pytest.approx(2 * cluster.collectives["all_reduce"].bandwidth_Bps)
    intra = compare.scale_link(cluster, "intra_machine", 2.0)  # not the bottleneck: the fits stay
    assert intra.collectives == cluster.collectives and intra.network != cluster.network


def test_scale_link_keeps_explicit_fits_and_rejects_bad_input():
    d = engine.load_cluster(SAMPLES / "a100x2_p100x2.json").to_dict()
    d["network"]["collectives"] = {"all_reduce": {"latency_s": 1e-4, "bandwidth_Bps": 5e8}}
    cluster = engine.load_cluster(d)
    scaled = compare.scale_link(cluster, "inter_machine", 4.0)
    assert scaled.collectives["all_reduce"] == cluster.collectives["all_reduce"]
    assert scaled.collectives["all_gather"].bandwidth_Bps == pytest.approx(4 * cluster.collectives["all_gather"].bandwidth_Bps)
    with pytest.raises(ClusterError, match="link level 'inter_group': not in cluster"):
        compare.scale_link(cluster, "inter_group", 2.0)
    with pytest.raises(ClusterError, match="must be a positive number"):
        compare.scale_link(cluster, "inter_machine", 0)


def test_what_if_predicts_and_replans(setting):
    graph, cluster, plan = setting
    w = compare.what_if(plan, cluster, flops_scale={"P100-PCIE-16GB": 0.25}, link_scale=("inter_machine", 0.5))
    assert w.changes == ["P100-PCIE-16GB flops x0.25", "inter_machine bandwidth x0.5"]
    assert w.before_s == plan.predicted_time_s and w.same_plan_s > plan.predicted_time_s
    assert w.replanned_s <= w.same_plan_s * (1 + 1e-9)
    assert w.replanned.cluster_fingerprint == w.cluster.fingerprint() != cluster.fingerprint()
    assert w.replanned.search["overlap_request"] == plan.search["overlap_request"] == "auto"


def test_ratio_reason_reads_the_shape_and_the_bound_off_the_plans_figures(setting):
    """Issue 30, item 5: why the first screen's ratios look as they do, derived from the plan, not written in."""
    graph, cluster, plan = setting
    reason = compare.ratio_reason(plan, cluster)
    assert reason.ratios == tuple(plan.ratio_rows[0])
    assert reason.proportional == pytest.approx(tuple(proportional_ratios(cluster)))
    assert 0 <= reason.communication_share <= 1
    assert reason.sentence().startswith(f"{reason.bound.capitalize()}-bound: ratios ")
    prop = (0.4, 0.4, 0.1, 0.1)
    even = compare.RatioReason((0.25,) * 4, prop, 0.8)
    assert (even.shape, even.bound) == ("even", "communication")
    assert even.sentence().startswith("Communication-bound: ratios even (0.25 each) although the devices' FLOP/s "
                                      "would give 0.1 to 0.4: 80% of the predicted iteration is communication")
    follows = compare.RatioReason((0.39, 0.39, 0.11, 0.11), prop, 0.1)
    assert (follows.shape, follows.bound) == ("proportional", "compute")
    assert follows.sentence().startswith("Compute-bound: ratios follow the devices' FLOP/s (0.11 to 0.39)")
    assert compare.RatioReason((0.3, 0.3, 0.2, 0.2), prop, 0.002).shape == "between"
    assert "under 1% of the predicted iteration" in compare.RatioReason((0.3, 0.3, 0.2, 0.2), prop, 0.002).sentence()
    assert compare.RatioReason((0.5, 0.5), (0.5, 0.5), 0.6).shape == "alike"
