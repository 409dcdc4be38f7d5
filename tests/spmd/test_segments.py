"""Segments with their own sharding ratios (HAP §5.2): cutting, search, LP, planner, plan JSON."""
from __future__ import annotations

import json

import pytest
from conftest import build_graph, cluster_dict
from test_synthesis import brute_force

import engine
from engine.cluster.spec import Cluster
from engine.errors import PlanError
from engine.model.graph import Graph, Node
from engine.planner import load_plan
from engine.spmd.balance import balance
from engine.spmd.baselines import data_parallel_space
from engine.spmd.cost import CostModel, evaluate
from engine.spmd.plan import Plan
from engine.spmd.segments import RESPLIT, Segmentation, instruction_segments, segment_graph, with_resplits
from engine.spmd.synthesis import synthesize


def two_layer(B: int = 512, I: int = 1024, H: int = 1024, O: int = 8192) -> Graph:
    """A layer of small weights (segment 0) then one of large weights (segment 1), mse loss."""
    base = build_graph([
        ("x", "placeholder", (), (B, I), 0, {"index": 0, "name": "x"}),
        ("w1", "parameter", (), (H, I)),
        ("h", "linear", (0, 1), (B, H), 2 * B * I * H),
        ("r", "relu", (2,), (B, H), B * H),
        ("w2", "parameter", (), (O, H)),
        ("o", "linear", (3, 4), (B, O), 2 * B * H * O),
        ("y", "placeholder", (), (B, O), 0, {"index": 1, "name": "y"}),
        ("loss", "mse_loss", (5, 6), (), 3 * B * O, {"count": B * O}),
    ], name="two_layer")
    layer = {"w2": 1, "o": 1, "y": 1, "loss": 1}
    return Graph(nodes=tuple(Node(**{**n.__dict__, "segment": layer.get(n.name, 0)}) for n in base.nodes),
                 loss=base.loss, name=base.name)


def slow_link_cluster(bandwidth_Bps: float = 1e9) -> Cluster:
    return Cluster.from_dict(cluster_dict([2e12, 1e12], latency_s=1e-5, bandwidth_Bps=bandwidth_Bps))


# ----------------------------------------------------------------------------- cutting


def test_segments_are_contiguous_runs_of_whole_layers(small_gpt):
    graph = engine.load_model("zoo:gpt", layers=4, hidden=64, heads=4, ffn=128, vocab=128, seq_len=16, batch=4)
    seg = segment_graph(graph, 3)
    order = [n for n in graph.nodes if not n.is_leaf]
    along = [seg.of_node[n.id] for n in order]
    assert along == sorted(along) and seg.count == 3 and set(along) == {0, 1, 2}
    for a, b in zip(order, order[1:]):  # a cut never splits a layer
        if seg.of_node[a.id] != seg.of_node[b.id]:
            assert a.segment != b.segment
    first_use = {}
    for n in order:
        for i in n.inputs:
            first_use.setdefault(i, seg.of_node[n.id])
    assert all(seg.of_node[leaf.id] == first_use[leaf.id] for leaf in graph.nodes if leaf.is_leaf)


def test_more_segments_than_layers_gives_one_per_layer_and_zero_is_an_error():
    graph = two_layer()
    assert segment_graph(graph, 5).count == 2
    assert segment_graph(graph, 1) == Segmentation.single(graph)
    with pytest.raises(PlanError, match="segments must be a positive integer"):
        segment_graph(graph, 0)


# ----------------------------------------------------------------------------- search and cost


@pytest.mark.parametrize("rows", [[[0.5, 0.5], [0.7, 0.3]], [[0.8, 0.2], [0.3, 0.7]]])
@pytest.mark.parametrize("bandwidth", [1e9, 1e11])
def test_exact_astar_equals_brute_force_with_two_segments(rows, bandwidth):
    graph = two_layer(B=64, I=64, H=96, O=128)
    cm = CostModel(graph, slow_link_cluster(bandwidth), rows, segmentation=segment_graph(graph, 2))
    res = synthesize(graph, cm)
    best, count = brute_force(graph, cm)
    assert count > 10
    assert res.cost == pytest.approx(best, rel=1e-9)
    assert res.cost == pytest.approx(evaluate(res.program, cm).total_s, rel=1e-9), "search and replay agree"


@pytest.mark.parametrize("overlap", ["ddp", "duplex"])
@pytest.mark.parametrize("rows", [[[0.5, 0.5], [0.7, 0.3]], [[0.8, 0.2], [0.3, 0.7]]])
def test_exact_astar_equals_brute_force_with_two_segments_in_the_overlap_modes(rows, overlap):
    """Resplits open stages of their own (duplex chains them; ddp's buckets see them in the chain)."""
    graph = two_layer(B=64, I=64, H=96, O=128)
    seg = segment_graph(graph, 2)
    for bandwidth in (1e8, 1e10):
        cm = CostModel(graph, slow_link_cluster(bandwidth), rows, segmentation=seg, overlap=overlap)
        res = synthesize(graph, cm)
        best, _ = brute_force(graph, cm)
        assert res.cost == pytest.approx(best, rel=1e-9)
        assert res.cost == pytest.approx(evaluate(res.program, cm).total_s, rel=1e-9)
        lp = balance(res.program, graph, slow_link_cluster(bandwidth), segmentation=seg, overlap=overlap)
        at = evaluate(res.program, CostModel(graph, slow_link_cluster(bandwidth), lp.by_segment, segmentation=seg,
                                             overlap=overlap))
        # HiGHS's feasibility tolerance is absolute (1e-7): stages of nanoseconds may read 0 in the LP
        assert lp.objective_s == pytest.approx(at.total_s, rel=1e-6, abs=1e-7)
        assert lp.objective_s <= res.cost * (1 + 1e-9)


