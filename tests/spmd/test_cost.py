"""Tests of engine.spmd.cost's gradient bucket (Full parameters' gradients are all-reduced once, after
backward) and of the memory-bound work per local parameter byte (optimizer update, bucket copies)."""
from __future__ import annotations

import pytest
from conftest import ce_graph, cluster_dict, measured_collectives

from engine.cluster.spec import Cluster
from engine.options import PlanOptions
from engine.spmd.balance import balance
from engine.spmd.baselines import data_parallel_space
from engine.spmd.cost import (BACKWARD_TRAFFIC, BUCKET_TRAFFIC, UPDATE_TRAFFIC, WEIGHT_BACKWARD_TRAFFIC, CostModel,
                              evaluate)
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.theory.core import FULL


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return Cluster.from_dict(cluster_dict([1e12, 1e12, 5e11], latency_s=1e-3, bandwidth_Bps=1e9))


def _full_param_bytes(program, graph) -> float:
    return sum(graph[i.node].nbytes for i in program if i.kind == "load" and graph[i.node].op == "parameter" and i.post == FULL)


def test_data_parallel_pays_one_latency_for_all_gradients(cluster):
    graph = ce_graph()
    cm = CostModel(graph, cluster, [0.4, 0.4, 0.2])
    program = synthesize(graph, cm, space=data_parallel_space(graph)).program
    b = evaluate(program, cm)
    buckets = [(s, t) for s, t in zip(b.stages, b.stage_comm_s) if s.comm == "grad_all_reduce"]
    assert len(buckets) == 1, "one bucket however many Full parameters"
    fit = cluster.collectives["all_reduce"]
    nbytes = _full_param_bytes(program, graph)
    assert nbytes == sum(n.nbytes for n in graph.parameters)
    assert buckets[0][1] == pytest.approx(fit.latency_s + nbytes / fit.bandwidth_Bps)


def test_bucket_runs_last_so_it_is_listed_first_among_the_mirrored_backward_stages(cluster):
    graph = ce_graph()
    cm = CostModel(graph, cluster, [0.4, 0.4, 0.2])
    stages = evaluate(synthesize(graph, cm, space=data_parallel_space(graph)).program, cm).stages
    backward = [s for s in stages if s.direction == "backward"]
    assert backward[0].comm == "grad_all_reduce" and not any(backward[0].work)


def test_program_with_every_parameter_sharded_has_no_bucket(cluster):
    graph = ce_graph()
    cm = CostModel(graph, cluster, [0.4, 0.4, 0.2])
    sharded_only = SearchSpace(param_forms=lambda n, f: f != FULL)
    program = synthesize(graph, cm, space=sharded_only).program
    assert _full_param_bytes(program, graph) == 0
    assert all(s.comm != "grad_all_reduce" for s in evaluate(program, cm).stages)


def test_search_prices_the_bucket_exactly_as_replay_does(cluster):
    graph = ce_graph()
    for ratios in ([0.4, 0.4, 0.2], [0.2, 0.3, 0.5]):
        cm = CostModel(graph, cluster, ratios)
        for space in (None, data_parallel_space(graph)):
            res = synthesize(graph, cm, space=space)
            assert res.cost == pytest.approx(evaluate(res.program, cm).total_s, rel=1e-9)


# --- memory-bound work per parameter byte ---------------------------------------------------------

MEM_BW = 1e10


@pytest.fixture(scope="module")
def cluster_bw() -> Cluster:
    """`cluster` with every device's memory bandwidth given, so updates and bucket copies are priced."""
    d = cluster_dict([1e12, 1e12, 5e11], latency_s=1e-3, bandwidth_Bps=1e9)
    for dev in d["devices"]:
        dev["memory_bandwidth_Bps"] = MEM_BW
    return Cluster.from_dict(d)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_full_parameter_pays_its_update_and_bucket_copies_on_every_device(cluster, cluster_bw, optimizer):
    graph = ce_graph()
    ratios = [0.4, 0.4, 0.2]  # proportional: every device computes equally long, so the update adds to the stage max
    options = PlanOptions(optimizer=optimizer)
    program = synthesize(graph, CostModel(graph, cluster, ratios, options), space=data_parallel_space(graph)).program
    without = evaluate(program, CostModel(graph, cluster, ratios, options)).total_s
    with_bw = evaluate(program, CostModel(graph, cluster_bw, ratios, options)).total_s
    nbytes = _full_param_bytes(program, graph)
    assert with_bw - without == pytest.approx(nbytes * (UPDATE_TRAFFIC[optimizer] + BUCKET_TRAFFIC) / MEM_BW, rel=1e-9)


