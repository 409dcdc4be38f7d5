"""A plan on virtual devices expanded to one rank per GPU (issue 30, item 2): `engine.expand_to_gpus`."""
from __future__ import annotations

import functools

import pytest
from conftest import TWO_VIRTUAL_MACHINES

import engine
from engine.bundle.archive import check_runnable
from engine.cluster.per_gpu import per_gpu_cluster

TINY_GPT = dict(layers=1, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, batch=12)
MACHINES = TWO_VIRTUAL_MACHINES


@functools.cache
def _planned() -> tuple:
    graph = engine.load_model("zoo:gpt", **TINY_GPT)
    cluster = engine.load_cluster(MACHINES)
    return graph, cluster, engine.plan(graph, cluster, time_budget_s=3)


def test_per_gpu_cluster_splits_each_virtual_device_into_its_gpus_on_the_same_machine():
    gpus = per_gpu_cluster(engine.load_cluster(MACHINES))
    assert [(d.name, d.machine, d.num_gpus) for d in gpus.devices] == [
        ("fast-0", "m0", 1), ("fast-1", "m0", 1), ("slow-0", "m1", 1), ("slow-1", "m1", 1)]
    assert gpus.network.bandwidth_Bps == {"inter_machine": 2e9, "intra_machine": 1e10}  # the slower machine's link
    assert sum(d.flops for d in gpus.devices) == sum(d.flops for d in engine.load_cluster(MACHINES).devices)


def test_expanded_plan_splits_each_machine_share_among_its_gpus_and_runs_one_rank_per_gpu():
    graph, cluster, plan = _planned()
    expanded, gpus = engine.expand_to_gpus(plan, cluster)
    assert expanded.world_size == 4 and expanded.device_names == [d.name for d in gpus.devices]
    assert expanded.cluster_fingerprint == gpus.fingerprint() and expanded.model_fingerprint == plan.model_fingerprint
    assert expanded.program == plan.program
    for before, after in zip(plan.ratio_rows, expanded.ratio_rows):
        assert before[0] > before[1] and sum(after) == pytest.approx(1.0)
        # a machine's GPUs share its part evenly; whole units (4 heads over 4 GPUs here) may even the machines out
        assert after[0] == pytest.approx(after[1], abs=0.05) and after[2] == pytest.approx(after[3], abs=0.05)
        assert after[0] >= after[2]
    assert expanded.search["expanded_from"]["cluster"] == "two_machines"
    assert engine.validate_plan(expanded, gpus) == []
    check_runnable(expanded, gpus)  # the bundle's own check: one process per plan device
    again = engine.load_plan(expanded.to_json())
    assert again.to_json() == expanded.to_json()


def test_a_plan_without_virtual_devices_is_exported_as_it_is():
    graph, _, _ = _planned()
    cluster = per_gpu_cluster(engine.load_cluster(MACHINES))
    plan = engine.plan(graph, cluster, time_budget_s=2)
    assert engine.expand_to_gpus(plan, cluster) == (plan, cluster)


def test_expansion_refuses_another_cluster_and_explains_a_pipeline_plan_in_one_sentence():
    graph, cluster, plan = _planned()
    with pytest.raises(engine.PlanError, match="was made for cluster 'two_machines'"):
        engine.expand_to_gpus(plan, per_gpu_cluster(cluster))

    class Pipeline:  # only what expand_to_gpus reads of a pipeline plan
        parallelism = "pipeline"
        cluster_fingerprint = cluster.fingerprint()
        cluster_name = cluster.name

    with pytest.raises(engine.PlanError, match=r"^A pipeline plan's stages .* per-GPU cluster to run it\.$"):
        engine.expand_to_gpus(Pipeline(), cluster)
