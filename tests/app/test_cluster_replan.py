"""Cluster page, re-plan (issue 16): remove or add a device and see engine.replan's diff and traffic."""
from __future__ import annotations

from ui_helpers import app, cpu_cluster, no_exception, open_page  # noqa: F401 (fixtures)

from app import services
from app.services import Keys


def _table(at, column: str) -> list[dict]:
    """The rows of the page's one dataframe with this column."""
    [df] = [d.value for d in at.dataframe if column in d.value.columns]
    return df.to_dict("records")


def _replan(at, remove=(), add="(none)"):
    at.multiselect(key="cluster.replan.remove").set_value(list(remove))
    at.selectbox(key="cluster.replan.add").set_value(add).run()
    return at.button(key="cluster.replan.run").click().run()


def test_removing_a_device_shows_the_ratio_diff_times_and_the_bytes_each_device_moves(app, cpu_cluster):
    at = open_page(app, "cluster")
    gone = cpu_cluster.devices[-1].name
    at = _replan(at, remove=[gone])
    no_exception(at)
    _, fp, result, new_cluster = at.session_state[services.REPLAN]
    assert fp == new_cluster.fingerprint() and gone not in [d.name for d in new_cluster.devices]
    report = result.report
    assert report.removed == [gone] and result.plan.world_size == cpu_cluster.num_devices - 1
    labels = {m.label: m.value for m in at.metric}
    assert labels["predicted step, before"] == f"{report.time_before_s * 1e3:.4g} ms"
    assert labels["predicted step, after"] == f"{report.time_after_s * 1e3:.4g} ms"
    rows = _table(at, "change")
    assert [r["device"] for r in rows] == [d.name for d in cpu_cluster.devices]
    assert rows[-1]["change"] == "removed" and rows[-1]["after"] == "-"
    moved = _table(at, "sends_bytes")
    every = dict.fromkeys([*report.sent_bytes, *report.received_bytes])
    assert moved == [{"device": n, "sends_bytes": report.sent_bytes.get(n, 0),
                      "receives_bytes": report.received_bytes.get(n, 0)} for n in every]
    assert sum(r["sends_bytes"] for r in moved) == sum(r["receives_bytes"] for r in moved) == report.moved_bytes > 0
    assert any(f"{report.moved_bytes} bytes" in m.value for m in at.markdown)


def test_adding_a_copy_of_a_device_plans_on_one_more_device_and_can_become_current(app, cpu_cluster):
    at = open_page(app, "cluster")
    first = cpu_cluster.devices[0].name
    at = _replan(at, add=first)
    no_exception(at)
    result = at.session_state[services.REPLAN][2]
    assert result.report.added == [f"{first}-new"] and result.plan.world_size == cpu_cluster.num_devices + 1
    assert _table(at, "change")[-1]["change"] == "added"
    at.button(key="cluster.replan.use").click().run()
    no_exception(at)
    assert at.session_state[Keys.CLUSTER].num_devices == cpu_cluster.num_devices + 1
    assert at.session_state[Keys.PLAN].world_size == cpu_cluster.num_devices + 1


def test_without_a_plan_of_this_cluster_the_page_says_to_plan_first(app):
    app.session_state[Keys.PLAN] = None
    at = open_page(app, "cluster")
    no_exception(at)
    assert any("Plan the current model on this cluster first" in i.value for i in at.info)