def test_a_sharded_parameter_pays_the_update_of_its_local_slice_only(cluster, cluster_bw):
    graph = ce_graph()
    ratios = [0.4, 0.4, 0.2]
    sharded_only = SearchSpace(param_forms=lambda n, f: f != FULL)
    program = synthesize(graph, CostModel(graph, cluster, ratios, PlanOptions(optimizer="sgd")), space=sharded_only).program
    without = evaluate(program, CostModel(graph, cluster, ratios, PlanOptions(optimizer="sgd"))).total_s
    with_bw = evaluate(program, CostModel(graph, cluster_bw, ratios, PlanOptions(optimizer="sgd"))).total_s
    nbytes = sum(n.nbytes for n in graph.parameters)
    assert with_bw - without == pytest.approx(nbytes * max(ratios) * UPDATE_TRAFFIC["sgd"] / MEM_BW, rel=1e-9)


def test_search_and_load_balancer_price_the_update_exactly_as_replay_does(cluster_bw):
    graph = ce_graph()
    cm = CostModel(graph, cluster_bw, [0.2, 0.3, 0.5], PlanOptions(optimizer="adam"))
    res = synthesize(graph, cm, space=None)
    assert res.cost == pytest.approx(evaluate(res.program, cm).total_s, rel=1e-9)
    lp = balance(res.program, graph, cluster_bw, options=PlanOptions(optimizer="adam"))
    at_lp = evaluate(res.program, CostModel(graph, cluster_bw, lp.ratios, PlanOptions(optimizer="adam"))).total_s
    assert lp.objective_s == pytest.approx(at_lp, rel=1e-6)


# ----------------------------------------------------------------------------- the roofline split

ACT_BW = 2e10


def one_device(activation_bandwidth_Bps: float | None) -> Cluster:
    d = cluster_dict([1e12])
    if activation_bandwidth_Bps:
        d["devices"][0]["activation_bandwidth_Bps"] = activation_bandwidth_Bps
    return Cluster.from_dict(d)


def test_the_roofline_split_prices_matmuls_by_flops_and_the_rest_by_the_bytes_they_move():
    """hand_ce on one device, by hand: three linears (flops, and the bytes of the weights they read
    forward, read again and write as gradients backward), two relus and a cross-entropy (bytes)."""
    B, I, H, O = 64, 256, 512, 16
    graph = ce_graph(B, I, H, O)
    cm = CostModel(graph, one_device(ACT_BW), [1.0], PlanOptions(optimizer="sgd"))
    program = synthesize(graph, cm).program
    # forward + backward flops: x needs no gradient, so the first linear's backward is its weight's only
    flops = 2 * B * I * H * 2 + 2 * B * H * H * 3 + 2 * B * H * O * 3
    relu = 4 * B * H * 2  # read the input, write the output (fp32)
    loss = 4 + 4 * B * O + 8 * B  # the scalar, the logits, the int64 labels
    weights = 4 * (H * I + H * H + O * H)
    moved = (1 + BACKWARD_TRAFFIC) * (2 * relu + loss) + (1 + WEIGHT_BACKWARD_TRAFFIC) * weights
    assert evaluate(program, cm).total_s == pytest.approx(flops / 1e12 + moved / ACT_BW, rel=1e-12)


def test_without_activation_bandwidth_every_operator_is_priced_by_its_flops():
    graph = ce_graph()
    cm = CostModel(graph, one_device(None), [1.0], PlanOptions(optimizer="sgd"))
    assert not cm.roofline and not any(cm.traffic)
    program = synthesize(graph, cm).program
    flops = sum(n.flops for n in graph.nodes) + sum(cm.bwd_flops)
    assert evaluate(program, cm).total_s == pytest.approx(flops / 1e12, rel=1e-12)


def test_the_roofline_split_scales_the_memory_bound_work_with_the_ratio_of_a_batch_sharded_program():
    """Everything follows the device's share of the batch but the weights, which every device reads whole."""
    graph = ce_graph()
    d = cluster_dict([1e12, 1e12])
    for dev in d["devices"]:
        dev["activation_bandwidth_Bps"] = ACT_BW
    cluster = Cluster.from_dict(d)
    program = synthesize(graph, CostModel(graph, cluster, [0.5, 0.5], PlanOptions(optimizer="sgd")), space=data_parallel_space(graph)).program
    at = {r: evaluate(program, CostModel(graph, cluster, [r, 1 - r], PlanOptions(optimizer="sgd"))) for r in (0.5, 0.75)}
    comp = {r: sum(max(c) for c in b.stage_comp_s) for r, b in at.items()}
    weights_s = (1 + WEIGHT_BACKWARD_TRAFFIC) * sum(n.nbytes for n in graph.parameters) / ACT_BW
    assert comp[0.75] - weights_s == pytest.approx((comp[0.5] - weights_s) * 1.5, rel=1e-9)