def test_a_sharded_tensor_crossing_a_boundary_is_resplit_and_stages_stay_inside_segments():
    graph = two_layer(B=64, I=64, H=96, O=128)
    seg = segment_graph(graph, 2)
    cm = CostModel(graph, slow_link_cluster(), [[0.6, 0.4], [0.2, 0.8]], segmentation=seg)
    program = synthesize(graph, cm, space=data_parallel_space(graph)).program
    resplits = [graph[i.node].name for i in program if i.rule == RESPLIT]
    assert resplits == ["r"], "the batch-sharded activation moves to the next segment's sizes"
    stages = evaluate(program, cm).stages
    assert {s.segment for s in stages if any(s.work)} == {0, 1}
    crossing = [s for s in stages if s.comm == RESPLIT]
    assert crossing and all(s.comm_segments == (0, 1) for s in crossing)


def test_with_resplits_makes_a_one_segment_program_valid_for_segments():
    graph = two_layer(B=64, I=64, H=96, O=128)
    seg = segment_graph(graph, 2)
    cm1 = CostModel(graph, slow_link_cluster(), [0.6, 0.4])
    program = synthesize(graph, cm1, space=data_parallel_space(graph)).program
    seeded = with_resplits(program, seg, graph)
    assert [i for i in seeded if i.rule != RESPLIT] == list(program)
    cm2 = CostModel(graph, slow_link_cluster(), [[0.6, 0.4], [0.6, 0.4]], segmentation=seg)
    same = synthesize(graph, cm2, space=data_parallel_space(graph)).program
    assert evaluate(seeded, cm2).total_s == pytest.approx(evaluate(same, cm2).total_s, rel=1e-9)
    assert len(instruction_segments(seeded, seg)) == len(seeded)


# ----------------------------------------------------------------------------- LP


def test_lp_with_two_segments_equals_a_grid_search():
    graph = two_layer()
    seg = segment_graph(graph, 2)
    cluster = slow_link_cluster()
    cm = CostModel(graph, cluster, [[2 / 3, 1 / 3]] * 2, segmentation=seg)
    program = synthesize(graph, cm).program
    result = balance(program, graph, cluster, segmentation=seg)
    assert len(result.by_segment) == 2 and all(sum(r) == pytest.approx(1.0) for r in result.by_segment)

    def cost(a: float, b: float) -> float:
        return evaluate(program, CostModel(graph, cluster, [[a, 1 - a], [b, 1 - b]], segmentation=seg)).total_s

    steps = 100
    grid = min(cost(i / steps, j / steps) for i in range(steps + 1) for j in range(steps + 1))
    lp = cost(result.by_segment[0][0], result.by_segment[1][0])
    assert lp == pytest.approx(result.objective_s, rel=1e-6)
    assert lp <= grid * (1 + 1e-9)
    assert grid <= lp * 1.01, "a fine grid cannot be much worse than the optimum"


# ----------------------------------------------------------------------------- planner and plan


@pytest.fixture(scope="module")
def segmented_plan() -> Plan:
    return engine.plan(two_layer(), slow_link_cluster(), segments=2, overlap="none")  # one bucket after backward


def test_segments_pay_where_layers_want_different_ratios(segmented_plan):
    one = engine.plan(two_layer(), slow_link_cluster(), overlap="none")
    assert segmented_plan.search["segments"] == 2
    assert segmented_plan.predicted_time_s < one.predicted_time_s * (1 - 1e-3)
    r0, r1 = segmented_plan.ratios["0"], segmented_plan.ratios["1"]
    assert abs(r0[0] - r1[0]) > 0.05, "the two segments are balanced differently"


def test_segments_are_used_only_when_they_pay():
    fast = engine.plan(two_layer(), slow_link_cluster(1e12), segments=2)
    assert fast.search["segments"] == 1 and list(fast.ratios) == ["0"] and not fast.segment_of


def test_segmented_plan_round_trips_and_agrees_with_the_cost_model(segmented_plan):
    again = load_plan(segmented_plan.to_json())
    assert again.to_json() == segmented_plan.to_json()
    assert again.segmentation.count == 2
    cm = CostModel(again.graph, slow_link_cluster(), again.ratio_rows, segmentation=again.segmentation)
    assert evaluate(again.program, cm).total_s == pytest.approx(again.predicted_time_s, rel=1e-12)
    assert {s.segment for s in again.stages} == {0, 1}
    for key, sizes in again.shard_sizes.items():
        name, dim = key.split("@")[0].split(":")
        node = next(n for n in again.graph.nodes if n.name == name)
        assert sum(sizes) == node.shape[int(dim)]


def test_cli_plans_with_segments(tmp_path, capsys):
    from engine.cli import main

    graph_path = tmp_path / "graph.json"
    two_layer().save(graph_path)
    cluster_path = tmp_path / "cluster.json"
    cluster_path.write_text(json.dumps(slow_link_cluster().to_dict()))
    assert main(["plan", "--model", str(graph_path), "--cluster", str(cluster_path), "--segments", "2",
                 "--overlap", "none"]) == 0
    assert "ratio per segment" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--model", str(graph_path), "--cluster", str(cluster_path), "--segments", "0"])
