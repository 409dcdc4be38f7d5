"""Tests of engine.cost's gradient bucket: Full parameters' gradients are all-reduced once, after backward."""
from __future__ import annotations

import pytest

from conftest import ce_graph, cluster_dict
from engine.cluster import Cluster
from engine.cost import CostModel, evaluate
from engine.planner import data_parallel_space
from engine.synthesis import SearchSpace, synthesize
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