def test_a_weight_sharded_matmul_reads_only_its_slice_of_the_weight():
    graph = ce_graph()
    d = cluster_dict([1e12, 1e12])
    for dev in d["devices"]:
        dev["activation_bandwidth_Bps"] = ACT_BW
    cm = CostModel(graph, Cluster.from_dict(d), [0.5, 0.5], PlanOptions(optimizer="sgd"))
    linear = next(n for n in graph.nodes if n.op == "linear" and graph[n.inputs[0]].op != "placeholder")
    whole = cm.compute_delta(linear.id, True, cm.weights_whole(linear.id, (0, FULL)))[0]
    sliced = cm.compute_delta(linear.id, True, cm.weights_whole(linear.id, (FULL, 0)))[0]
    weight = graph[linear.inputs[1]].nbytes
    assert whole[5] == weight and whole[4] == 0  # batch-parallel: every device reads the whole weight
    assert sliced[4] == weight and sliced[5] == 0  # column-parallel: each device reads its rows of it


def test_an_all_reduce_is_priced_off_the_profiled_points_where_the_fitted_line_is_too_cheap():
    """A tensor-parallel plan's activation all-reduce (ratio-independent payload) reads its time off
    the fit's measured points; with the same line and no points it keeps the line."""
    from engine.cluster.spec import CollectiveFit, fit_collective

    graph = ce_graph()
    nbytes = max(n.nbytes for n in graph.nodes)
    line = CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e9)
    measured = CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e9,
                             points=((0.0, 1e-3), (float(nbytes), 1e-3 + 3 * nbytes / 1e9)))
    d = cluster_dict([1e12, 1e12])
    node = next(n.id for n in graph.nodes if n.nbytes == nbytes)
    for fit, expected in ((line, 1e-3 + nbytes / 1e9), (measured, 1e-3 + 3 * nbytes / 1e9)):
        d["network"]["collectives"] = {"all_reduce": fit.to_dict()}
        cm = CostModel(graph, Cluster.from_dict(d), [0.5, 0.5])
        assert cm.comm_terms("all_reduce", node) == pytest.approx((expected, 0.0))
    assert fit_collective([1, 2], [1.0, 2.0]).points  # what hap profile writes carries its points


def test_sharded_collectives_and_gradient_buckets_are_read_off_the_measured_points():
    """Issue 28: a sharded collective is looked up at its largest shard, and a data-parallel bucket (every
    parameter Full) at its bytes, on a fit whose points sit well above its line; both drop back to
    the line when the points are removed."""
    from engine.spmd.baselines import data_parallel

    graph = ce_graph()
    d = cluster_dict([1e12, 1e12])
    d["network"]["collectives"] = measured_collectives(max(n.nbytes for n in graph.nodes), bumpy=True)
    cluster = Cluster.from_dict(d)
    node = max(graph.nodes, key=lambda n: n.nbytes).id
    ag, ar = cluster.collectives["all_gather"], cluster.collectives["all_reduce"]
    for overlap in ("none", "ddp"):
        cm = CostModel(graph, cluster, [0.7, 0.3], overlap=overlap)
        looked_up = cm.comm_time("all_gather.padded", node)
        assert looked_up == pytest.approx(ag.time(0.7 * graph[node].nbytes), rel=1e-12)
        assert looked_up > 1.5 * (ag.latency_s + 0.7 * graph[node].nbytes / ag.bandwidth_Bps)
        b = evaluate(data_parallel(graph, cm).program, cm)
        if overlap == "none":
            [bucket] = [c for st, c in zip(b.stages, b.stage_comm_s) if st.comm == "grad_all_reduce"]
            assert bucket == pytest.approx(ar.time(sum(n.nbytes for n in graph.parameters)), rel=1e-12)
        else:
            assert len(b.buckets) == 2 and sum(x.bytes for x in b.buckets) == sum(n.nbytes for n in graph.parameters)
            assert [x.duration_s for x in b.buckets] == pytest.approx([ar.time(x.bytes) for x in b.buckets], rel=1e-12)
    for fit in d["network"]["collectives"].values():
        del fit["points"]
    cm = CostModel(graph, Cluster.from_dict(d), [0.7, 0.3])
    assert cm.comm_time("all_gather.padded", node) == pytest.approx(2e-4 + 0.7 * graph[node].nbytes / 1e9, rel=1e-12)


