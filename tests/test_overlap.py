"""Tests of the overlap modes of the cost model (engine.overlap, engine.cost): DDP's buckets
overlapped with backward, HiDup's duplex halves, their closed forms against the one timeline
simulator, and the predicted timeline of a priced program."""
from __future__ import annotations

import pytest

import engine
from conftest import build_graph, ce_graph, cluster_dict
from engine.cluster import Cluster
from engine.cost import CostModel, evaluate
from engine.errors import PlanError
from engine.overlap import duplex_chain_time, duplex_problem, grad_buckets
from engine.planner import data_parallel_space
from engine.synthesis import synthesize


def free_network(flops=(1e12, 1e12, 5e11)) -> Cluster:
    """Collectives cost nothing (no latency, a huge bandwidth): overlap cannot change anything."""
    return Cluster.from_dict(cluster_dict(list(flops), latency_s=0.0, bandwidth_Bps=1e30))


@pytest.fixture(scope="module")
def slow() -> Cluster:
    return Cluster.from_dict(cluster_dict([1e12, 1e12, 5e11], latency_s=1e-4, bandwidth_Bps=1e9))


def dp_program(graph, cluster):
    cm = CostModel(graph, cluster, [1 / cluster.num_devices] * cluster.num_devices)
    return synthesize(graph, cm, space=data_parallel_space(graph)).program


# ----------------------------------------------------------------------------- the modes


def test_an_unknown_overlap_mode_is_refused_naming_the_choices(slow):
    with pytest.raises(PlanError, match=r"overlap must be one of none, ddp, duplex, got 'async'"):
        CostModel(ce_graph(), slow, [0.4, 0.4, 0.2], overlap="async")


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
def test_with_a_free_network_every_mode_costs_what_none_costs(mode):
    """No communication time and no per-parameter-byte work: buckets, halves and tails are all free,
    and the halves' computations add up to the whole batch's."""
    graph = ce_graph()
    cluster = free_network()
    ratios = [0.5, 0.3, 0.2]
    program = synthesize(graph, CostModel(graph, cluster, ratios)).program
    none = evaluate(program, CostModel(graph, cluster, ratios))
    other = evaluate(program, CostModel(graph, cluster, ratios, overlap=mode))
    assert other.total_s == pytest.approx(none.total_s, rel=1e-12)
    assert other.overlap == mode and none.overlap == "none"


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
def test_buckets_are_the_plans_full_parameters_by_slot_each_paying_one_latency(slow, mode):
    graph = engine.load_model("zoo:mlp", layers=2, in_features=256, hidden=1024, classes=16, batch=64)
    program = dp_program(graph, slow)
    b = evaluate(program, CostModel(graph, slow, [0.4, 0.4, 0.2], overlap=mode))
    assert [list(x.params) for x in b.buckets] == grad_buckets(graph, program)
    assert len(b.buckets) >= 2, "the 1 MiB first bucket splits this model's 4 MiB of weights"
    fit = slow.collectives["all_reduce"]
    for x in b.buckets:
        assert x.bytes == sum(graph[p].nbytes for p in x.params)
        assert x.duration_s == pytest.approx(fit.latency_s + x.bytes / fit.bandwidth_Bps, rel=1e-12)
        assert x.start_s >= x.ready_s and x.end_s == pytest.approx(x.start_s + x.duration_s, rel=1e-12)
    assert all(a.end_s <= b_.start_s * (1 + 1e-12) for a, b_ in zip(b.buckets, b.buckets[1:])), "one at a time"
    assert b.total_s == pytest.approx(max(b.buckets[-1].end_s, b.total_s - b.tail_s) + b.tail_s, rel=1e-12)


def test_ddp_buckets_of_later_layers_are_ready_earlier_in_backward(slow):
    """One backward stage (data parallelism) still overlaps: a bucket is ready once the backward of
    the layers from its parameters on has run, not at the end of the stage. (A batch large enough
    that backward computes about as long as the buckets take.)"""
    graph = engine.load_model("zoo:mlp", layers=2, in_features=256, hidden=1024, classes=16, batch=4096)
    program = dp_program(graph, slow)
    cm = CostModel(graph, slow, [0.4, 0.4, 0.2], overlap="ddp")
    b = evaluate(program, cm)
    ready = [x.ready_s for x in b.buckets]
    assert ready == sorted(ready) and ready[0] < ready[-1]
    none = evaluate(program, CostModel(graph, slow, [0.4, 0.4, 0.2]))
    assert b.total_s < none.total_s, "overlapping all but the first-layer bucket beats one bucket after backward"


