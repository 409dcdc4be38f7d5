"""InfeasibleError names its cause (issue 13): the device that runs out of memory with the bytes it
needs and has, or the node that no program gets past and why; never "the search space is empty"."""
from __future__ import annotations

import re

import pytest
from conftest import GIB, build_graph, cluster_dict, sample_dict, with_memory

import engine
from engine import InfeasibleError
from engine.spmd.cost import CostModel
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.theory.core import FULL

_BYTES = r"([\d.]+) GiB"


def _mlp() -> engine.Graph:
    return engine.load_model("zoo:mlp", layers=2, in_features=256, hidden=2048, classes=16, batch=4096)


def test_out_of_memory_names_the_device_and_its_bytes_needed_held_and_what_they_are() -> None:
    graph = _mlp()
    state = sum(n.nbytes for n in graph.parameters) * 4  # parameters, gradients, two adam moments
    # the cluster holds the state (the fail-fast total check passes, the search runs) but no split of
    # the 4096 x 2048 activations fits beside it
    cluster = with_memory(sample_dict("cpu_2"), [state * 0.9, state * 0.7])
    with pytest.raises(InfeasibleError) as info:
        engine.plan(graph, cluster)
    msg = str(info.value)
    assert "\n" not in msg and "search space is empty" not in msg
    m = re.match(rf"out of memory: device 'cpu-(\d)' needs {_BYTES} but has {_BYTES} even data-parallel .*"
                 rf"\(parameters, gradients and adam state {_BYTES}, activations {_BYTES}\); use a smaller batch", msg)
    assert m, msg
    j, (need, has, held, act) = int(m.group(1)), (float(g) for g in m.groups()[1:])
    assert need > has == pytest.approx(cluster.devices[j].memory_bytes_per_gpu / GIB, abs=1e-3)
    assert need == pytest.approx(held + act, abs=2e-3) and held == pytest.approx(state / GIB, abs=1e-3) and act > 0


def test_baseline_that_overflows_names_its_strategy_split() -> None:
    graph = _mlp()
    dp = engine.evaluate(graph, engine.load_cluster(sample_dict("cpu_2")), "dp-even")
    cluster = with_memory(sample_dict("cpu_2"), int(0.5 * dp.memory_bytes[0]))
    with pytest.raises(InfeasibleError, match=rf"out of memory: device 'cpu-\d' needs {_BYTES} but has {_BYTES} "
                                              "even data-parallel with the batch split as dp-even does"):
        engine.evaluate(graph, cluster, "dp-even")


def test_node_without_rules_is_named_with_its_reason() -> None:
    graph = build_graph([
        ("x", "placeholder", (), (8, 4)),
        ("w", "parameter", (), (4, 4)),
        ("h", "linear", (0, 1), (8, 4), 256),
        ("odd", "mystery_op", (2,), (8, 4), 32),
        ("loss", "sum", (3,), (), 32, {"dims": [0, 1], "keepdim": False}),
    ])
    with pytest.raises(InfeasibleError) as info:
        engine.plan(graph, engine.load_cluster(cluster_dict([1e10, 2e10])))
    msg = str(info.value)
    assert msg == "no program: node 'odd' (mystery_op) has no rule in this search space", msg


def test_search_that_gets_stuck_names_the_node_and_its_rules() -> None:
    graph = build_graph([
        ("x", "placeholder", (), (8, 4)),
        ("w", "parameter", (), (6, 4)),
        ("h", "linear", (0, 1), (8, 6), 384),
        ("loss", "sum", (2,), (), 48, {"dims": [0, 1], "keepdim": False}),
    ])
    cluster = engine.load_cluster(cluster_dict([1e10, 2e10]))
    # inputs only sharded on the features, weights only Full, no collectives: linear has no rule for that
    space = SearchSpace(param_forms=lambda n, f: f == FULL, placeholder_forms=lambda n, f: f == 1,
                        collectives=frozenset())
    with pytest.raises(InfeasibleError) as info:
        synthesize(graph, CostModel(graph, cluster, [0.5, 0.5]), space=space)
    msg = str(info.value)
    assert msg.startswith("no program gets past node 'h' (linear): none of its rules (") and "{S(0), F} batch {S(0)}" in msg
    assert "search space is empty" not in msg


def test_synthesis_out_of_memory_says_memory_not_an_empty_space() -> None:
    graph = _mlp()
    cluster = with_memory(sample_dict("cpu_2"), 1024)
    with pytest.raises(InfeasibleError, match=r"^out of memory: every program overflows some device's memory by node '"):
        synthesize(graph, CostModel(graph, cluster, [0.5, 0.5]))