# ----------------------------------------------------------------------------- fixed cost per operator run

OP_S = 1e-4


def with_op_overhead(flops: list[float], op_s: list[float]) -> Cluster:
    d = cluster_dict(flops)
    for dev, c in zip(d["devices"], op_s):
        dev["op_overhead_s"] = c
    return Cluster.from_dict(d)


def _runs(graph) -> int:
    """Operator runs of one step by hand: every compute node forward, and backward those whose result
    needs a gradient (ce_graph: all but the label-side ones)."""
    from engine.spmd.saved import requires_grad

    grad = requires_grad(graph)
    return sum(1 for n in graph.nodes if not n.is_leaf) + sum(1 for n in graph.nodes if not n.is_leaf and grad[n.id])


def test_every_operator_run_costs_the_device_its_overhead_whatever_its_share_of_the_work():
    graph = ce_graph()
    plain, fixed = with_op_overhead([1e12], [0.0]), with_op_overhead([1e12], [OP_S])
    program = synthesize(graph, CostModel(graph, plain, [1.0]), space=data_parallel_space(graph)).program
    extra = evaluate(program, CostModel(graph, fixed, [1.0])).total_s - evaluate(program, CostModel(graph, plain, [1.0])).total_s
    assert extra == pytest.approx(_runs(graph) * OP_S, rel=1e-9)
    assert _runs(graph) > sum(1 for n in graph.nodes if not n.is_leaf)  # backward runs counted too
    # on two devices, a data-parallel device pays every run at any ratio: the overhead does not shrink with B
    two = [with_op_overhead([1e12, 1e12], [c, c]) for c in (0.0, OP_S)]
    for ratios in ([0.5, 0.5], [0.9, 0.1]):
        at = [evaluate(program, CostModel(graph, c, ratios)) for c in two]
        comp = [sum(max(x) for x in b.stage_comp_s) for b in at]
        assert comp[1] - comp[0] == pytest.approx(_runs(graph) * OP_S, rel=1e-9)


def test_duplex_halves_each_pay_every_run_and_a_recomputed_layer_pays_its_forward_again():
    graph = ce_graph()
    cm = CostModel(graph, with_op_overhead([1e12, 1e12], [OP_S, OP_S]), [0.5, 0.5], overlap="duplex")
    plain = CostModel(graph, with_op_overhead([1e12, 1e12], [OP_S, OP_S]), [0.5, 0.5])
    assert sum(cm.fwd_ops) == 2 * sum(plain.fwd_ops) and sum(cm.bwd_ops) == 2 * sum(plain.bwd_ops)
    layer = next(n.segment for n in graph.nodes if not n.is_leaf and n.segment >= 0)
    again = CostModel(graph, with_op_overhead([1e12], [OP_S]), [1.0], recompute=frozenset({layer}))
    once = CostModel(graph, with_op_overhead([1e12], [OP_S]), [1.0])
    recomputed = sum(1 for n in graph.nodes if not n.is_leaf and n.segment == layer)
    assert sum(again.bwd_ops) - sum(once.bwd_ops) == recomputed > 0


def test_the_load_balancer_gives_the_device_with_less_overhead_more_of_the_batch():
    """Two devices of equal FLOP/s: without overhead they split the batch evenly; when one pays more per
    operator run, the LP moves work to the other (the overhead does not shrink with the share)."""
    graph = ce_graph()
    program = synthesize(graph, CostModel(graph, with_op_overhead([1e12, 1e12], [0, 0]), [0.5, 0.5]),
                         space=data_parallel_space(graph)).program
    even = balance(program, graph, with_op_overhead([1e12, 1e12], [0.0, 0.0])).ratios
    skew = balance(program, graph, with_op_overhead([1e12, 1e12], [0.0, 2e-6])).ratios
    assert even[0] == pytest.approx(0.5, abs=1e-6)
    assert skew[0] > 0.5 + 1e-3


def test_a_spec_s_op_overhead_is_checked_and_written_back():
    d = cluster_dict([1e12])
    d["devices"][0]["op_overhead_s"] = -1e-6
    with pytest.raises(Exception, match=r"devices\[0\]\.op_overhead_s: must be a non-negative number"):
        Cluster.from_dict(d)
    c = with_op_overhead([1e12], [3e-5])
    assert c.devices[0].op_overhead_s == 3e-5 and Cluster.from_dict(c.to_dict()) == c
    assert "op_overhead_s" not in with_op_overhead([1e12], [0.0]).to_dict()["devices"][0]