def test_ddp_moves_the_per_parameter_byte_work_to_a_tail_after_the_buckets():
    d = cluster_dict([1e12, 1e12], latency_s=1e-4, bandwidth_Bps=1e9)
    for dev in d["devices"]:
        dev["memory_bandwidth_Bps"] = 1e10
    cluster = Cluster.from_dict(d)
    graph = ce_graph()
    program = dp_program(graph, cluster)
    b = evaluate(program, CostModel(graph, cluster, [0.5, 0.5], "sgd", overlap="ddp"))
    nbytes = sum(n.nbytes for n in graph.parameters)
    assert b.tail_s == pytest.approx(nbytes * (3.0 + 2.0) / 1e10, rel=1e-12)  # SGD's update + the bucket copy
    assert b.tail_device_s == [b.tail_s, b.tail_s]
    assert b.total_s == pytest.approx(b.buckets[-1].end_s + b.tail_s, rel=1e-12)


def test_duplex_halves_the_payload_of_batch_derived_collectives_only(slow):
    graph = ce_graph()
    cm = CostModel(graph, slow, [0.4, 0.4, 0.2], overlap="duplex")
    fit = slow.collectives["all_reduce"]
    h = graph.loss - 2  # the logits: batch-derived
    const, per = cm.half_comm_terms("all_reduce", h)
    assert (const, per) == pytest.approx((fit.latency_s + graph[h].nbytes / fit.bandwidth_Bps / 2, 0.0), rel=1e-12)
    w = next(n.id for n in graph.parameters)
    assert cm.half_comm_terms("all_reduce", w) == cm.comm_terms("all_reduce", w)
    ag = slow.collectives["all_gather"]
    const, per = cm.half_comm_terms("all_gather.padded", h)
    assert const == ag.latency_s and per == pytest.approx(graph[h].nbytes / ag.bandwidth_Bps / 2, rel=1e-12)


def test_duplex_total_is_both_passes_chains_then_the_buckets_then_the_tail(slow):
    graph = ce_graph()
    ratios = [0.4, 0.4, 0.2]
    program = synthesize(graph, CostModel(graph, slow, ratios)).program
    b = evaluate(program, CostModel(graph, slow, ratios, overlap="duplex"))
    psi = 0.0
    for direction in ("forward", "backward"):
        xs = []
        for s, m, comp in zip(b.stages, b.stage_half_comm_s, b.stage_comp_s):
            if s.direction == direction:
                xs += [m, max(comp) / 2]
        psi += duplex_chain_time(xs)
    assert b.total_s == pytest.approx(psi + sum(x.duration_s for x in b.buckets) + b.tail_s, rel=1e-12)
    assert all(x.ready_s == pytest.approx(psi, rel=1e-12) for x in b.buckets)


def test_duplex_is_refused_for_training_mode_batch_norm(slow):
    graph = build_graph([
        ("x", "placeholder", (), (8, 4, 6, 6)),
        ("w", "parameter", (), (4,)),
        ("b", "parameter", (), (4,)),
        ("bn", "batch_norm", (0, 1, 2), (8, 4, 6, 6), 8 * 4 * 36 * 5, {"eps": 1e-5}),
        ("loss", "sum", (3,), (), 8 * 4 * 36),
    ])
    why = duplex_problem(graph)
    assert why is not None and "'bn'" in why and "batch norm" in why and "\n" not in why
    with pytest.raises(PlanError, match="duplex is refused: node 'bn' is a training-mode batch norm"):
        CostModel(graph, slow, [0.4, 0.4, 0.2], overlap="duplex")
    CostModel(graph, slow, [0.4, 0.4, 0.2], overlap="ddp")
    assert duplex_problem(ce_graph()) is None
