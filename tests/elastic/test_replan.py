"""Re-planning on a changed cluster (engine.replan): what changes and what the switch moves."""
from __future__ import annotations

import copy
import math

import pytest
from conftest import cluster_dict

import engine
from engine.elastic.replan import device_link, param_layouts, switch_table
from engine.elastic.reshard import switch_seconds


def two_machines(names: list[str], flops: list[float]) -> dict:
    """Devices on machines m0 (the first two) and m1 (the rest), 1e9 B/s inside, 1e8 B/s between."""
    d = cluster_dict(flops, name="-".join(names))
    for dev, name, j in zip(d["devices"], names, range(len(names))):
        dev["name"], dev["machine"] = name, "m0" if j < 2 else "m1"
    d["network"]["bandwidth_Bps"] = {"intra_machine": 1e9, "inter_machine": 1e8}
    return d


@pytest.fixture(scope="module")
def mlp():
    return engine.load_model("zoo:mlp", layers=2, in_features=8, hidden=24, classes=6, batch=20)


def test_adding_a_device_on_another_machine_reports_it_and_what_it_receives(mlp):
    old = engine.plan(mlp, engine.load_cluster(two_machines(["a", "b"], [2e10, 1e10])), optimizer="sgd")
    new_cluster = engine.load_cluster(two_machines(["a", "b", "c"], [2e10, 1e10, 1e10]))
    result = engine.replan(old, new_cluster)
    rep = result.report
    assert rep.added == ["c"] and rep.removed == []
    assert result.plan.device_names == ["a", "b", "c"] and result.plan.search["optimizer"] == "sgd"
    assert result.plan.search["replan"]["chosen"] in ("fresh search", "old program Q as incumbent")
    assert rep.time_after_s == result.plan.predicted_time_s
    # the new device holds nothing yet: everything it needs comes over the inter-machine link
    need_c = sum(4 * math.prod(b - a for a, b in lay.region(2, shape))
                 for shape, lay, _ in param_layouts(result.plan).values())
    assert rep.received_bytes["c"] == need_c > 0
    assert rep.switch_s == pytest.approx(need_c / 1e8)  # c receives the most, all at 1e8 B/s
    assert "devices removed: -; added: c" in rep.render()


def test_replanning_on_the_same_cluster_moves_nothing_when_the_plan_stays(mlp):
    cluster = engine.load_cluster(two_machines(["a", "b", "c"], [2e10, 1e10, 1e10]))
    old = engine.plan(mlp, cluster, optimizer="adam")
    result = engine.replan(old, cluster)
    if param_layouts(result.plan) == param_layouts(old):
        assert result.report.moved_bytes == 0 and result.report.shardings == []
    assert result.report.time_after_s <= old.predicted_time_s * (1 + 1e-9)


def test_the_link_prefers_a_device_keeping_its_name_then_the_same_machine():
    cluster = engine.load_cluster(two_machines(["a", "b", "c"], [1e10, 1e10, 1e10]))
    link = device_link(["a", "gone", "c"], ["a", "b", "c"], cluster)
    assert link(0, 0) == math.inf and link(0, 1) == 1e9 and link(0, 2) == 1e8
    assert link(1, 0) == cluster.bottleneck_bandwidth_Bps  # a device of the old cluster only


def test_a_switch_between_plans_of_different_models_is_refused(mlp):
    other = engine.load_model("zoo:mlp", layers=1, in_features=8, hidden=24, classes=6, batch=20)
    cluster = engine.load_cluster(two_machines(["a", "b"], [1e10, 1e10]))
    a, b = engine.plan(mlp, cluster, optimizer="sgd"), engine.plan(other, cluster, optimizer="sgd")
    with pytest.raises(engine.PlanError, match="different models"):
        switch_table(a, b, "sgd")
    assert switch_seconds(switch_table(a, a, "sgd"), device_link(a.device_names, a.device_names, None)) == 0.0


def test_a_cluster_less_a_device_or_plus_one_is_validated_again():
    from engine.elastic.replan import with_device, without_devices
    from engine.errors import PlanError

    c = engine.load_cluster(two_machines(["a", "b", "c"], [1e12] * 3))
    assert [d.name for d in without_devices(c, ["b"]).devices] == ["a", "c"]
    with pytest.raises(PlanError, match="has no device 'z'; its devices are a, b, c"):
        without_devices(c, ["z"])
    with pytest.raises(PlanError, match="without devices"):
        without_devices(c, ["a", "b", "c"])
    grown = with_device(c, {**c.devices[2].to_dict(), "name": "d"})
    assert [d.name for d in grown.devices] == ["a", "b", "c", "d"] and grown.devices[3].machine == "m1"
    with pytest.raises(engine.HapError, match="duplicate device name 'a'"):
        with_device(c, c.devices[0].to_dict())  # a second device named 'a'


def test_a_plan_with_hierarchical_collectives_replans_onto_machines_of_unequal_size():
    """On 2 machines of 2 the plan runs a hierarchical collective; without one device the machines
    differ in size, where none is offered: the old Q cannot run there, so only the fresh search
    counts (it used to reach the LP with an infinite price and fail with a PlanError)."""
    from conftest import sample_path

    from engine.cluster.hierarchy import HIER_KEYS
    from engine.elastic.replan import without_devices

    graph = engine.load_model("zoo:mlp", layers=2, in_features=64, hidden=128, batch=32)
    cluster = engine.load_cluster(sample_path("cpu_2x2"))
    old = engine.plan(graph, cluster, time_budget_s=5)
    assert {ins.rule for ins in old.program} & set(HIER_KEYS)
    smaller = without_devices(cluster, [cluster.devices[-1].name])
    result = engine.replan(old, smaller, time_budget_s=5)
    assert result.report.chosen == "fresh search" and result.report.old_program_s is None
    assert result.plan.world_size == 3 and not {ins.rule for ins in result.plan.program} & set(HIER_KEYS)
    assert math.isfinite(result.plan.predicted_time_s)
